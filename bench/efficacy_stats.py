"""The efficacy benchmark's arithmetic: medians with bootstrap intervals, the static oracle, ties.

Pure: runs in (plain dicts, as written to ``efficacy.json``), a summary out. Nothing here
knows how a run was made, so the page and the tests read the same figures.

* Every figure is the **median over seeds** with a **95% bootstrap interval** of that
  median (the seeds resampled with replacement ``RESAMPLES`` times from a fixed seed, the
  2.5th and 97.5th percentiles of the resampled medians): with five seeds the interval is
  wide, as it should be.
* ``static_best`` is an oracle: for each workload and failure mode, the ``max_num_seqs``
  of the sweep whose median SLO attainment was highest (then the most goodput tokens),
  chosen in hindsight. No operator has it; it is the baseline to beat.
* A comparison is a **win** or a **loss** only when the two intervals do not overlap;
  otherwise it is a **tie**, whatever the medians say.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

RESAMPLES = 2000
BOOTSTRAP_SEED = 20261201  # fixed: the same runs always give the same intervals
STATIC = "static"  # the runs of the max_num_seqs sweep, one per value
STATIC_BEST = "static_best"
# The figures summarized per policy; each is a key of a run (or of its interventions).
FIGURES = (
    "slo_attainment",
    "goodput_tokens",
    "shed_fraction",
    "refused_fraction",
    "clamped_fraction",
    "failed_fraction",
    "preemptions",
    "crashes",
    "ttft_p99_s",
    "tpot_p99_s",
    "retries",
    "kv_usage_mean",
    "lead_time_s",
)
CLASS_FIGURES = ("slo_attainment", "shed_fraction")
# Compared with kvguard on the page: every baseline that shapes traffic.
BASELINES = ("none", STATIC_BEST, "engine_priority", "llmd_rule")


def bootstrap_median(values: Sequence[float], *, resamples: int = RESAMPLES) -> dict[str, Any]:
    """``{"median", "low", "high", "n"}`` of ``values``; all None when there are none."""
    if not values:
        return {"median": None, "low": None, "high": None, "n": 0}
    rng = random.Random(BOOTSTRAP_SEED)  # noqa: S311 - resampling, not secrets
    n = len(values)
    medians = sorted(
        statistics.median(rng.choices(values, k=n)) for _ in range(resamples if n > 1 else 1)
    )
    low = medians[int(0.025 * (len(medians) - 1))]
    high = medians[round(0.975 * (len(medians) - 1))]
    return {
        "median": round(statistics.median(values), 4),
        "low": round(low, 4),
        "high": round(high, 4),
        "n": n,
    }


def compare(mine: Mapping[str, Any], theirs: Mapping[str, Any], *, higher_is_better: bool) -> str:
    """``win``, ``loss`` or ``tie`` of ``mine`` against ``theirs`` (two bootstrap figures).

    ``n/a`` when either has no value, or fewer than two seeds (no interval to compare).
    Overlapping intervals are a tie.
    """
    if mine.get("median") is None or theirs.get("median") is None:
        return "n/a"
    if min(mine.get("n", 0), theirs.get("n", 0)) < 2:
        return "n/a"
    if mine["low"] > theirs["high"]:
        return "win" if higher_is_better else "loss"
    if mine["high"] < theirs["low"]:
        return "loss" if higher_is_better else "win"
    return "tie"


def figure(run: Mapping[str, Any], name: str, priority: str | None = None) -> float | None:
    """One figure of one run (of one priority class when ``priority`` is given)."""
    source = run if priority is None else run.get("by_priority", {}).get(priority, {})
    sent = source.get("sent") or 0
    if name.endswith("_fraction"):
        count = source.get(name.removesuffix("_fraction"))
        return None if not sent or count is None else count / sent
    value = source.get(name)
    return None if value is None else float(value)


def _summarize_policy(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {"seeds": len(runs)}
    for name in FIGURES:
        row[name] = bootstrap_median([v for r in runs if (v := figure(r, name)) is not None])
    row["crashed_runs"] = sum(1 for r in runs if r.get("crashes"))
    row["by_priority"] = {
        cls: {
            name: bootstrap_median([v for r in runs if (v := figure(r, name, cls)) is not None])
            for name in CLASS_FIGURES
        }
        for cls in ("critical", "standard", "sheddable")
    }
    interventions: dict[str, list[float]] = {}
    for r in runs:
        for kind, count in (r.get("interventions") or {}).items():
            interventions.setdefault(kind, []).append(float(count))
    row["interventions"] = {k: bootstrap_median(v) for k, v in sorted(interventions.items())}
    return row


def _best_static(runs: Sequence[Mapping[str, Any]]) -> tuple[int | None, list[Mapping[str, Any]]]:
    """The max_num_seqs of the sweep with the best median attainment, and its runs."""
    by_value: dict[int, list[Mapping[str, Any]]] = {}
    for r in runs:
        by_value.setdefault(int(r["max_num_seqs"]), []).append(r)
    if not by_value:
        return None, []

    def score(item: tuple[int, list[Mapping[str, Any]]]) -> tuple[float, float]:
        rows = item[1]
        attained = [figure(r, "slo_attainment") or 0.0 for r in rows]
        tokens = [figure(r, "goodput_tokens") or 0.0 for r in rows]
        return statistics.median(attained), statistics.median(tokens)

    value, rows = max(sorted(by_value.items()), key=score)
    return value, rows


def workload_of(run: Mapping[str, Any]) -> str:
    """The workload's name: the pattern, or ``trace@speed`` for a trace replay."""
    if run.get("trace"):
        return f"{run['trace']}@{run['speed']:g}x"
    return str(run["pattern"])


def summarize(runs: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Per workload and failure mode: each policy's figures, static_best, kvguard's verdicts."""
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for r in runs:
        groups.setdefault((workload_of(r), r["failure_mode"]), []).append(r)
    out: dict[str, Any] = {}
    for (workload, mode), rows in groups.items():
        table: dict[str, Any] = {}
        policies = sorted({r["policy"] for r in rows} - {STATIC})
        for policy in policies:
            table[policy] = _summarize_policy([r for r in rows if r["policy"] == policy])
        value, best = _best_static([r for r in rows if r["policy"] == STATIC])
        if best:
            table[STATIC_BEST] = {**_summarize_policy(best), "max_num_seqs": value}
            table[STATIC_BEST]["sweep"] = {
                str(n): bootstrap_median(
                    [
                        figure(r, "slo_attainment") or 0.0
                        for r in rows
                        if r["policy"] == STATIC and r["max_num_seqs"] == n
                    ]
                )
                for n in sorted({int(r["max_num_seqs"]) for r in rows if r["policy"] == STATIC})
            }
        out.setdefault(workload, {})[mode] = {"policies": table, "verdicts": verdicts(table)}
    return out


def verdicts(table: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """The verdict of kvguard against each baseline present: SLO attainment and goodput tokens."""
    mine = table.get("kvguard")
    if mine is None:
        return {}
    return {
        base: {
            "slo_attainment": compare(
                mine["slo_attainment"], table[base]["slo_attainment"], higher_is_better=True
            ),
            "goodput_tokens": compare(
                mine["goodput_tokens"], table[base]["goodput_tokens"], higher_is_better=True
            ),
        }
        for base in BASELINES
        if base in table
    }
