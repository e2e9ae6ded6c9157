"""Bounds on the work a plan, a model reference or an API call may ask of planc.

A plan is input, often from a pull request that CI checks: nothing in it may make planc run
for minutes. Each bound here is far above what real plans and models need, and exceeding one
is a located diagnostic (or a `ValueError` at the Python API), never a hang. docs/language.md
("Limits") lists them for users.
"""

from __future__ import annotations

# Seconds one `re"..."` selector may spend matching against every module (or parameter)
# name of a model. Python's `re` backtracks: `re"(a|aa)+$"` on a 60-character name would run
# for hours. planc matches with the `regex` package, whose matches take a timeout (P212).
REGEX_BUDGET_S = 1.0

# The most ranks a world, a mesh dimension, a mesh or an `at world =` clause may have: 2**20
# (a million, ten times the largest clusters trained on) keeps every size computation on
# ranks small. The parser refuses larger literals (P103, planc/lang/transform.py), the
# checks a mesh whose dimensions multiply past it (P407), the CLI and the API larger worlds.
MAX_RANKS = 1 << 20

# The most modules a Hugging Face config may describe before planc builds it (P106): the
# estimate is read from the config's layer counts; 405B-class models have about 2,000.
MAX_HF_MODULES = 200_000


def rank_count(value: object, name: str = "world_size") -> int:
    """`value` as a number of ranks, checked at the Python API's boundary.

    Raises:
        TypeError: not an int (a bool is not a rank count, though Python calls it an int).
        ValueError: below 1, or above `MAX_RANKS`.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int number of ranks, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1 rank, got {value}")
    if value > MAX_RANKS:
        raise ValueError(f"{name} = {value} is more than planc's limit of {MAX_RANKS:,} ranks")
    return value
