"""Sizes as users write them (64MiB, 1.5GiB, 512MB) and as bytes."""

from __future__ import annotations

import re
from typing import Union

MIB = 1 << 20


UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30,
          "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9}


def parse_bytes(value: Union[int, str]) -> int:
    """64MiB, 1.5GiB, 512MB or a plain number of bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"a size must not be negative, got {value}")
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in UNITS:
        raise ValueError(f"cannot read {value!r} as a size: write e.g. 64MiB, 1GiB or 512MB")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def format_bytes(size: int) -> str:
    """A size for people: 512 B, 1 KiB, 64 MiB, 15.9 GiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(size) >= scale:
            return f"{size / scale:.4g} {unit}"
    return f"{size} B"
