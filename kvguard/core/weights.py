"""Estimate a model's weight bytes from its config when no weight index is at hand.

The estimate counts the parameters of every tensor the architecture implies
(embeddings, attention including MLA's low-rank projections, Mamba and
linear-attention mixers, dense or mixture-of-experts MLPs, norms, an untied
``lm_head``) and multiplies by the stored width. It ignores biases other than the
attention QKV bias and small per-block quantization scales: for Llama-3.1-8B it
equals the checkpoint's size. Multimodal towers are not counted. A
quantization scheme it does not know is an error that says to pass the real size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from kvguard.core.architecture import ConfigFields, ModelShape
from kvguard.core.units import DTYPE_BYTES


@dataclass(frozen=True)
class WeightEstimate:
    """Estimated weight bytes of the whole model and how they were derived."""

    total_bytes: int
    parameters: int
    notes: tuple[str, ...]


def estimate_weights(cfg: ConfigFields, shape: ModelShape) -> WeightEstimate:
    """Parameter count and bytes of ``shape``, read together with its raw ``cfg``."""
    notes: list[str] = []
    dense_bytes = DTYPE_BYTES[shape.dtype]
    linear_bytes, expert_bytes, quant_note = _quantized_widths(cfg, dense_bytes)
    if quant_note:
        notes.append(quant_note)

    embed = shape.vocab_size * shape.hidden_size
    tied = shape.tie_word_embeddings
    if tied is None:
        tied = False
        notes.append(
            "config does not say whether lm_head is tied to the embeddings: counted untied"
        )
    lm_head = 0 if tied else embed

    per_layer_linear = 0
    per_layer_experts = 0
    norms = shape.hidden_size  # final norm
    for index, kind in enumerate(shape.layer_kinds):
        if kind == "state":
            per_layer_linear += _state_mixer_params(cfg, shape)
        else:
            per_layer_linear += _attention_params(cfg, shape)
        dense, experts = _mlp_params(shape, index)
        per_layer_linear += dense
        per_layer_experts += experts
        norms += 2 * shape.hidden_size
    if cfg.nested:
        notes.append("weights of non-text towers (vision, audio) are not counted")

    parameters = embed + lm_head + per_layer_linear + per_layer_experts + norms
    total = (
        (embed + lm_head + norms) * dense_bytes
        + per_layer_linear * linear_bytes
        + per_layer_experts * expert_bytes
    )
    return WeightEstimate(math.ceil(total), parameters, tuple(notes))


def _quantized_widths(cfg: ConfigFields, dense: Fraction) -> tuple[Fraction, Fraction, str]:
    """Bytes per parameter for (linear layers, expert layers) under the config's quantization."""
    quant = cfg.get("quantization_config")
    if quant is None:
        return dense, dense, ""
    if not isinstance(quant, dict):
        raise cfg.error("field 'quantization_config' must be an object", "quantization_config")
    method = str(quant.get("quant_method", "")).lower()
    if method == "fp8":
        return Fraction(1), Fraction(1), "fp8 quantized linear layers counted at 1 byte per weight"
    if method == "mxfp4":
        # 4-bit values plus one 8-bit scale per 32 values; only the experts are MXFP4.
        mx = Fraction(17, 32)
        return dense, mx, "MXFP4 expert weights counted at 4.25 bits per weight"
    bits = quant.get("bits")
    if isinstance(bits, int) and not isinstance(bits, bool) and bits > 0:
        width = Fraction(bits, 8)
        return (
            width,
            width,
            f"{method or 'quantized'} linear layers counted at {bits} bits per weight",
        )
    raise cfg.error(
        f"cannot estimate weights quantized with quant_method {method or '(none)'!r};"
        " put model.safetensors.index.json beside config.json or pass --weights-bytes",
        "quantization_config",
    )


def _attention_params(cfg: ConfigFields, shape: ModelShape) -> int:
    att = shape.attention
    hidden = shape.hidden_size
    if att.kind == "mla":
        why = "MLA weight sizes"
        nope = cfg.int("qk_nope_head_dim", why)
        rope = cfg.int("qk_rope_head_dim", why)
        v_dim = cfg.int("v_head_dim", why)
        rank = cfg.int("kv_lora_rank", why)
        q_rank = cfg.opt_int("q_lora_rank")
        q_out = att.num_heads * (nope + rope)
        q = hidden * q_rank + q_rank + q_rank * q_out if q_rank else hidden * q_out
        kv = hidden * (rank + rope) + rank + rank * att.num_heads * (nope + v_dim)
        return q + kv + att.num_heads * v_dim * hidden
    q_width = att.num_heads * att.head_dim
    kv_width = att.kv_heads * att.head_dim
    bias = q_width + 2 * kv_width if _has_qkv_bias(cfg) else 0
    return hidden * (q_width + 2 * kv_width) + q_width * hidden + bias


def _has_qkv_bias(cfg: ConfigFields) -> bool:
    stated = cfg.flag("attention_bias")
    if stated is not None:
        return stated
    return str(cfg.get("model_type")).startswith("qwen2")  # Qwen2 has QKV bias, unflagged


def _state_mixer_params(cfg: ConfigFields, shape: ModelShape) -> int:
    hidden = shape.hidden_size
    if shape.state is None:  # pragma: no cover - parse_model_config guarantees a state
        return 0
    if shape.state.kind == "mamba":
        d_inner = cfg.int("mamba_expand", "Mamba weights") * hidden
        d_conv = cfg.int("mamba_d_conv", "Mamba weights")
        d_state = cfg.int("mamba_d_state", "Mamba weights")
        dt_rank = cfg.opt_int("mamba_dt_rank") or math.ceil(hidden / 16)
        return (
            hidden * 2 * d_inner  # in_proj
            + d_inner * d_conv  # conv1d
            + d_inner * (dt_rank + 2 * d_state)  # x_proj
            + dt_rank * d_inner  # dt_proj
            + d_inner * d_state  # A_log
            + d_inner * hidden  # out_proj
        )
    why = "linear-attention weights"
    k_dim = cfg.int("linear_num_key_heads", why) * cfg.int("linear_key_head_dim", why)
    v_heads = cfg.int("linear_num_value_heads", why)
    v_dim = v_heads * cfg.int("linear_value_head_dim", why)
    kernel = cfg.int("linear_conv_kernel_dim", why)
    return (
        hidden * (2 * k_dim + 2 * v_dim)  # q, k, v and the output gate z
        + hidden * 2 * v_heads  # beta and alpha
        + (2 * k_dim + v_dim) * kernel  # conv1d
        + v_dim * hidden  # out_proj
    )


def _mlp_params(shape: ModelShape, layer: int) -> tuple[int, int]:
    """(dense-width parameters, expert parameters) of one layer's MLP; gated, 3 matrices."""
    mlp = shape.mlp
    hidden = shape.hidden_size
    if mlp.experts and mlp.moe_layers[layer]:
        experts = mlp.experts * 3 * hidden * mlp.expert_intermediate
        router = hidden * mlp.experts
        shared = 3 * hidden * mlp.shared_intermediate
        return router + shared, experts
    return 3 * hidden * mlp.dense_intermediate, 0
