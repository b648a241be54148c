"""Byte sizes typed by operators, and printed back to them."""

from __future__ import annotations

import re

import pytest

from kvguard.core.units import GiB, MiB, TiB, dtype_bytes, format_bytes, parse_bytes, parse_count
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
        ("512b", 512),
        # Kubernetes-style binary units.
        ("24Gi", 24 * GiB),
        ("24gi", 24 * GiB),
        ("512Mi", 512 * MiB),
        # A lone letter as vLLM's flags read it: uppercase binary, lowercase decimal.
        ("24G", 24 * GiB),
        ("24g", 24 * 10**9),
        ("2T", 2 * TiB),
        ("512M", 512 * MiB),
        ("1.5G", 3 * GiB // 2),
        ("80gb", 80 * 10**9),
    ],
)
def test_parse_bytes_accepts_binary_and_decimal_units(text, expected):
    """Binary and decimal units, spelled out or as one letter, and plain byte counts."""
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "text", ["-80GiB", "eighty", "80 GiB extra", "", "1.5", "80Gx", "80X", "80GiBs", "1e9"]
)
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


def test_size_errors_say_which_units_mean_what():
    """The error spells out that G/Gi/GiB are binary and GB/g decimal."""
    with pytest.raises(InvalidInputError, match=r"GiB/Gi/G = 1024\*\*3, GB/g = 1000\*\*3"):
        parse_bytes("24Q", "--gpu-memory")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("32768", 32_768),
        ("32k", 32_000),
        ("32K", 32_768),
        ("128K", 131_072),
        ("25.6k", 25_600),
        ("1m", 1_000_000),
        ("1M", 1_048_576),
        ("2g", 2_000_000_000),
        ("1G", 2**30),
        (" 8k ", 8_000),
        ("-1", -1),  # the range is the caller's to check, as vLLM's int() leaves it
    ],
)
def test_parse_count_reads_counts_as_vllm_does(text, expected):
    """Counts read as vLLM's human_readable_int: lowercase decimal, uppercase binary."""
    assert parse_count(text, "--max-model-len") == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1.5K", "decimals are not allowed with the binary suffix K (did you mean 1.5k?)"),
        ("1.0005k", "whole number of tokens"),
        ("32 k", "must be a whole number like 32768, 32k"),
        ("32kb", "must be a whole number like 32768, 32k"),
        ("auto", "uppercase K/M/G/T powers of 1024"),
        ("", "must be a whole number"),
        ("3.5", "must be a whole number"),
    ],
)
def test_parse_count_refuses_what_is_not_a_count(text, message):
    """Errors name the flag, the value, and what is allowed."""
    with pytest.raises(InvalidInputError, match=re.escape(message)) as info:
        parse_count(text, "--max-model-len")
    assert info.value.field == "--max-model-len"
    assert info.value.value == text
