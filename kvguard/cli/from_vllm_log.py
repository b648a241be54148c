"""``kvguard budget MODEL --from-vllm-log FILE``: check the budget against a real start-up.

vLLM prints what it measured while sizing its KV pool (weights, activation peak,
non-torch memory, the pool, its tokens and blocks). This command reads those
figures, predicts the same start-up from the model and the logged settings alone,
prints both side by side with the difference, and then answers the operator's other
flags (``--max-model-len``, ``--concurrency``, ``--kv-cache-dtype``,
``--gpu-memory-utilization``) as what-ifs from the measured figures, which are
exact for that engine, GPU and version.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

from kvguard.api.budget_report import budget_to_dict, render_budget
from kvguard.config.model_files import ModelFiles
from kvguard.core.budget import Budget, BudgetInputs, BudgetReport, plan_budget
from kvguard.core.engine_rules import vllm_rule
from kvguard.core.units import GiB
from kvguard.core.vllm_log import VllmStartupLog, parse_vllm_log
from kvguard.errors import InvalidInputError

EXIT_OK = 0


def run(
    args: argparse.Namespace,
    files: ModelFiles,
    inputs: BudgetInputs,
    gpu: str,
    notes: tuple[str, ...],
) -> int:
    """Print the comparison and the calibrated what-if; exit 0 (bad input raises)."""
    path = Path(args.from_vllm_log)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise InvalidInputError("--from-vllm-log", str(path), f"cannot be read ({exc})") from None
    log = parse_vllm_log(text, source=path.name)
    as_run = logged_inputs(log, inputs)
    logged_gpu = (
        {"gpu_memory": f"as logged (vLLM log {log.source})"} if log.total_gpu_memory_bytes else {}
    )
    predicted = plan_budget(
        files.config,
        as_run,
        index_total_size=files.index_total_size,
        source=files.source,
        notes=notes,
        given_sources=logged_gpu,
    )
    what_if, sources = calibrated_inputs(
        log, what_if_inputs(args, as_run, inputs), predicted.budget
    )
    calibrated = plan_budget(
        files.config,
        what_if,
        index_total_size=files.index_total_size,
        source=files.source,
        given_as=f"measured (vLLM log {log.source})",
        given_sources={**logged_gpu, **sources},
    )
    rows = comparison(log, predicted.budget)
    said = log_notes(log, inputs)
    if log.total_gpu_memory_bytes:
        gpu = f"as logged ({log.total_gpu_memory_bytes / GiB:.2f} GiB)"
    if args.json:
        data = {
            "log": {k: v for k, v in asdict(log).items() if v is not None},
            "notes": list(said),
            "comparison": rows,
            "predicted": budget_to_dict(predicted, files.source, gpu, name=files.name),
            "calibrated": budget_to_dict(calibrated, files.source, gpu, name=files.name),
        }
        print(json.dumps(data, indent=2))
        return EXIT_OK
    print(render_comparison(log, rows, predicted, said))
    print()
    if sources:
        print(
            "What-if from the logged figures (where the log measured none, Sources below"
            " says where a figure came from):"
        )
    else:
        print("What-if from the logged figures (weights, activation and overhead as measured):")
    print(render_budget(calibrated, files.source, gpu, name=files.name))
    return EXIT_OK


def logged_inputs(log: VllmStartupLog, given: BudgetInputs) -> BudgetInputs:
    """The settings the logged start-up ran with; the operator's flags fill the gaps."""
    gpus_total = log.total_gpu_memory_bytes or given.gpu_memory_bytes
    return replace(
        given,
        tp=log.tensor_parallel_size or given.tp,
        pp=log.pipeline_parallel_size or given.pp,
        # vLLM's "Maximum concurrency for N tokens per request" names max_model_len.
        max_model_len=(
            log.max_model_len or log.max_concurrency_tokens_per_request or given.max_model_len
        ),
        gpu_memory_utilization=log.gpu_memory_utilization or given.gpu_memory_utilization,
        kv_cache_dtype=_kv_dtype(log.kv_cache_dtype) or given.kv_cache_dtype,
        block_size=log.block_size or given.block_size,
        max_num_batched_tokens=log.max_num_batched_tokens or given.max_num_batched_tokens,
        max_num_seqs=log.max_num_seqs or given.max_num_seqs,
        engine_version=_rule_version(log, given),
        enforce_eager=log.enforce_eager if log.enforce_eager is not None else given.enforce_eager,
        sampler=log.sampler or given.sampler,
        gpu_memory_bytes=gpus_total,
        concurrency=1,
    )


