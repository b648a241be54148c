"""The KV-dtype start flags of each engine kind."""

from __future__ import annotations

import pytest

from kvguard.actuators.engine_flags import (
    flash_attention,
    fp8_flags,
    is_8bit,
    kv_dtype_of,
    supports_fp8,
    with_fp8,
    without_kv_dtype,
)
from kvguard.errors import InvalidInputError


@pytest.mark.parametrize(
    ("kind", "argv", "expected"),
    [
        (
            "vllm",
            ["vllm", "serve", "m", "--kv-cache-dtype", "auto", "--port", "8000"],
            ["vllm", "serve", "m", "--port", "8000", "--kv-cache-dtype", "fp8"],
        ),
        (
            "vllm",
            ["vllm", "serve", "m", "--kv-cache-dtype=bfloat16"],
            ["vllm", "serve", "m", "--kv-cache-dtype", "fp8"],
        ),
        (
            "sglang",
            ["python", "-m", "sglang.launch_server", "--model-path", "m"],
            [
                "python",
                "-m",
                "sglang.launch_server",
                "--model-path",
                "m",
                "--kv-cache-dtype",
                "fp8_e5m2",
            ],
        ),
        (
            "llamacpp",
            ["llama-server", "-m", "m.gguf", "-ctk", "f16", "--cache-type-v=f16", "-fa", "on"],
            [
                "llama-server",
                "-m",
                "m.gguf",
                "-fa",
                "on",
                "--cache-type-k",
                "q8_0",
                "--cache-type-v",
                "q8_0",
            ],
        ),
        (
            "tgi",
            ["text-generation-launcher", "--model-id", "m"],
            ["text-generation-launcher", "--model-id", "m", "--kv-cache-dtype", "fp8_e5m2"],
        ),
    ],
)
def test_fp8_flags_replace_whatever_dtype_the_command_had(kind, argv, expected):
    """The old KV-dtype flags go (both spellings), the fp8 ones are appended."""
    assert with_fp8(argv, kind) == expected
    assert is_8bit(kv_dtype_of(expected, kind))
    assert without_kv_dtype(expected, kind) == without_kv_dtype(argv, kind)


def test_the_dtype_a_command_asks_for():
    """Named, or auto when the command names none."""
    assert kv_dtype_of(["vllm", "serve", "m"], "vllm") == "auto"
    assert kv_dtype_of(["vllm", "--kv-cache-dtype", "fp8_e4m3"], "vllm") == "fp8_e4m3"
    assert kv_dtype_of(["llama-server", "-ctk", "q4_0"], "llamacpp") == "q4_0"


def test_tensorrt_llm_cannot_be_switched():
    """TRT-LLM builds the dtype into its engine: a clear refusal, not a wrong flag."""
    assert not supports_fp8("trtllm")
    assert not supports_fp8(None)
    with pytest.raises(InvalidInputError, match="TensorRT-LLM builds the dtype"):
        fp8_flags("trtllm")


@pytest.mark.parametrize(
    ("dtype", "eight_bit"),
    [("fp8", True), ("fp8_e5m2", True), ("q8_0", True), ("auto", False), ("bfloat16", False)],
)
def test_which_dtypes_are_8_bit(dtype, eight_bit):
    """What counts as 'the engine came back with fp8'."""
    assert is_8bit(dtype) is eight_bit


@pytest.mark.parametrize(
    "fa", [["-fa", "off"], ["--flash-attn", "off"], ["-fa=disabled"], ["-fa", "on", "-fa", "0"]]
)
def test_llamacpp_without_flash_attention_quantizes_only_the_k_cache(fa):
    """A quantized V cache needs flash attention (llama.cpp refuses to start): K only."""
    argv = ["llama-server", "-m", "m.gguf", *fa]
    assert with_fp8(argv, "llamacpp") == [*argv, "--cache-type-k", "q8_0"]


@pytest.mark.parametrize(
    "fa", [["-fa", "on"], ["--flash-attn=enabled"], ["-fa", "off", "-fa", "1"]]
)
def test_llamacpp_with_flash_attention_on_quantizes_both(fa):
    """Flash attention asked for: K and V quantized, the command's flag left as it is."""
    argv = ["llama-server", "-m", "m.gguf", *fa]
    assert with_fp8(argv, "llamacpp") == [
        *argv,
        *("--cache-type-k", "q8_0", "--cache-type-v", "q8_0"),
    ]


@pytest.mark.parametrize("fa", [[], ["--flash-attn", "auto"], ["-fa", "off", "-fa", "auto"]])
def test_llamacpp_left_to_auto_gets_flash_attention_on_with_its_quantized_v(fa):
    """Auto turns flash attention off where a device lacks it: kvguard asks for it outright."""
    argv = ["llama-server", "-m", "m.gguf", *fa]
    fp8 = with_fp8(argv, "llamacpp")
    assert fp8[-6:] == [
        *("--cache-type-k", "q8_0", "--cache-type-v", "q8_0"),
        *("--flash-attn", "on"),
    ]
    assert flash_attention(fp8, {}) == "on"


def test_llamacpp_reads_flash_attention_from_its_environment_under_the_command_line():
    """LLAMA_ARG_FLASH_ATTN counts where the command names no flag; the flag wins over it."""
    argv = ["llama-server", "-m", "m.gguf"]
    assert with_fp8(argv, "llamacpp", {"LLAMA_ARG_FLASH_ATTN": "off"}) == [
        *argv,
        *("--cache-type-k", "q8_0"),
    ]
    assert with_fp8(argv, "llamacpp", {"LLAMA_ARG_FLASH_ATTN": "on"}) == [
        *argv,
        *("--cache-type-k", "q8_0", "--cache-type-v", "q8_0"),
    ]
    on = ["llama-server", "-fa", "on"]
    assert with_fp8(on, "llamacpp", {"LLAMA_ARG_FLASH_ATTN": "off"})[-2:] == [
        "--cache-type-v",
        "q8_0",
    ]
    assert flash_attention(argv, {}) == "auto"
    assert flash_attention(argv, {"LLAMA_ARG_FLASH_ATTN": "true"}) == "on"
