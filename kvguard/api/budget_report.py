"""Present a :class:`~kvguard.core.budget.BudgetReport`: a table for people, a dict for JSON."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import PurePath

from kvguard.core.architecture import ModelShape
from kvguard.core.bars import text_bar
from kvguard.core.budget import Budget, BudgetReport
from kvguard.core.units import DTYPE_BYTES, format_bytes

BAR_WIDTH = 30


def weights_dtype(raw_config: Mapping[str, object], shape: ModelShape) -> str:
    """The data type the checkpoint's weights are held in on the GPU.

    A ``quantization_config`` names it (``fp8`` for DeepSeek-V3, ``mxfp4`` for
    gpt-oss, ``awq int4``…); without one the weights are served in the model dtype,
    which for a float32 checkpoint is the 16-bit type vLLM casts it to.
    """
    quant = raw_config.get("quantization_config")
    if not isinstance(quant, Mapping):
        text = raw_config.get("text_config")  # multimodal configs nest the text model
        quant = text.get("quantization_config") if isinstance(text, Mapping) else None
    if not isinstance(quant, Mapping):
        return shape.dtype
    method = str(quant.get("quant_method") or "").lower()
    bits = quant.get("bits")
    if method in ("fp8", "mxfp4") or not isinstance(bits, int) or isinstance(bits, bool):
        return method or "quantized"
    return f"{method} int{bits}" if method else f"int{bits}"


def budget_to_dict(
    report: BudgetReport,
    source: str,
    gpu: str,
    *,
    name: str = "",
    weights: str | None = None,
) -> dict[str, object]:
    """Every figure of the report under the stable keys docs/budget.md lists.

    ``model.name`` is the config's ``_name_or_path``, else ``name`` (what the operator
    called the model). ``model.weights_dtype`` is ``weights`` (see :func:`weights_dtype`),
    or null when the caller did not say.
    """
    b, shape, inputs = report.budget, report.budget.model, report.budget.inputs
    return {
        "model": {
            "source": source,
            "name": shape.name or name,
            "model_type": shape.model_type,
            "dtype": shape.dtype,
            "weights_dtype": weights,
            "attention": shape.attention.kind,
            "num_layers": shape.num_layers,
            "full_attention_layers": shape.full_layers,
            "sliding_window_layers": shape.sliding_layers,
            "sliding_window": shape.sliding_window,
            "state_layers": shape.state_layers,
            "kv_heads": shape.attention.kv_heads if shape.attention.kind == "mha" else None,
            "head_dim": shape.attention.head_dim if shape.attention.kind == "mha" else None,
            "kv_latent_dim": shape.attention.latent_dim if shape.attention.kind == "mla" else None,
            "max_position_embeddings": shape.max_position_embeddings,
            "context_limit": shape.context_limit,
            "context_limit_source": shape.context_limit_source,
        },
        "inputs": {
            "gpu": gpu,
            "tp": inputs.tp,
            "pp": inputs.pp,
            "concurrency": inputs.concurrency,
            "gpu_memory_utilization": inputs.utilization,
            "max_num_batched_tokens": inputs.max_num_batched_tokens,
            "max_num_seqs": inputs.max_num_seqs,
            "block_size": inputs.block_size,
            "kv_cache_memory_bytes": inputs.kv_cache_memory_bytes,
        },
        **_figures(b),
        "weights_bytes": b.weights_bytes,
        "weights_source": b.weights_source,
        "assumptions": list(b.assumptions),
        "fp8": _figures(report.fp8),
    }


def _figures(b: Budget) -> dict[str, object]:
    return {
        "kv_cache_dtype": b.kv_cache_dtype,
        "max_model_len": b.max_model_len,
        "gpu_memory_bytes": b.gpu_memory_bytes,
        "kv_bytes_per_token": b.kv_bytes_per_token,
        "kv_bytes_per_token_per_gpu": b.kv_bytes_per_token_per_gpu,
        "kv_bytes_per_sequence": b.kv_bytes_per_sequence,
        "kv_bytes_per_sequence_per_gpu": b.kv_bytes_per_sequence_per_gpu,
        "state_bytes_per_sequence_per_gpu": b.state_bytes_per_sequence_per_gpu,
        "weights_bytes_per_gpu": b.weights_bytes_per_gpu,
        "activation_bytes_per_gpu": b.activation_bytes_per_gpu,
        "overhead_bytes_per_gpu": b.overhead_bytes_per_gpu,
        "memory_limit_bytes_per_gpu": b.memory_limit_bytes_per_gpu,
        "kv_pool_bytes_per_gpu": b.kv_pool_bytes_per_gpu,
        "unallocated_bytes_per_gpu": b.unallocated_bytes_per_gpu,
        "kv_capacity_blocks": b.kv_capacity_blocks,
        "kv_capacity_tokens": b.kv_capacity_tokens,
        "worst_case_kv_bytes_per_gpu": b.worst_case_kv_bytes_per_gpu,
        "worst_case_state_bytes_per_gpu": b.worst_case_state_bytes_per_gpu,
        "max_concurrency": b.max_concurrency,
        "max_model_len_at_concurrency": b.max_model_len_at_concurrency,
        "fits": b.fits,
        "max_concurrency_ratio": round(b.max_concurrency_ratio, 4),
        "max_num_batched_tokens": b.max_num_batched_tokens,
        "max_num_seqs": b.max_num_seqs,
        "engine_rule": b.engine_rule,
        "sources": dict(b.sources),
        "headroom_bytes_per_gpu": b.headroom_bytes_per_gpu,
    }


def render_budget(
    report: BudgetReport,
    source: str,
    gpu: str,
    *,
    name: str = "",
    weights: str | None = None,
) -> str:
    """The human-readable budget: memory lines with bars, the verdict, the fp8 comparison.

    The header names the weights' dtype beside the compute dtype when they differ
    (``weights fp8, compute bf16``); ``name`` and ``weights`` as in :func:`budget_to_dict`.
    """
    b, shape, inputs = report.budget, report.budget.model, report.budget.inputs
    title = shape.name or name or PurePath(source).parent.name or source
    dtypes = (
        shape.dtype
        if weights in (None, shape.dtype)
        else f"weights {weights}, compute {shape.dtype}"
    )
    if inputs.kv_cache_memory_bytes is not None:
        # The pool is fixed, as with vLLM's --kv-cache-memory-bytes: the utilization
        # fraction plays no part, so naming it would mislead.
        limit = f"fixed KV pool {format_bytes(inputs.kv_cache_memory_bytes)}"
    else:
        limit = f"gpu_memory_utilization {inputs.utilization:g}"
    att = shape.attention
    layout = f"{shape.full_layers} full"
    if shape.sliding_layers:
        layout += f", {shape.sliding_layers} sliding (window {shape.sliding_window:,})"
    if shape.state_layers and shape.state:
        layout += f", {shape.state_layers} {shape.state.kind.replace('_', '-')} state"
    width = (
        f"latent {att.latent_dim}"
        if att.kind == "mla"
        else f"{att.kv_heads} KV heads x {att.head_dim}"
    )
    lines = [
        f"Model     {title} ({shape.model_type}, {dtypes})  {source}",
        f"GPU       {gpu}: {format_bytes(b.gpu_memory_bytes)} x {inputs.tp * inputs.pp}"
        f" (tp={inputs.tp}, pp={inputs.pp}), {limit}",
        f"KV cache  {b.kv_cache_dtype}, block {inputs.block_size}; layers: {layout}; {width}",
        "",
        f"KV per token     {format_bytes(b.kv_bytes_per_token)} whole model"
        f" ({b.kv_bytes_per_token:,} B), {format_bytes(b.kv_bytes_per_token_per_gpu)} per GPU",
        f"One sequence     {format_bytes(b.kv_bytes_per_sequence)} at max_model_len"
        f" {b.max_model_len:,} ({format_bytes(b.kv_bytes_per_sequence_per_gpu)} per GPU)",
    ]
    if b.state_bytes_per_sequence_per_gpu:
        lines.append(
            f"Recurrent state  {format_bytes(b.state_bytes_per_sequence_per_gpu)}"
            " per sequence per GPU"
        )
    lines += ["", f"Per-GPU memory   {format_bytes(b.gpu_memory_bytes)}"]
    lines += [_bar_line(name, size, b.gpu_memory_bytes) for name, size in _memory_lines(b)]
    lines += ["", *_verdict(b), ""]
    if DTYPE_BYTES[b.kv_cache_dtype] > 1:  # the comparison only helps when fp8 is smaller
        lines.append(_fp8_line(report.fp8))
    lines.append(f"Engine           {b.engine_rule}")
    lines.append(
        f"Batch            {b.max_num_batched_tokens:,} tokens, {b.max_num_seqs:,} sequences"
        f" ({b.sources.get('batch', 'given')})"
    )
    lines.append(f"Weights          {b.weights_source}")
    for key, label in (("activation", "Activation"), ("overhead", "Overhead")):
        if key in b.sources:
            lines.append(f"{label:<16} {b.sources[key]}")
    if "gpu_memory" in b.sources:
        lines.append(f"GPU memory       {b.sources['gpu_memory']}")
    if b.assumptions:
        lines += ["Assumptions:", *(f"  - {a}" for a in b.assumptions)]
    return "\n".join(lines)


def _memory_lines(b: Budget) -> list[tuple[str, int]]:
    fixed = b.inputs.kv_cache_memory_bytes is not None
    lines = [
        ("weights", b.weights_bytes_per_gpu),
        ("activation peak", b.activation_bytes_per_gpu),
        ("framework overhead", b.overhead_bytes_per_gpu),
        ("KV cache pool (fixed)" if fixed else "KV cache pool", b.kv_pool_bytes_per_gpu),
    ]
    if fixed:
        # With a fixed pool the engine takes what the lines add up to and no more; what
        # is left of the GPU is not "unallocated" engine memory. Only an overcommit,
        # lines larger than the GPU, is worth a line.
        if b.unallocated_bytes_per_gpu < 0:
            lines.append(("OVERCOMMITTED", b.unallocated_bytes_per_gpu))
        return lines
    if b.unallocated_bytes_per_gpu > 0:
        lines.append(("unallocated", b.unallocated_bytes_per_gpu))
    elif b.unallocated_bytes_per_gpu < 0:
        lines.append(("OVERCOMMITTED", b.unallocated_bytes_per_gpu))
    reserved = b.gpu_memory_bytes - b.memory_limit_bytes_per_gpu
    if reserved:
        lines.append(("outside utilization", reserved))
    return lines


def _bar_line(name: str, size: int, total: int) -> str:
    share = size / total if total else 0.0
    bar = text_bar(max(0.0, min(share, 1.0)), BAR_WIDTH, eighths=True)
    return f"  {name:<20} {format_bytes(size):>11} {share:>6.1%}  {bar}"


def _verdict(b: Budget) -> list[str]:
    worst = b.worst_case_kv_bytes_per_gpu + b.worst_case_state_bytes_per_gpu
    conc = b.inputs.concurrency
    verdict = (
        f"FITS: {format_bytes(b.headroom_bytes_per_gpu)} headroom per GPU"
        if b.fits
        else f"DOES NOT FIT: short by {format_bytes(-b.headroom_bytes_per_gpu)} per GPU"
    )
    at_cap = b.max_model_len_at_concurrency == b.max_model_len_cap
    limit = " (model limit)" if at_cap and b.model.context_limit else ""
    return [
        f"Worst case       {conc:,} x {b.max_model_len:,} tokens = {format_bytes(worst)}"
        f" per GPU, in a pool of {format_bytes(b.kv_pool_bytes_per_gpu)}",
        f"Verdict          {verdict}",
        f"KV capacity      {b.kv_capacity_tokens:,} tokens ({b.kv_capacity_blocks:,} blocks)",
        f"Max concurrency  {b.max_concurrency:,} sequences at {b.max_model_len:,} tokens",
        f"Max context      {b.max_model_len_at_concurrency:,} tokens each at concurrency {conc:,}"
        + limit,
    ]


def _fp8_line(f: Budget) -> str:
    verdict = "fits" if f.fits else "does not fit"
    return (
        f"With fp8 KV      {format_bytes(f.kv_bytes_per_token)} per token, capacity"
        f" {f.kv_capacity_tokens:,} tokens, max concurrency {f.max_concurrency:,},"
        f" max context {f.max_model_len_at_concurrency:,}: {verdict}"
    )
