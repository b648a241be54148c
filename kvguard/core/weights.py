"""Estimate a model's weight bytes from its config when no weight index is at hand.

The estimate counts the parameters of every tensor the architecture implies
(embeddings, attention including MLA's low-rank projections, Mamba and
linear-attention mixers, dense or mixture-of-experts MLPs, norms, an untied
``lm_head``) and multiplies by the stored width. It ignores biases other than the
attention QKV bias and small per-block quantization scales: for Llama-3.1-8B it
equals the checkpoint's size. Multimodal towers are not counted. A
quantization scheme it does not know is an error that says to pass the real size.

MXFP4 experts (gpt-oss) are counted as vLLM holds them once loaded, not as the
checkpoint stores them: vLLM pads the expert tensors to the tile sizes of the MoE
kernel it picks, and the kernel follows the vLLM version and the GPU's compute
capability. Each rule names the vLLM source it follows (paths under ``vllm/``):

- **Padding** (per tensor-parallel shard for the intermediate size): Marlin pads
  the intermediate size to 128 and the hidden size to 256; FlashInfer's TRTLLM
  kernel (Blackwell) 256 and 256, 128 and 256 from 0.27; OAI's Triton kernel
  (Hopper) only the intermediate size, to 64.
  0.10.1.1 ``model_executor/layers/quantization/mxfp4.py:154-186``; 0.11.0 the same
  file ``:189-226``; 0.19.0 ``model_executor/layers/fused_moe/oracle/mxfp4.py:376-400``
  (``mxfp4_round_up_hidden_size_and_intermediate_size``); 0.27.0 the same
  function ``:656-658`` (TRTLLM intermediate 128).
- **Kernel**: compute capability below 9.0 (A100, A10, L4, L40S, RTX 3090/4090):
  Marlin (0.10.1.1 ``quantization/mxfp4.py:123-135``; 0.11.0 ``:95-99``; from 0.19 the
  Triton kernel needs 9.0-10.x, ``fused_moe/gpt_oss_triton_kernels_moe.py:555-563``).
  Hopper: Marlin in 0.10.1.x, which pins torch 2.7.1 and takes Marlin below torch
  2.8 (``quantization/mxfp4.py:133-134``), Triton from 0.10.2 (torch 2.8; 0.11.0
  ``quantization/mxfp4.py:95-102``; 0.19.0 ``oracle/mxfp4.py:169-183``, Triton first
  among the kernels Hopper supports; 0.32.0 ``oracle/mxfp4.py:389-422``). Blackwell
  (10.x): FlashInfer TRTLLM first (0.10.1.1 ``quantization/mxfp4.py:35-50``; 0.11.0
  ``:79-85``; 0.19.0 and 0.32.0 first in the same lists), assuming FlashInfer is
  installed, as vLLM's CUDA images ship it.
- **Biases**: gpt-oss's experts carry biases (``models/gpt_oss.py:194``,
  ``has_bias=True``), stored in bf16; Marlin keeps bf16
  (``quantization/utils/marlin_utils_fp4.py:284-288`` in 0.10.1.1), Triton and TRTLLM
  upcast to fp32 (0.10.1.1 ``quantization/mxfp4.py:307-308, 390-394``; 0.19.0
  ``oracle/mxfp4.py:456-457, 724-725``).
- **Scales twice**: Triton swizzles the block scales into a new tensor (padded to
  256 rows and an even number of scale columns, triton-lang/triton
  ``triton_kernels/tensor_details/layout_details/hopper_scale.py``, not among the
  vLLM sources) and, before 0.25, never frees the originals (0.10.1.1
  ``quantization/mxfp4.py:403-421`` deletes only the weights; 0.19.0
  ``oracle/mxfp4.py:728-745``; 0.25.0 ``oracle/mxfp4.py:1150-1156`` deletes the scales).

With no GPU architecture known (a GPU given only by size, or ROCm) the estimate
takes the kernel that stores the most: it overstates rather than understates.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

from kvguard.core.architecture import ConfigFields, ModelShape
from kvguard.core.engine_rules import vllm_rule
from kvguard.core.units import DTYPE_BYTES


@dataclass(frozen=True)
class WeightEstimate:
    """Estimated weight bytes of the whole model and how they were derived."""

    total_bytes: int
    parameters: int
    notes: tuple[str, ...]


def estimate_weights(
    cfg: ConfigFields,
    shape: ModelShape,
    *,
    engine_version: str | None = None,
    compute_capability: tuple[int, int] | None = None,
    tp: int = 1,
) -> WeightEstimate:
    """Parameter count and bytes of ``shape``, read together with its raw ``cfg``.

    ``engine_version``, ``compute_capability`` and ``tp`` matter only for MXFP4
    experts, which vLLM pads by kernel (see the module docstring).
    """
    notes: list[str] = []
    dense_bytes = DTYPE_BYTES[shape.dtype]
    linear_bytes, expert_bytes, quant_note = _quantized_widths(cfg, dense_bytes)
    mx = mxfp4_experts(cfg, shape, engine_version, compute_capability, tp)
    if mx is not None:
        notes.append(mx.note)
    elif quant_note:
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
    experts_total = per_layer_experts * expert_bytes
    if mx is not None:
        parameters += mx.bias_parameters
        experts_total = Fraction(mx.served_bytes)
    total = (
        (embed + lm_head + norms) * dense_bytes + per_layer_linear * linear_bytes + experts_total
    )
    return WeightEstimate(math.ceil(total), parameters, tuple(notes))


@dataclass(frozen=True)
class Mxfp4Kernel:
    """How one of vLLM's MXFP4 MoE kernels holds the expert tensors of one GPU."""

    name: str
    intermediate_align: int  # of the intermediate size of one tensor-parallel shard
    hidden_align: int  # 1: unpadded
    bias_bytes: int
    scales_twice: bool  # the block scales kept beside their swizzled copy

    def layer_bytes(self, experts: int, hidden: int, intermediate: int, bias: bool) -> int:
        """Bytes of one MoE layer's experts on one shard of ``intermediate`` columns."""
        inter = _round_up(intermediate, self.intermediate_align)
        hid = _round_up(hidden, self.hidden_align)
        # gate_up (2 x inter rows of hid) and down (hid rows of inter): 4-bit values
        # packed two a byte, one 8-bit scale per 32 values, along the inner dimension.
        values = (2 * inter * hid + hid * inter) // 2
        scales = 2 * inter * _ceil_div(hid, 32) + hid * _ceil_div(inter, 32)
        biases = (2 * inter + hid) * self.bias_bytes if bias else 0
        swizzled = 0
        if self.scales_twice:
            # HopperMXScaleLayout pads rows to 2 * num_warps(8) * 2 * 8 = 256 and
            # scale columns to 2.
            swizzled = _round_up(2 * inter, 256) * _round_up(_ceil_div(hid, 32), 2)
            swizzled += _round_up(hid, 256) * _round_up(_ceil_div(inter, 32), 2)
        return experts * (values + scales + biases + swizzled)

    def describe(self, hidden: int, intermediate: int) -> str:
        """What the kernel does to the tensors, in the words of a budget note."""
        inter = _round_up(intermediate, self.intermediate_align)
        hid = _round_up(hidden, self.hidden_align)
        text = f"hidden {hidden:,} -> {hid:,}" if hid != hidden else f"hidden {hidden:,} unpadded"
        text += f", intermediate per TP shard {intermediate:,} -> {inter:,}"
        text += f", 4.25 bits per weight, {'fp32' if self.bias_bytes == 4 else 'bf16'} biases"
        if self.scales_twice:
            text += (
                ", block scales held twice (vLLM before 0.25 keeps them beside the swizzled copy)"
            )
        return text