# The release kvguard's V0 rule follows: a V0 engine of 0.8 to 0.10 (opt-in, or the
# fallback where V1 lacked a feature) sized its pool by the same V0 code.
V0_RULE_VERSION = "0.7"


def _rule_version(log: VllmStartupLog, given: BudgetInputs) -> str | None:
    """The version whose rule predicts the log: its own, but V0's for a V0 engine."""
    if _v0_in_a_v1_release(log, given):
        return V0_RULE_VERSION
    return log.version or given.engine_version


def _v0_in_a_v1_release(log: VllmStartupLog, given: BudgetInputs) -> bool:
    """Whether the log's engine is V0 where its release's (or the current) rule is V1's."""
    return log.engine == "v0" and vllm_rule(log.version or given.engine_version).engine == "v1"


def what_if_inputs(
    args: argparse.Namespace, as_run: BudgetInputs, given: BudgetInputs
) -> BudgetInputs:
    """The logged settings with what the operator asked about instead."""
    changes: dict[str, object] = {"concurrency": given.concurrency}
    if args.max_model_len is not None:
        changes["max_model_len"] = given.max_model_len
    if args.kv_cache_dtype != "auto":
        changes["kv_cache_dtype"] = given.kv_cache_dtype
    if args.gpu_memory_utilization is not None:
        changes["gpu_memory_utilization"] = given.gpu_memory_utilization
    return replace(as_run, **changes)  # type: ignore[arg-type]


def calibrated_inputs(
    log: VllmStartupLog, inputs: BudgetInputs, predicted: Budget
) -> tuple[BudgetInputs, dict[str, str]]:
    """``inputs`` with the memory lines vLLM measured in place of kvguard's estimates.

    Where the log has no breakdown but does give the pool, whatever the pool did not
    take (memory x utilization - pool - weights) is counted as overhead, so the
    calibrated budget reproduces the logged pool exactly. Also returned: where each
    figure that was not measured came from (``weights``, ``activation``,
    ``overhead``), for :attr:`Budget.sources`.
    """
    gpus = inputs.tp * inputs.pp
    sources: dict[str, str] = {}
    weights = log.weights_bytes
    if weights is None:
        # Kept from the prediction, and said so: a what-if is no more exact than it.
        weights = predicted.weights_bytes_per_gpu
        sources["weights"] = f"{predicted.sources['weights']} (the log has no model loading line)"
    activation = log.activation_peak_bytes
    overhead = _overhead(log)
    total = log.total_gpu_memory_bytes
    if (activation is None or overhead is None) and total and log.kv_cache_memory_bytes:
        util = log.gpu_memory_utilization or predicted.inputs.utilization
        rest = int(total * util) - log.kv_cache_memory_bytes - weights
        activation, overhead = 0, max(0, rest)
        sources["activation"] = "counted in the overhead (the log has no breakdown)"
        sources["overhead"] = (
            f"derived from vLLM log {log.source}: memory x utilization - KV pool - weights"
        )
    calibrated = replace(
        inputs,
        weights_bytes=weights * gpus,
        activation_bytes=activation,
        overhead_bytes=overhead,
    )
    return calibrated, sources


def log_notes(log: VllmStartupLog, given: BudgetInputs) -> tuple[str, ...]:
    """What the reader of the comparison must know about the log before its figures."""
    notes: list[str] = []
    if log.startups > 1:
        notes.append(
            f"the file holds {log.startups} start-ups (KV cache size lines):"
            " only the last one is read"
        )
    if log.max_model_len is None and log.max_concurrency_tokens_per_request is not None:
        notes.append(
            f"max_model_len {log.max_concurrency_tokens_per_request:,} is read from the"
            " Maximum concurrency line (the log has no engine config line)"
        )
    if log.total_gpu_memory_bytes is None and given.gpu_memory_bytes is None:
        notes.append(
            "the log does not give the GPU's memory and neither --gpu nor --gpu-memory"
            " was given: kvguard's side assumes 80 GiB per GPU (pass --gpu)"
        )
    if _v0_in_a_v1_release(log, given):
        release = log.version or given.engine_version
        where = f"at vLLM {release}" if release else "(no version given)"
        notes.append(
            f"the log's engine is V0 {where}: predicted with kvguard's V0 rule (that of"
            f" {V0_RULE_VERSION})"
        )
    if log.weights_bytes is None:
        notes.append("the log has no model loading line: the weights on both sides are kvguard's")
    return tuple(notes)


