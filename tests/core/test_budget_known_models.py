"""The budget reproduces real models' published figures (docs/budget.md, "Worked examples")."""

from __future__ import annotations

import json
import shutil

import pytest

from kvguard.config.model_files import BUNDLED_MODELS_DIR
from kvguard.core.budget import ceil_div
from kvguard.core.units import GiB


@pytest.mark.parametrize(
    ("model", "dtype", "expected"),
    [
        ("llama-3.1-8b", "auto", 131_072),
        ("llama-3.1-8b", "bf16", 131_072),
        ("llama-3.1-8b", "fp8", 65_536),
        ("llama-3.1-8b", "q4_0", 32_768),
        ("llama-3.1-70b", "auto", 327_680),
        ("deepseek-v3", "auto", 70_272),
        ("mistral-7b-v0.1", "auto", 131_072),
        ("gemma-2-9b", "auto", 344_064),
    ],
)
def test_kv_bytes_per_token_whole_model(budget_of, model, dtype, expected):
    """KV bytes per token, whole model, one replica, match the known values."""
    assert budget_of(model, kv_cache_dtype=dtype).budget.kv_bytes_per_token == expected


@pytest.mark.parametrize(
    ("tp", "expected"), [(1, 327_680), (2, 163_840), (8, 40_960), (16, 40_960)]
)
def test_llama_70b_per_gpu_kv_splits_heads_then_replicates(budget_of, tp, expected):
    """8 KV heads split over TP; past 8 GPUs each GPU still holds one head."""
    b = budget_of("llama-3.1-70b", tp=tp).budget
    assert b.kv_bytes_per_token_per_gpu == expected
    assert b.kv_bytes_per_token == 327_680


def test_mla_latent_is_not_split_by_tp(budget_of):
    """DeepSeek-V3's latent is shared by all heads, so every GPU holds all of it."""
    for tp in (1, 8, 16):
        assert budget_of("deepseek-v3", tp=tp).budget.kv_bytes_per_token_per_gpu == 70_272


def test_mistral_sequence_reserves_its_window_and_the_tokens_in_flight(budget_of):
    """Mistral-7B-v0.1's sliding layers reserve window - 1 + one batch, plus one block.

    vLLM 0.11 (one batch in flight, 2,048 batched tokens): min(4,095 + 2,048, L)
    tokens, 385 blocks of 16 at any context past 6,143 (2 MiB a block, whole model).
    """
    for length in (8_192, 32_768):
        b = budget_of(
            "mistral-7b-v0.1",
            max_model_len=length,
            engine_version="0.11",
            max_num_batched_tokens=2048,
        ).budget
        assert b.kv_bytes_per_sequence == 385 * 16 * 131_072
    short = budget_of(
        "mistral-7b-v0.1", max_model_len=1_000, engine_version="0.11", max_num_batched_tokens=2048
    ).budget
    assert short.kv_bytes_per_sequence == (63 + 1) * 16 * 131_072  # 1,000 tokens, +1 block


def test_async_scheduling_doubles_the_tokens_a_window_reserves(budget_of):
    """From 0.21 two batches are in flight: Mistral at 32K reserves 4,095 + 2 x 2,048."""
    b = budget_of("mistral-7b-v0.1", max_model_len=32_768, max_num_batched_tokens=2048).budget
    assert b.kv_bytes_per_sequence == (ceil_div(4_095 + 4_096, 16) + 1) * 16 * 131_072


def test_gemma2_alternates_sliding_and_full_layers(budget_of):
    """Gemma-2-9B: 21 full + 21 sliding layers in two groups of 21.

    At 8,192 tokens the full group holds 512 blocks, the sliding one
    cdiv(4,095 + 2,048, 16) + 1 = 385 (vLLM 0.11, 2,048 batched tokens).
    """
    b = budget_of(
        "gemma-2-9b", max_model_len=8_192, engine_version="0.11", max_num_batched_tokens=2048
    ).budget
    assert b.model.full_layers == 21
    assert b.model.sliding_layers == 21
    assert b.model.layer_kinds[0] == "sliding"
    assert b.kv_bytes_per_sequence == 172_032 * 16 * (512 + 385)