MARLIN = Mxfp4Kernel("Marlin", 128, 256, 2, scales_twice=False)


def _triton(version: tuple[int, int, int]) -> Mxfp4Kernel:
    return Mxfp4Kernel("Triton", 64, 1, 4, scales_twice=version < (0, 25, 0))


def _trtllm(version: tuple[int, int, int]) -> Mxfp4Kernel:
    return Mxfp4Kernel("FlashInfer TRTLLM", 256 if version < (0, 27, 0) else 128, 256, 4, False)


_PATCH = re.compile(r"^v?\d+\.\d+\.(\d+)")


def mxfp4_kernels(
    engine_version: str | None, compute_capability: tuple[int, int] | None
) -> tuple[tuple[Mxfp4Kernel, ...], str]:
    """The MXFP4 MoE kernels vLLM may pick, and why; several when it cannot be told."""
    rule = vllm_rule(engine_version)
    match = _PATCH.match(engine_version.strip()) if engine_version else None
    patch = int(match.group(1)) if match else None
    version = (*rule.version, patch or 0)
    # 0.10.1.x picked Marlin on Hopper, 0.10.2 Triton: "0.10" alone is either.
    hopper: tuple[Mxfp4Kernel, ...] = (
        (MARLIN, _triton(version))
        if rule.version == (0, 10) and patch is None
        else (MARLIN,)
        if version < (0, 10, 2)
        else (_triton(version),)
    )
    if compute_capability is None:
        unknown = tuple(dict.fromkeys((MARLIN, *hopper, _trtllm(version))))
        return unknown, "GPU architecture unknown (a GPU given by size only, or ROCm)"
    why = f"compute capability {compute_capability[0]}.{compute_capability[1]}"
    if compute_capability < (9, 0):
        return (MARLIN,), why
    if compute_capability < (10, 0):
        return hopper, why
    if compute_capability < (11, 0):
        return (_trtllm(version),), why
    return tuple(dict.fromkeys((MARLIN, *hopper, _trtllm(version)))), f"{why}, not modelled"


