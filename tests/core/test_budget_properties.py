"""Properties of the budget that must hold for any model and any serving parameters."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from kvguard.core.architecture import parse_model_config
from kvguard.core.budget import BudgetInputs, compute_budget
from kvguard.core.units import GiB


@st.composite
def configs(draw: st.DrawFn) -> dict[str, object]:
    """Random but valid configs: GQA or MLA, optional sliding windows and hybrid state."""
    layers = draw(st.integers(1, 64))
    heads = draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64]))
    config: dict[str, object] = {
        "num_hidden_layers": layers,
        "hidden_size": heads * draw(st.sampled_from([32, 64, 128])),
        "num_attention_heads": heads,
        "num_key_value_heads": draw(st.sampled_from([h for h in (1, 2, 4, 8) if h <= heads])),
        "intermediate_size": draw(st.integers(64, 30_000)),
        "vocab_size": draw(st.integers(100, 300_000)),
        "max_position_embeddings": draw(st.integers(256, 262_144)),
        "torch_dtype": draw(st.sampled_from(["bfloat16", "float16", "float32"])),
    }
    if draw(st.booleans()):
        config.update(
            kv_lora_rank=draw(st.integers(16, 1024)), qk_rope_head_dim=64, qk_nope_head_dim=128
        )
    if draw(st.booleans()):
        kinds = ["full_attention", "sliding_attention", "linear_attention"]
        config["layer_types"] = [
            draw(st.sampled_from(kinds[:2])),  # at least one attention layer
            *draw(st.lists(st.sampled_from(kinds), min_size=layers - 1, max_size=layers - 1)),
        ]
        config["sliding_window"] = draw(st.integers(1, 8192))
        config.update(
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_conv_kernel_dim=4,
        )
    return config


def valid_tp(config: dict[str, object], tp: int) -> bool:
    """Whether an engine accepts this tensor-parallel size for the config."""
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    assert isinstance(heads, int)
    assert isinstance(kv, int)
    mla = "kv_lora_rank" in config
    return heads % tp == 0 and (mla or kv % tp == 0 or tp % kv == 0)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[dict[str, object], BudgetInputs]:
    """A config and serving inputs that an engine would accept for it."""
    config = draw(configs())
    tp = draw(st.sampled_from([t for t in (1, 2, 4, 8, 16) if valid_tp(config, t)]))
    limit = config["max_position_embeddings"]
    assert isinstance(limit, int)
    inputs = BudgetInputs(
        tp=tp,
        max_model_len=draw(st.integers(1, limit)),
        concurrency=draw(st.integers(1, 512)),
        kv_cache_dtype=draw(st.sampled_from(["auto", "bf16", "fp16", "fp8", "q4_0"])),
        gpu_memory_bytes=draw(st.integers(1 * GiB, 200 * GiB)),
        gpu_memory_utilization=draw(st.floats(0.05, 1.0)),
        block_size=draw(st.sampled_from([1, 8, 16, 32, 128])),
    )
    return config, inputs


def budget(config, inputs):
    """Budget with a fixed weight size so only the property under test varies."""
    return compute_budget(
        parse_model_config(config), inputs, weights_bytes=5 * GiB, weights_source="test"
    )


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_budget_lines_are_non_negative_except_headroom(scenario):
    """Every size the budget reports is >= 0; only headroom and unallocated may go negative."""
    b = budget(*scenario)
    for name in (
        "kv_bytes_per_token",
        "kv_bytes_per_token_per_gpu",
        "kv_bytes_per_sequence",
        "kv_bytes_per_sequence_per_gpu",
        "state_bytes_per_sequence_per_gpu",
        "weights_bytes_per_gpu",
        "activation_bytes_per_gpu",
        "overhead_bytes_per_gpu",
        "kv_pool_bytes_per_gpu",
        "kv_capacity_tokens",
        "worst_case_kv_bytes_per_gpu",
        "max_concurrency",
        "max_model_len_at_concurrency",
    ):
        assert getattr(b, name) >= 0, name


@settings(max_examples=150, deadline=None)
@given(scenarios(), st.integers(1, 64))
def test_more_concurrency_never_lengthens_the_max_context(scenario, extra):
    """Holding more sequences at once never allows each of them a longer context."""
    config, inputs = scenario
    fewer = budget(config, inputs)
    more = budget(config, replace(inputs, concurrency=inputs.concurrency + extra))
    assert more.max_model_len_at_concurrency <= fewer.max_model_len_at_concurrency


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_fp8_never_holds_fewer_tokens_than_bf16(scenario):
    """Halving bytes per value never shrinks the token capacity or max concurrency."""
    config, inputs = scenario
    bf16 = budget(config, replace(inputs, kv_cache_dtype="bf16"))
    fp8 = budget(config, replace(inputs, kv_cache_dtype="fp8"))
    assert fp8.kv_capacity_tokens >= bf16.kv_capacity_tokens
    assert fp8.max_concurrency >= bf16.max_concurrency


@settings(max_examples=150, deadline=None)
@given(scenarios(), st.sampled_from([2, 4, 8, 16]))
def test_more_tp_never_raises_per_gpu_kv_bytes(scenario, factor):
    """Spreading a replica over more GPUs never puts more KV (or state) on each."""
    config, inputs = scenario
    assume(valid_tp(config, inputs.tp * factor))
    narrow = budget(config, inputs)
    wide = budget(config, replace(inputs, tp=inputs.tp * factor))
    assert wide.kv_bytes_per_token_per_gpu <= narrow.kv_bytes_per_token_per_gpu
    assert wide.kv_bytes_per_sequence_per_gpu <= narrow.kv_bytes_per_sequence_per_gpu
    assert wide.state_bytes_per_sequence_per_gpu <= narrow.state_bytes_per_sequence_per_gpu


# Found by the property below: at max_model_len 1, vLLM's default batch is 256 tokens
# (max_num_seqs x max_model_len), at any longer context 2,048, whose activation peak
# leaves this 16-way model no pool at all: the max context is 0, not what the small
# batch's pool would hold.
SMALL_BATCH_AT_ONE_TOKEN = (
    {
        "num_hidden_layers": 49,
        "hidden_size": 512,
        "num_attention_heads": 16,
        "num_key_value_heads": 1,
        "intermediate_size": 64,
        "vocab_size": 100,
        "max_position_embeddings": 256,
        "torch_dtype": "bfloat16",
    },
    BudgetInputs(
        tp=16,
        max_model_len=1,
        concurrency=1,
        gpu_memory_bytes=10_266_718_616,
        gpu_memory_utilization=0.375,
        block_size=1,
    ),
)


@settings(max_examples=100, deadline=None)
@given(scenarios())
@example(SMALL_BATCH_AT_ONE_TOKEN)
def test_max_context_is_tight(scenario):
    """The reported max context fits, and one more block would not (unless at the model cap)."""
    config, inputs = scenario
    b = budget(config, inputs)
    length = b.max_model_len_at_concurrency
    if length == 0 or length + inputs.block_size > b.max_model_len_cap:
        return
    at = budget(config, replace(inputs, max_model_len=length))
    over = budget(config, replace(inputs, max_model_len=length + inputs.block_size))
    used = at.worst_case_kv_bytes_per_gpu + at.worst_case_state_bytes_per_gpu
    assert used <= at.kv_pool_bytes_per_gpu
    over_used = over.worst_case_kv_bytes_per_gpu + over.worst_case_state_bytes_per_gpu
    assert over_used > over.kv_pool_bytes_per_gpu