def comparison(log: VllmStartupLog, b: Budget) -> list[dict[str, object]]:
    """One row per figure both sides have: what kvguard predicted, what vLLM logged."""
    pairs: list[tuple[str, float | None, float, str]] = [
        ("GPU memory (GiB)", _gib(log.total_gpu_memory_bytes), b.gpu_memory_bytes / GiB, "GiB"),
        ("weights (GiB)", _gib(log.weights_bytes), b.weights_bytes_per_gpu / GiB, "GiB"),
        (
            "activation peak (GiB)",
            _gib(log.activation_peak_bytes),
            b.activation_bytes_per_gpu / GiB,
            "GiB",
        ),
        ("non-torch + graphs (GiB)", _gib(_overhead(log)), b.overhead_bytes_per_gpu / GiB, "GiB"),
        ("KV pool (GiB)", _gib(log.kv_cache_memory_bytes), b.kv_pool_bytes_per_gpu / GiB, "GiB"),
        ("KV tokens", log.kv_cache_tokens, float(b.kv_capacity_tokens), "tokens"),
        ("blocks", log.gpu_blocks, float(b.kv_capacity_blocks), "blocks"),
        ("max concurrency", log.max_concurrency, b.max_concurrency_ratio, "x"),
    ]
    rows: list[dict[str, object]] = []
    for name, logged, predicted, unit in pairs:
        if logged is None:
            continue
        diff = predicted - logged
        rows.append(
            {
                "figure": name,
                "unit": unit,
                "logged": round(logged, 4),
                "predicted": round(predicted, 4),
                "difference": round(diff, 4),
                "difference_pct": round(100 * diff / logged, 2) if logged else None,
            }
        )
    return rows


def _overhead(log: VllmStartupLog) -> int | None:
    if log.non_torch_bytes is None:
        return None
    graphs = log.cuda_graph_estimate_bytes if log.cuda_graph_reserved_before_kv_cache else 0
    return log.non_torch_bytes + (graphs or 0)


def _gib(n: int | None) -> float | None:
    return None if n is None else n / GiB


def _kv_dtype(name: str | None) -> str | None:
    if name is None or name == "auto":
        return None
    return name


def render_comparison(
    log: VllmStartupLog,
    rows: list[dict[str, object]],
    report: BudgetReport,
    notes: tuple[str, ...] = (),
) -> str:
    """The side-by-side table of what vLLM logged and what kvguard predicted."""
    b = report.budget
    version = log.version or "unknown version"
    lines = [
        f"vLLM start-up log {log.source} ({version}, {log.model or 'model not named'})",
        f"Predicted with {b.engine_rule}, tp={b.inputs.tp}, pp={b.inputs.pp},"
        f" max_model_len {b.max_model_len:,}, utilization {b.inputs.utilization:g},"
        f" {b.max_num_batched_tokens:,} batched tokens, {b.max_num_seqs:,} sequences",
        *(f"Note: {note}" for note in notes),
        "",
        f"  {'figure':<26} {'vLLM logged':>14} {'kvguard':>14} {'difference':>12}",
    ]
    for row in rows:
        pct = row["difference_pct"]
        lines.append(
            f"  {row['figure']!s:<26} {_num(row['logged'], row['unit']):>14}"
            f" {_num(row['predicted'], row['unit']):>14}"
            f" {(f'{pct:+.1f}%' if isinstance(pct, float) else '-'):>12}"
        )
    if not rows:
        lines.append("  (the log gives no figure kvguard also predicts)")
    return "\n".join(lines)


def _num(value: object, unit: object = None) -> str:
    if unit == "x" and isinstance(value, (int, float)):
        return f"{value:.2f}x"  # as vLLM prints it: 4.00x, not 4
    if isinstance(value, float) and not value.is_integer():
        return f"{value:,.2f}"
    if isinstance(value, (int, float)):
        return f"{int(value):,}"
    return str(value)
