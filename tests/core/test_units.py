"""Byte sizes typed by operators, and printed back to them."""

from __future__ import annotations

import pytest

from kvguard.core.gpus import gpu_preset
from kvguard.core.units import GiB, MiB, dtype_bytes, format_bytes, parse_bytes
from kvguard.errors import InvalidInputError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * GiB),
        ("80 GiB", 80 * GiB),
        ("80gib", 80 * GiB),
        ("80GB", 80 * 10**9),
        ("81559MiB", 81_559 * MiB),
        ("1.5GiB", 3 * GiB // 2),
        ("123456", 123_456),
        ("0", 0),
    ],
)
def test_parse_bytes_accepts_binary_and_decimal_units(text, expected):
    """Binary and decimal units, spelled out, and plain byte counts."""
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["-80GiB", "80G", "eighty", "80 GiB extra", "", "1.5"])
def test_parse_bytes_refuses_ambiguous_or_bad_sizes(text):
    """Negative, unit-less-ambiguous or malformed sizes name the field."""
    with pytest.raises(InvalidInputError) as info:
        parse_bytes(text, "--gpu-memory")
    assert info.value.field == "--gpu-memory"


def test_format_bytes_is_human_readable():
    """Sizes print in binary units with one decimal."""
    assert format_bytes(80 * GiB) == "80.0 GiB"
    assert format_bytes(-3 * MiB) == "-3.0 MiB"
    assert format_bytes(512) == "512 B"


def test_dtype_bytes_known_and_unknown():
    """q4 types are half a byte; an unknown dtype lists the allowed ones."""
    assert dtype_bytes("Q4_0") * 2 == 1
    assert dtype_bytes("fp8_e5m2") == 1
    with pytest.raises(InvalidInputError, match="must be one of auto, "):
        dtype_bytes("fp6")


def test_gpu_presets_are_case_insensitive_and_errors_list_them():
    """--gpu h100-80gb works; an unknown name lists every preset."""
    assert gpu_preset("h100-80gb").memory_bytes == 81_559 * MiB
    with pytest.raises(InvalidInputError, match=r"H200-141GB.*MI300X"):
        gpu_preset("H300")
