"""Hardware profiles for the step-time model: compute peaks, memory and link bandwidths, latencies.

A profile is what `planc/estimate/time.py` needs to turn FLOPs and bytes into seconds:

* peak **dense** FLOP/s per GPU for bf16 (tensor cores) and fp32 (no TF32: PyTorch's default
  for float32 matmuls), and HBM bandwidth;
* collectives in the alpha-beta form nccl-tests define (`doc/PERFORMANCE.md` of
  NVIDIA/nccl-tests): a collective moving `S` bytes over `n` ranks takes
  `alpha + S * factor(n) / busbw`, with `factor` = (n-1)/n for all-gather and reduce-scatter
  (S: the gathered output / the scattered input) and 2(n-1)/n for all-reduce; `busbw` and
  `alpha` for a group inside one node (NVLink/NVSwitch) and for a group spanning nodes
  (the per-GPU network bandwidth: one NIC per GPU);
* host<->device bandwidth (offload), the bytes per second an optimizer step on the host
  streams (offloaded units step there; 20 GB/s, an a priori figure for a foreach AdamW on
  a server CPU), and GPUs per node;
* `efficiency`: the fraction of peak FLOP/s the model assumes compute achieves (one factor for
  every op, chosen a priori, never fitted to a measurement), stated in every output.

Built-in profiles (`PROFILES`) carry vendor datasheet peaks. Bus bandwidths are the
nccl-tests figures published for these systems, rounded down; the sources are in
docs/time-model.md. A user profile is a small TOML or JSON file with the same fields
(`planc explain --hardware FILE`), any field left out taken from the profile it names as `base`
(default `h100`).
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, fields, replace
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
    import tomli as tomllib  # type: ignore[no-redef]


@dataclass(frozen=True)
class Link:
    """One class of link in nccl-tests' alpha-beta form: latency `alpha_s`, bus bandwidth `busbw` (B/s)."""

    alpha_s: float
    busbw: float

    def collective_s(self, kind: str, nbytes: int, ranks: int) -> float:
        """Seconds for one collective of `kind` moving `nbytes` (nccl-tests' size) over `ranks`."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        factor = BUS_FACTOR[kind](ranks)
        return self.alpha_s + nbytes * factor / self.busbw


# nccl-tests' bus-bandwidth factors: busbw = algbw * factor (doc/PERFORMANCE.md)
BUS_FACTOR = {
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,  # alltoall_perf: each rank keeps 1/n of its input
}


@dataclass(frozen=True)
class Hardware:
    """One GPU type in one kind of node (see the module docstring for each field's meaning)."""

    name: str
    bf16_flops: float        # peak dense FLOP/s, bf16/fp16 tensor cores
    fp32_flops: float        # peak FLOP/s, fp32 without TF32
    hbm_bw: float            # B/s
    gpus_per_node: int
    intra: Link              # a group within one node
    inter: Link              # a group spanning nodes
    host_bw: float           # B/s each way, host <-> device (offload)
    efficiency: float = 0.6  # achievable fraction of peak FLOP/s (stated in every output)
    host_optimizer_bw: float = 20e9  # B/s an optimizer step on the host streams (offloaded units)
    source: str = ""

    def flops(self, dtype_name: str) -> float:
        """Peak dense FLOP/s for a compute dtype (`bfloat16`, `float16`, `float32`)."""
        return self.fp32_flops if dtype_name in ("float32", "fp32", "float64") else self.bf16_flops

    def link(self, span_ranks: int) -> Link:
        """The link class of a group whose ranks cover `span_ranks` consecutive ranks."""
        return self.intra if span_ranks <= self.gpus_per_node else self.inter


G, T = 1e9, 1e12
PROFILES: dict[str, Hardware] = {
    "h100": Hardware(
        "h100", bf16_flops=989 * T, fp32_flops=67 * T, hbm_bw=3350 * G, gpus_per_node=8,
        intra=Link(alpha_s=10e-6, busbw=360 * G), inter=Link(alpha_s=20e-6, busbw=45 * G), host_bw=50 * G,
        source="NVIDIA H100 SXM5 datasheet; NVLink4 8-GPU HGX and 8x400 Gb/s InfiniBand nccl-tests busbw"),
    "h200": Hardware(
        "h200", bf16_flops=989 * T, fp32_flops=67 * T, hbm_bw=4800 * G, gpus_per_node=8,
        intra=Link(alpha_s=10e-6, busbw=360 * G), inter=Link(alpha_s=20e-6, busbw=45 * G), host_bw=50 * G,
        source="NVIDIA H200 SXM datasheet (H100 compute, HBM3e); same NVLink4/InfiniBand fabric as h100"),
    "a100": Hardware(
        "a100", bf16_flops=312 * T, fp32_flops=19.5 * T, hbm_bw=2039 * G, gpus_per_node=8,
        intra=Link(alpha_s=10e-6, busbw=230 * G), inter=Link(alpha_s=20e-6, busbw=22 * G), host_bw=25 * G,
        source="NVIDIA A100 80GB SXM datasheet; NVLink3 HGX and 8x200 Gb/s HDR InfiniBand nccl-tests busbw"),
    "b200": Hardware(
        "b200", bf16_flops=2250 * T, fp32_flops=75 * T, hbm_bw=8000 * G, gpus_per_node=8,
        intra=Link(alpha_s=10e-6, busbw=700 * G), inter=Link(alpha_s=20e-6, busbw=45 * G), host_bw=50 * G,
        source="NVIDIA HGX B200 datasheet; NVLink5 and 8x400 Gb/s network"),
}
ALIASES = {"h100-sxm": "h100", "h100_sxm": "h100", "a100-80gb": "a100", "a100_80gb": "a100"}


class HardwareError(ValueError):
    """A hardware name or file that cannot be used (the message says why)."""


def _from_mapping(data: dict[str, Any], origin: str) -> Hardware:
    base_name = str(data.pop("base", "h100")).lower()
    if base_name not in PROFILES:
        raise HardwareError(f"{origin}: unknown base profile `{base_name}` (known: {', '.join(PROFILES)})")
    base = PROFILES[base_name]
    known = {f.name for f in fields(Hardware)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise HardwareError(f"{origin}: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    changes: dict[str, Any] = {}
    for key, value in data.items():
        if key in ("intra", "inter"):
            if not isinstance(value, dict) or set(value) - {"alpha_s", "busbw"}:
                raise HardwareError(f"{origin}: `{key}` must be a table with `alpha_s` and `busbw`")
            link = getattr(base, key)
            changes[key] = Link(float(value.get("alpha_s", link.alpha_s)), float(value.get("busbw", link.busbw)))
        elif key in ("name", "source"):
            changes[key] = str(value)
        elif key == "gpus_per_node":
            changes[key] = int(value)
        else:
            changes[key] = float(value)
    hw = replace(base, **changes)
    if not 0 < hw.efficiency <= 1:
        raise HardwareError(f"{origin}: `efficiency` must be in (0, 1], got {hw.efficiency}")
    if min(hw.bf16_flops, hw.fp32_flops, hw.hbm_bw, hw.host_bw, hw.intra.busbw, hw.inter.busbw) <= 0 \
            or hw.gpus_per_node < 1:
        raise HardwareError(f"{origin}: rates and `gpus_per_node` must be positive")
    return hw


def hardware(spec: "str | Hardware | pathlib.Path") -> Hardware:
    """A built-in profile by name (`h100`, `h200`, `a100`, `b200`), or one read from a TOML/JSON file."""
    if isinstance(spec, Hardware):
        return spec
    name = str(spec)
    key = ALIASES.get(name.lower(), name.lower())
    if key in PROFILES:
        return PROFILES[key]
    path = pathlib.Path(name)
    if not path.is_file():
        raise HardwareError(f"unknown hardware `{name}`: give one of {', '.join(PROFILES)} or a .toml/.json file")
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as err:
        raise HardwareError(f"{name}: not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {err}") from err
    if not isinstance(data, dict):
        raise HardwareError(f"{name}: expected a table of fields")
    data.setdefault("name", path.stem)
    return _from_mapping(dict(data), name)
