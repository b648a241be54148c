"""The KV-dtype start flags of each engine kind."""

from __future__ import annotations

import pytest

from kvguard.actuators.engine_flags import (
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
            ["llama-server", "-m", "m.gguf", "-ctk", "f16", "--cache-type-v=f16", "-c", "4096"],
            [
                "llama-server",
                "-m",
                "m.gguf",
                "-c",
                "4096",
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
    "fa", [[], ["-fa", "on"], ["--flash-attn", "auto"], ["-fa", "off", "-fa", "on"]]
)
def test_llamacpp_with_flash_attention_on_or_auto_quantizes_both(fa):
    """On, auto (llama.cpp then turns it on for a quantized V cache) or unset: K and V."""
    argv = ["llama-server", "-m", "m.gguf", *fa]
    assert with_fp8(argv, "llamacpp")[-4:] == ["--cache-type-k", "q8_0", "--cache-type-v", "q8_0"]