def test_llama_8b_weights_come_from_the_index_when_present(budget_of):
    """The safetensors index beside config.json gives exact weight bytes."""
    b = budget_of("llama-3.1-8b").budget
    assert b.weights_bytes == 16_060_522_496
    assert "exact" in b.weights_source


def test_llama_8b_weights_estimate_within_two_percent(budget_of, tmp_path):
    """Without the index, the shape-based estimate is within 2% of the checkpoint."""
    shutil.copy(BUNDLED_MODELS_DIR / "llama-3.1-8b" / "config.json", tmp_path / "config.json")
    b = budget_of(str(tmp_path)).budget
    assert "estimated" in b.weights_source
    assert abs(b.weights_bytes - 16_060_522_496) / 16_060_522_496 < 0.02


def test_weights_flag_overrides_index(budget_of):
    """--weights-bytes wins over the index file."""
    assert budget_of("llama-3.1-8b", weights_bytes=10 * GiB).budget.weights_bytes == 10 * GiB


@pytest.mark.parametrize(
    ("model", "params_low", "params_high"),
    [
        ("llama-3.1-70b", 70.0e9, 71.2e9),
        ("mistral-7b-v0.1", 7.1e9, 7.4e9),
        ("mixtral-8x7b", 46.4e9, 47.0e9),
        ("qwen2.5-7b-instruct", 7.5e9, 7.7e9),
        ("qwen3-8b", 8.1e9, 8.3e9),
        ("phi-3-mini-4k-instruct", 3.7e9, 3.9e9),
        ("gemma-2-9b", 9.1e9, 9.4e9),
        ("deepseek-v2-lite", 15.5e9, 16.0e9),
        ("jamba-v0.1", 51.0e9, 52.5e9),
        ("qwen3-next-80b-a3b-instruct", 79.0e9, 81.5e9),
    ],
)
def test_weight_estimates_match_published_parameter_counts(
    budget_of, model, params_low, params_high
):
    """Estimated bytes / 2 (bf16) lands on each model's published parameter count."""
    b = budget_of(model).budget
    assert params_low <= b.weights_bytes / 2 <= params_high


def test_fp8_quantized_checkpoint_counts_one_byte_per_linear_weight(budget_of):
    """DeepSeek-V3 ships fp8 linear weights: ~671B parameters in ~0.68 TB."""
    b = budget_of("deepseek-v3").budget
    assert 640e9 <= b.weights_bytes <= 700e9
    assert any("fp8" in a for a in b.assumptions)


def test_hybrid_models_count_only_attention_layers_for_kv(budget_of):
    """Jamba: 4 of 32 layers are attention; Qwen3-Next: 12 of 48; the rest hold state."""
    jamba = budget_of("jamba-v0.1", max_model_len=4_096).budget
    assert (jamba.model.full_layers, jamba.model.state_layers) == (4, 28)
    assert jamba.kv_bytes_per_token == 4 * 2 * 8 * 128 * 2
    # Mamba state: d_inner = 2 * 4096; conv (4 - 1) + ssm 16 values per channel, bf16.
    assert jamba.state_bytes_per_sequence_per_gpu == 28 * 8_192 * (3 + 16) * 2

    nxt = budget_of("qwen3-next-80b-a3b-instruct", max_model_len=4_096).budget
    assert (nxt.model.full_layers, nxt.model.state_layers) == (12, 36)
    assert nxt.kv_bytes_per_token == 12 * 2 * 2 * 256 * 2
    conv = 3 * (2 * 16 * 128 + 32 * 128)
    recurrent = 32 * 128 * 128
    assert nxt.state_bytes_per_sequence_per_gpu == 36 * (conv + recurrent) * 2


