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
# nvidia-smi, torch and the kernel print ("81559MiB", "79.19 GiB"); Kubernetes
# writes binary units without the B ("24Gi"). All are accepted, case-insensitively.
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
    "ki": KiB,
    "mi": MiB,
    "gi": GiB,
    "ti": TiB,
}
# A lone suffix letter follows vLLM's human_readable_int (vllm/utils/argparse_utils.py,
# used by vLLM's --max-model-len, --max-num-batched-tokens and --kv-cache-memory-bytes):
# lowercase is decimal, uppercase is binary. So "24G" means here what it means in
# `vllm serve --kv-cache-memory-bytes 24G`: 24 GiB; "24g" is 24 * 10**9.
_SUFFIXES: dict[str, int] = {
    "k": 1000,
    "m": 1000**2,
    "g": 1000**3,
    "t": 1000**4,
    "K": KiB,
    "M": MiB,
    "G": GiB,
    "T": TiB,
}
_BYTES_RE = re.compile(r"^\s*(?P<num>[0-9]+(?:\.[0-9]+)?|\.[0-9]+)\s*(?P<unit>[a-zA-Z]*)\s*$")
_COUNT_RE = re.compile(r"^(?P<num>[0-9]+(?:\.[0-9]+)?)(?P<suffix>[kKmMgGtT])$")
_SIZE_ALLOWED = (
    "must be a size like 80GiB, 24Gi, 24G, 80GB, 81559MiB or a plain byte count"
    " (GiB/Gi/G = 1024**3, GB/g = 1000**3; likewise K, M, T)"
)
_COUNT_ALLOWED = (
    "must be a whole number like 32768, 32k (= 32,000) or 32K (= 32,768);"
    " lowercase k/m/g/t are powers of 1000, uppercase K/M/G/T powers of 1024, as vLLM reads them"
)

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
    """Parse a byte quantity as operators type it: ``80GiB``, ``24Gi``, ``24G``, ``80GB``.

    Spelled-out units are case-insensitive: ``KiB``/``Ki`` … ``TiB``/``Ti`` are binary,
    ``KB`` … ``TB`` decimal, ``B`` bytes. A lone letter reads as vLLM's own flags read it:
    ``K``/``M``/``G``/``T`` binary, ``k``/``m``/``g``/``t`` decimal. A bare number is bytes
    and must be whole; a fraction of a larger unit rounds down to whole bytes. Raises
    :class:`InvalidInputError` naming ``field`` for anything else, negative numbers included.
    """
    match = _BYTES_RE.match(text)
    if match is None:
        raise InvalidInputError(field, text, _SIZE_ALLOWED)
    unit = match["unit"]
    scale = _SUFFIXES.get(unit) if len(unit) == 1 and unit.lower() != "b" else None
    if scale is None:
        scale = _UNITS.get(unit.lower() or "b")
    if scale is None:
        raise InvalidInputError(field, text, _SIZE_ALLOWED)
    value = Fraction(match["num"]) * scale
    if value.denominator != 1 and scale == 1:
        raise InvalidInputError(field, text, "a byte count must be a whole number")
    return int(value)


def parse_count(text: str, field: str) -> int:
    """Parse a token count as vLLM's ``human_readable_int`` does: ``32768``, ``32k``, ``32K``.

    A lowercase suffix multiplies by a power of 1000 and may follow a decimal
    (``25.6k`` = 25,600); an uppercase one by a power of 1024 and needs a whole number
    (``32K`` = 32,768), as in vLLM. Unlike vLLM, a decimal that does not come out whole
    (``1.0005k``) is refused rather than truncated. The range is checked by the caller;
    anything unparsable raises :class:`InvalidInputError` naming ``field``.
    """
    value = text.strip()
    match = _COUNT_RE.match(value)
    if match is not None:
        number, suffix = match["num"], match["suffix"]
        if suffix.isupper() and "." in number:
            raise InvalidInputError(
                field,
                text,
                f"decimals are not allowed with the binary suffix {suffix}"
                f" (did you mean {number}{suffix.lower()}?)",
            )
        count = Fraction(number) * _SUFFIXES[suffix]
        if count.denominator != 1:
            raise InvalidInputError(field, text, "must come out a whole number of tokens")
        return int(count)
    if re.fullmatch(r"[+-]?[0-9]+", value) is None:
        raise InvalidInputError(field, text, _COUNT_ALLOWED)
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
