"""Byte quantities and data types: parsing operator input and printing it back."""

from __future__ import annotations

import re
from fractions import Fraction

from kvguard.errors import InvalidInputError

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4

# Decimal units are what disk and GPU vendors print ("80 GB"); binary units are what
# nvidia-smi and the kernel print ("81559MiB"). Both are accepted, spelled out, so
# an operator never has to guess which one a bare "G" meant.
_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": TiB,
}
_BYTES_RE = re.compile(r"^\s*(?P<num>[0-9]+(?:\.[0-9]+)?|\.[0-9]+)\s*(?P<unit>[a-zA-Z]*)\s*$")

# Bytes per element of each KV-cache (or weight) data type. llama.cpp's q8_0 and
# q4_0 carry a small per-block scale on top (34 and 18 bytes per 32 values); the
# budget uses the nominal width, as vLLM-style capacity planning does.
DTYPE_BYTES: dict[str, Fraction] = {
    "fp32": Fraction(4),
    "float32": Fraction(4),
    "bf16": Fraction(2),
    "bfloat16": Fraction(2),
    "fp16": Fraction(2),
    "float16": Fraction(2),
    "half": Fraction(2),
    "fp8": Fraction(1),
    "fp8_e4m3": Fraction(1),
    "fp8_e5m2": Fraction(1),
    "fp8_e4m3fn": Fraction(1),
    "int8": Fraction(1),
    "q8_0": Fraction(1),
    "q4": Fraction(1, 2),
    "int4": Fraction(1, 2),
    "q4_0": Fraction(1, 2),
}

KV_DTYPES: tuple[str, ...] = ("auto", *DTYPE_BYTES)


def parse_bytes(text: str, field: str = "memory") -> int:
    """Parse a byte quantity such as ``80GiB``, ``80GB``, ``81559MiB`` or ``1234``.

    A bare number is bytes. Raises :class:`InvalidInputError` naming ``field`` for
    anything else, including negative numbers and unknown units.
    """
    match = _BYTES_RE.match(text)
    allowed = (
        "must be a size like 80GiB, 80GB, 81559MiB or a plain byte count"
        " (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
    )
    if match is None:
        raise InvalidInputError(field, text, allowed)
    unit = match["unit"].lower() or "b"
    if unit not in _UNITS:
        raise InvalidInputError(field, text, allowed)
    value = Fraction(match["num"]) * _UNITS[unit]
    if value.denominator != 1 and unit == "b":
        raise InvalidInputError(field, text, "a byte count must be a whole number")
    return int(value)


def format_bytes(n: int | float) -> str:
    """Render a byte count for people: binary units, one decimal."""
    sign = "-" if n < 0 else ""
    size = abs(n)
    for unit, scale in (
        ("EiB", 1024**6),
        ("PiB", 1024**5),
        ("TiB", TiB),
        ("GiB", GiB),
        ("MiB", MiB),
        ("KiB", KiB),
    ):
        if size >= scale:
            return f"{sign}{size / scale:.1f} {unit}"
    return f"{sign}{int(size)} B"


def dtype_bytes(name: str, field: str = "kv_cache_dtype") -> Fraction:
    """Bytes per element of a named data type; raises naming ``field`` when unknown."""
    key = name.strip().lower()
    if key not in DTYPE_BYTES:
        raise InvalidInputError(field, name, f"must be one of {', '.join(KV_DTYPES)}")
    return DTYPE_BYTES[key]
