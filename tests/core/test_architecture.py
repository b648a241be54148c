"""Parsing config.json into a model shape: layouts, and clear errors for what is missing."""

from __future__ import annotations

import json

import pytest

from kvguard.config.model_files import BUNDLED_MODELS_DIR
from kvguard.core.architecture import parse_model_config
from kvguard.errors import ModelConfigError

LLAMA_LIKE = {
    "model_type": "llama",
    "num_hidden_layers": 4,
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 1024,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16",
}


def test_head_dim_defaults_to_hidden_over_heads():
    """Without head_dim the width is hidden_size / num_attention_heads."""
    shape = parse_model_config(LLAMA_LIKE)
    assert shape.attention.head_dim == 64
    assert shape.attention.kv_heads == 2


def test_missing_kv_heads_means_multi_head_attention():
    """No num_key_value_heads: every attention head has its own K and V."""
    config = {k: v for k, v in LLAMA_LIKE.items() if k != "num_key_value_heads"}
    assert parse_model_config(config).attention.kv_heads == 8


@pytest.mark.parametrize(
    "field",
    ["num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "intermediate_size"],
)
def test_missing_required_field_is_named(field):
    """An architecture it cannot budget names the missing field; it never guesses."""
    config = {k: v for k, v in LLAMA_LIKE.items() if k != field}
    with pytest.raises(ModelConfigError, match=f"missing field '{field}'") as info:
        parse_model_config(config, source="my/config.json")
    assert info.value.field == field
    assert str(info.value).startswith("my/config.json: ")


def test_mla_needs_rope_dim():
    """An MLA config without qk_rope_head_dim is refused, naming that field."""
    with pytest.raises(ModelConfigError, match="qk_rope_head_dim"):
        parse_model_config({**LLAMA_LIKE, "kv_lora_rank": 512})


def test_unknown_layer_type_is_refused():
    """A layer type kvguard does not know is an error listing the known ones."""
    config = {**LLAMA_LIKE, "layer_types": ["full_attention"] * 3 + ["cross_attention"]}
    with pytest.raises(ModelConfigError, match=r"'cross_attention'.*known: full_attention"):
        parse_model_config(config)


def test_layer_types_must_cover_every_layer():
    """layer_types with the wrong length is an error, not a partial budget."""
    with pytest.raises(ModelConfigError, match="one type per layer"):
        parse_model_config({**LLAMA_LIKE, "layer_types": ["full_attention"]})


def test_sliding_layers_need_a_window():
    """Sliding layers without sliding_window cannot be budgeted."""
    config = {**LLAMA_LIKE, "layer_types": ["sliding_attention", "full_attention"] * 2}
    with pytest.raises(ModelConfigError, match="missing field 'sliding_window'"):
        parse_model_config(config)


def test_state_layers_need_state_fields():
    """A hybrid without Mamba or linear-attention sizes is refused."""
    config = {**LLAMA_LIKE, "layer_types": ["linear_attention", "full_attention"] * 2}
    with pytest.raises(ModelConfigError, match="recurrent state"):
        parse_model_config(config)


def test_non_integer_field_is_refused():
    """A size given as a string is an error naming the field and the value."""
    with pytest.raises(ModelConfigError, match="'hidden_size' must be an integer, got '512'"):
        parse_model_config({**LLAMA_LIKE, "hidden_size": "512"})


def test_unknown_torch_dtype_is_refused():
    """A dtype the budget cannot size is named with the ones it can."""
    with pytest.raises(ModelConfigError, match="torch_dtype"):
        parse_model_config({**LLAMA_LIKE, "torch_dtype": "complex64"})


def test_non_object_config_is_refused():
    """A JSON array is not a config."""
    with pytest.raises(ModelConfigError, match="JSON object"):
        parse_model_config([1, 2])  # type: ignore[arg-type]


def test_float32_checkpoint_is_served_in_16_bits():
    """VLLM's dtype auto serves float32 checkpoints as fp16 (bf16 for Gemma)."""
    shape = parse_model_config({**LLAMA_LIKE, "torch_dtype": "float32"})
    assert (shape.checkpoint_dtype, shape.dtype) == ("fp32", "fp16")


def test_mistral_style_window_applies_to_every_layer():
    """A plain sliding_window (no other layout field) applies to all layers."""
    shape = parse_model_config({**LLAMA_LIKE, "sliding_window": 256})
    assert shape.layer_kinds == ("sliding",) * 4


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"head_dim": -8}, "'head_dim' must be >= 1"),
        ({"num_key_value_heads": 0}, "'num_key_value_heads' must be >= 1"),
        ({"max_position_embeddings": 0}, "'max_position_embeddings' must be >= 1"),
        ({"attn_layer_period": 4, "attn_layer_offset": 4}, "attn_layer_offset (4) must be <"),
        ({"layer_types": ["linear_attention"] * 4}, "no attention layers"),
    ],
)
def test_impossible_values_are_refused(change, message):
    """Values no real model has are errors, not nonsense budgets."""
    with pytest.raises(ModelConfigError) as info:
        parse_model_config({**LLAMA_LIKE, **change})
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hybrid_override_pattern", "M-M*-M-M"),  # Nemotron-H: Mamba, MLP, attention
        ("block_types", ["recurrent", "recurrent", "attention", "recurrent"]),  # RecurrentGemma
        ("attn_type_list", [0, 0, 0, 1]),  # MiniMax: lightning (linear) vs softmax attention
    ],
)
def test_hybrid_layouts_kvguard_cannot_read_are_refused_by_name(field, value):
    """A layout field kvguard does not read is an error naming it, not 'all attention'."""
    with pytest.raises(ModelConfigError) as err:
        parse_model_config({**LLAMA_LIKE, field: value})
    assert err.value.field == field
    assert "cannot budget" in str(err.value)