def test_gemma3_nested_text_config_and_pattern(budget_of):
    """Gemma 3 keeps the LM under text_config; 1 global layer in every 6; defaults are reported."""
    b = budget_of("gemma-3-27b-it").budget
    assert (b.model.full_layers, b.model.sliding_layers) == (10, 52)
    assert b.model.sliding_window == 1_024
    assert b.kv_bytes_per_token == 62 * 2 * 16 * 128 * 2
    assert any("vocab_size" in a for a in b.assumptions)


def test_gpt_oss_layer_types_and_mxfp4(budget_of):
    """gpt-oss lists its layer types; its experts are MXFP4 (~13 GiB for 20B)."""
    b = budget_of("gpt-oss-20b").budget
    assert (b.model.full_layers, b.model.sliding_layers) == (12, 12)
    assert b.model.sliding_window == 128
    assert 12 * GiB <= b.weights_bytes <= 14 * GiB
    assert any("torch_dtype" in a for a in b.assumptions)


def test_qwen2_sliding_window_disabled_is_ignored(budget_of):
    """Qwen2.5 carries sliding_window but use_sliding_window false: every layer is full."""
    b = budget_of("qwen2.5-7b-instruct").budget
    assert b.model.sliding_layers == 0
    assert b.kv_bytes_per_token == 28 * 2 * 4 * 128 * 2


def test_qwen2_sliding_window_enabled_uses_max_window_layers(budget_of, tmp_path):
    """With use_sliding_window, layers from max_window_layers on keep the window."""
    config = json.loads((BUNDLED_MODELS_DIR / "qwen2.5-7b-instruct" / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=4_096, max_window_layers=20)
    (tmp_path / "config.json").write_text(json.dumps(config))
    b = budget_of(
        str(tmp_path), max_model_len=32_768, engine_version="0.11", max_num_batched_tokens=2048
    ).budget
    assert (b.model.full_layers, b.model.sliding_layers) == (20, 8)
    # Groups of 8 layers (the smaller kind): the 20 full layers fill three groups,
    # four of whose layers are padding vLLM still allocates; the sliding group holds
    # cdiv(4,095 + 2,048, 16) + 1 = 385 blocks.
    per_layer_block = 2 * 4 * 128 * 2 * 16
    assert b.kv_bytes_per_sequence == per_layer_block * 8 * (3 * 2_048 + 385)


def test_fixed_pool_that_overcommits_the_gpu_does_not_fit(budget_of):
    """A fixed pool too big for the GPU is a shortfall even when it holds the worst case."""
    b = budget_of(
        "llama-3.1-8b",
        gpu_memory_bytes=80 * GiB,
        kv_cache_memory_bytes=70 * GiB,
        max_model_len=8192,
    ).budget
    assert b.unallocated_bytes_per_gpu < 0
    assert not b.fits
    assert b.headroom_bytes_per_gpu == b.unallocated_bytes_per_gpu


def test_pipeline_stages_hold_their_own_layers(budget_of):
    """Gemma-2 over pp=4: stages of 11, 11, 10, 10 layers; the fullest sets the per-GPU figure."""
    b = budget_of(
        "gemma-2-9b", pp=4, max_model_len=8192, engine_version="0.11", max_num_batched_tokens=2048
    ).budget
    # Stage 1 holds layers 11-21: six full (odd) and five sliding, the most KV per
    # sequence. Six and five are within 1.5x, so both groups hold six layers (one of
    # the sliding group's is padding); the sliding one holds 385 blocks of 16.
    assert b.kv_bytes_per_token_per_gpu == 11 * 8_192
    assert b.kv_bytes_per_sequence_per_gpu == 8_192 * 16 * 6 * (512 + 385)


def test_kv_dtype_names_are_case_insensitive(budget_of):
    """AUTO and ' FP8 ' are the same as auto and fp8."""
    assert budget_of("llama-3.1-8b", kv_cache_dtype="AUTO").budget.kv_cache_dtype == "bf16"
    assert budget_of("llama-3.1-8b", kv_cache_dtype=" FP8 ").budget.kv_bytes_per_token == 65_536