@dataclass(frozen=True)
class Mxfp4Experts:
    """MXFP4 expert bytes of the whole model: as vLLM holds them, as stored, and why."""

    served_bytes: int
    stored_bytes: int
    bias_parameters: int
    kernel: Mxfp4Kernel
    note: str
    kernel_known: bool  # False: the largest of several kernels the inputs allow

    @property
    def padding_bytes(self) -> int:
        """What loading adds to the checkpoint's expert tensors."""
        return self.served_bytes - self.stored_bytes

    @property
    def kernel_text(self) -> str:
        """The kernel, as the budget's weights source names it."""
        if self.kernel_known:
            return f"vLLM's {self.kernel.name} kernel"
        return f"the largest of vLLM's kernels ({self.kernel.name}; GPU architecture unknown)"


def mxfp4_experts(
    cfg: ConfigFields,
    shape: ModelShape,
    engine_version: str | None,
    compute_capability: tuple[int, int] | None,
    tp: int = 1,
) -> Mxfp4Experts | None:
    """The MXFP4 experts of ``shape`` on vLLM's kernel; None when it has none."""
    quant = cfg.get("quantization_config")
    if not isinstance(quant, dict) or str(quant.get("quant_method", "")).lower() != "mxfp4":
        return None
    mlp = shape.mlp
    layers = sum(1 for index in range(shape.num_layers) if mlp.experts and mlp.moe_layers[index])
    if not layers:
        return None
    hidden, inter = shape.hidden_size, mlp.expert_intermediate
    bias = str(cfg.get("model_type")) == "gpt_oss"  # vLLM models/gpt_oss.py: has_bias=True
    shard = _ceil_div(inter, tp)
    kernels, why = mxfp4_kernels(engine_version, compute_capability)
    kernel = max(kernels, key=lambda k: k.layer_bytes(mlp.experts, hidden, shard, bias))
    served = tp * layers * kernel.layer_bytes(mlp.experts, hidden, shard, bias)
    stored = (
        layers
        * mlp.experts
        * (3 * hidden * inter * 17 // 32 + ((2 * inter + hidden) * 2 if bias else 0))
    )
    label = vllm_rule(engine_version).label.split(" (")[0]
    if len(kernels) > 1:
        note = (
            f"{why}: MXFP4 expert weights counted as the largest of the kernels"
            f" {label} may pick, {kernel.name}, stores them"
            f" ({kernel.describe(hidden, shard)}); name the GPU with --gpu for its own kernel"
        )
    else:
        note = (
            f"MXFP4 expert weights padded as {label}'s {kernel.name} kernel stores them"
            f" ({why}): {kernel.describe(hidden, shard)}"
        )
    bias_parameters = layers * mlp.experts * (2 * inter + hidden) if bias else 0
    return Mxfp4Experts(served, stored, bias_parameters, kernel, note, len(kernels) == 1)


def _round_up(value: int, multiple: int) -> int:
    return _ceil_div(value, multiple) * multiple


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


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