@pytest.mark.parametrize("hint", ["mamba_d_state", "ssm_state_size", "linear_num_value_heads"])
def test_state_fields_without_a_layout_are_refused(hint):
    """Recurrent-layer fields with no layout placing them: refused, never all-attention."""
    with pytest.raises(ModelConfigError) as err:
        parse_model_config({**LLAMA_LIKE, hint: 16})
    assert err.value.field == hint
    assert "no layout field" in str(err.value)


def test_a_layout_field_that_lists_no_state_layer_is_taken_at_its_word():
    """layer_types naming every layer attention: the state fields beside it are unused."""
    shape = parse_model_config(
        {**LLAMA_LIKE, "layer_types": ["full_attention"] * 4, "linear_num_value_heads": 8}
    )
    assert shape.state_layers == 0
    assert shape.full_layers == 4


# ---------------------------------------------------------------- the context limit
QWEN3_8B = json.loads((BUNDLED_MODELS_DIR / "qwen3-8b" / "config.json").read_text())
YARN_4X = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


@pytest.mark.parametrize(
    ("rope", "limit", "source"),
    [
        (None, 40960, "max_position_embeddings"),
        # Qwen3's model card: YaRN x4 from 32,768 serves 131,072 tokens.
        (YARN_4X, 131072, "YaRN: original_max_position_embeddings 32,768 x factor 4"),
        ({"type": "yarn", "factor": 2.0}, 81920, "yarn rope scaling"),  # no original: the base
        ({"rope_type": "linear", "factor": 2.0}, 81920, "linear rope scaling"),
        ({"rope_type": "dynamic", "factor": 2.0}, 81920, "dynamic rope scaling"),
        # Llama 3.1's own: its max_position_embeddings is already the stretched length.
        (
            {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192},
            40960,
            "max_position_embeddings",
        ),
        ({"rope_type": "longrope", "factor": 4.0}, 40960, "max_position_embeddings"),
        # Transformers v5 nests them per layer type; vLLM takes the last factor.
        (
            {"full_attention": YARN_4X, "sliding_attention": {"rope_type": "default"}},
            131072,
            "YaRN",
        ),
    ],
)
def test_the_context_limit_follows_the_rope_scaling_as_vllm_derives_it(rope, limit, source):
    """As vLLM's _get_and_verify_max_len: max_position_embeddings x the rope factor."""
    config = dict(QWEN3_8B, rope_scaling=rope) if rope is not None else QWEN3_8B
    shape = parse_model_config(config)
    assert shape.context_limit == limit
    assert shape.context_limit_source.startswith(source)
    assert shape.max_position_embeddings == 40960  # the config's own field, unchanged


def test_gemma3s_limit_is_already_scaled():
    """Gemma 3 ships linear x8 with its 131,072 limit: vLLM does not apply it again."""
    config = json.loads((BUNDLED_MODELS_DIR / "gemma-3-27b-it" / "config.json").read_text())
    text = dict(config["text_config"], max_position_embeddings=131072)
    shape = parse_model_config(dict(config, text_config=text))
    assert shape.context_limit == 131072
