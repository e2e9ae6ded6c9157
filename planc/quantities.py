"""Numbers for people in messages: byte sizes (`70.00 GiB`), counts (`8.03B`) and shapes (`2x512`)."""

from __future__ import annotations


def show_bytes(n: float) -> str:
    """`70.00 GiB`, `12.50 KiB`, `512 B`: the binary unit that keeps the number readable."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def show_count(n: float) -> str:
    """`8.03B`, `45.18K`, `512`: a parameter or token count in decimal units."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def show_shape(shape: tuple[int, ...]) -> str:
    """`2x512`: a shape as a plan writes it."""
    return "x".join(map(str, shape))
