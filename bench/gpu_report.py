"""The GPU check's measurements and report: what was seen, what it means, pass or fail.

Both modes of ``bench/gpu_check.py`` (a real GPU, or the fake NVML with a simulated
allocator) collect the same things — kvguard's ``/metrics`` at each tick, the load's
samples and its end, ``kvguard probe --json`` and ``nvidia-smi`` — and this module
turns them into one report (JSON) and the short table printed last. All times in
the report are seconds since the load started growing (``go``).
"""

from __future__ import annotations

import bisect
import csv
import io
import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

NVIDIA_SMI_QUERY = ("nvidia-smi", "--query-gpu=index,memory.total,memory.used", "--format=csv")
PROBE_TOLERANCE = 0.01  # NVML and nvidia-smi agree within 1% of the GPU's memory
BYTES_PER_TOKEN_TOLERANCE = 0.01
USED_TRACKING_TOLERANCE = 0.02  # kvguard's used bytes follow the allocator's within 2% of total
LEFT_AS_FOUND_TOLERANCE = 0.01
TTE_THRESHOLDS_S = (30.0, 10.0)
MIB = 2**20


class CheckError(Exception):
    """The check could not run (no GPU, no torch, a part that did not start in time)."""


@dataclass(frozen=True)
class KvguardReading:
    """kvguard's figures from one tick, as its ``/metrics`` showed them."""

    t: float  # when kvguard read NVML (the scrape time minus the NVML reading's age)
    ticks: int
    nvml_up: bool
    gpu_used_bytes: float | None  # of the fullest watched GPU: total minus free
    gpu_total_bytes: float | None
    gpu_tte_s: float | None  # time_to_exhaustion_seconds{resource="gpu_memory"}
    kv_bytes_per_token: float | None


def parse_metrics(text: str, scraped_at: float) -> KvguardReading:
    """One reading from kvguard's exposition text, parsed with prometheus_client."""
    values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value

    def one(name: str, **labels: str) -> float | None:
        return values.get((name, tuple(sorted(labels.items()))))

    used = [v for (n, _), v in values.items() if n == "kvguard_gpu_memory_used_bytes"]
    free = [v for (n, _), v in values.items() if n == "kvguard_gpu_memory_free_bytes"]
    totals = {
        labels: v for (n, labels), v in values.items() if n == "kvguard_gpu_memory_total_bytes"
    }
    used_bytes = total_bytes = None
    if totals and free:
        # As the forecast does: the GPU with the least free memory, used = total - free
        # (which counts the driver's reservation as used).
        fullest = min(
            totals,
            key=lambda labels: values.get(("kvguard_gpu_memory_free_bytes", labels), math.inf),
        )
        total_bytes = totals[fullest]
        free_bytes = values.get(("kvguard_gpu_memory_free_bytes", fullest))
        used_bytes = total_bytes - free_bytes if free_bytes is not None else None
    elif used:
        used_bytes = max(used)
    nvml_up = one("kvguard_probe_up", probe="nvml") == 1.0
    # A good reading is dated when NVML was read; a failed one when it was seen.
    age = (one("kvguard_probe_age_seconds", probe="nvml") or 0.0) if nvml_up else 0.0
    tte = one("kvguard_time_to_exhaustion_seconds", resource="gpu_memory")
    return KvguardReading(
        t=scraped_at - age,
        ticks=int(one("kvguard_ticks_total") or 0),
        nvml_up=nvml_up,
        gpu_used_bytes=used_bytes,
        gpu_total_bytes=total_bytes,
        gpu_tte_s=tte,
        kv_bytes_per_token=one("kvguard_kv_bytes_per_token"),
    )


def parse_nvidia_smi(text: str) -> list[dict[str, int]]:
    """``nvidia-smi --query-gpu=index,memory.total,memory.used --format=csv`` as rows of bytes."""
    rows = list(csv.reader(io.StringIO(text.strip()), skipinitialspace=True))
    if not rows:
        raise CheckError("nvidia-smi printed nothing")
    header = [h.split(" [")[0].strip() for h in rows[0]]
    wanted = ("index", "memory.total", "memory.used")
    if any(name not in header for name in wanted):
        raise CheckError(f"nvidia-smi header {rows[0]!r}: expected columns {wanted}")
    out = []
    for row in rows[1:]:
        if len(row) != len(header):
            raise CheckError(f"nvidia-smi row {row!r}: expected {len(header)} columns")
        cell = dict(zip(header, row, strict=True))

        def mib(name: str, cell: dict[str, str] = cell) -> int:
            number, _, unit = cell[name].partition(" ")
            if unit not in ("MiB", ""):
                raise CheckError(f"nvidia-smi {name} {cell[name]!r}: expected MiB")
            return int(number) * MIB

        out.append(
            {
                "index": int(cell["index"]),
                "total_bytes": mib("memory.total"),
                "used_bytes": mib("memory.used"),
            }
        )
    return out


def compare_probe(
    probe_doc: Mapping[str, Any], smi_rows: Sequence[Mapping[str, int]]
) -> dict[str, Any]:
    """Compare kvguard probe's GPUs with nvidia-smi's: total and used within 1% of total.

    nvidia-smi's ``memory.used`` leaves the driver's reservation out on drivers with
    memory info v2 and counts it in on older ones; whichever of kvguard's ``used``
    and ``used + reserved`` is closer is the one compared (and named).
    """
    smi = {row["index"]: row for row in smi_rows}
    gpus = []
    for gpu in probe_doc.get("gpus") or []:
        row = smi.get(gpu["index"])
        total = gpu["total_bytes"]
        if row is None or not total:
            gpus.append({"index": gpu["index"], "ok": False, "why": "not in nvidia-smi's list"})
            continue
        reserved = gpu.get("reserved_bytes") or 0
        candidates = {
            "used": abs(gpu["used_bytes"] - row["used_bytes"]),
            "used+reserved": abs(gpu["used_bytes"] + reserved - row["used_bytes"]),
        }
        compared = min(candidates, key=lambda k: candidates[k])
        total_diff = abs(total - row["total_bytes"]) / total
        used_diff = candidates[compared] / total
        gpus.append(
            {
                "index": gpu["index"],
                "name": gpu.get("name"),
                "nvml_total_bytes": total,
                "smi_total_bytes": row["total_bytes"],
                "nvml_used_bytes": gpu["used_bytes"],
                "nvml_reserved_bytes": gpu.get("reserved_bytes"),
                "smi_used_bytes": row["used_bytes"],
                "used_compared": compared,
                "total_diff_ratio": total_diff,
                "used_diff_ratio": used_diff,
                "ok": total_diff <= PROBE_TOLERANCE and used_diff <= PROBE_TOLERANCE,
            }
        )
    return {
        "gpus": gpus,
        "nvml": probe_doc.get("nvml"),
        "ok": bool(gpus) and all(g["ok"] for g in gpus),
    }


def left_as_found(
    before: Sequence[Mapping[str, int]], after: Sequence[Mapping[str, int]]
) -> dict[str, Any]:
    """nvidia-smi before and after: every GPU's used memory back within 1% of total."""
    after_by_index = {row["index"]: row for row in after}
    gpus = []
    for row in before:
        later = after_by_index.get(row["index"])
        diff = (
            None
            if later is None
            else abs(later["used_bytes"] - row["used_bytes"]) / row["total_bytes"]
        )
        gpus.append(
            {
                "index": row["index"],
                "used_before_bytes": row["used_bytes"],
                "used_after_bytes": None if later is None else later["used_bytes"],
                "diff_ratio": diff,
                "ok": diff is not None and diff <= LEFT_AS_FOUND_TOLERANCE,
            }
        )
    return {"gpus": gpus, "ok": bool(gpus) and all(g["ok"] for g in gpus)}


def _finite(value: float | None) -> float | None:
    """JSON has no +Inf: an infinite time to exhaustion (not rising) becomes null."""
    return None if value is None or math.isinf(value) or math.isnan(value) else value


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _at(samples: Sequence[Mapping[str, Any]], t: float) -> dict[str, Any] | None:
    """The load's figures at ``t``: linear between the samples either side of it.

    The load samples every 0.25 s and kvguard reads NVML on its own schedule; while
    memory grows fast, taking the nearest sample would misstate the allocator by up
    to an eighth of a second's growth.
    """
    if not samples:
        return None
    times = [s["t"] for s in samples]
    i = bisect.bisect_left(times, t)
    if i == 0 or i == len(samples):
        return dict(samples[min(i, len(samples) - 1)])
    before, after = samples[i - 1], samples[i]
    span = after["t"] - before["t"]
    share = (t - before["t"]) / span if span > 0 else 1.0
    return {
        **before,
        "t": t,
        **{
            key: before[key] + share * (after[key] - before[key])
            for key in ("reserved_bytes", "allocated_bytes", "tokens")
        },
    }


def _first_below(readings: Iterable[KvguardReading], limit: float, end: float) -> float | None:
    for r in readings:
        if r.t > end:
            return None
        if r.gpu_tte_s is not None and r.gpu_tte_s < limit:
            return r.t
    return None


def build_report(
    *,
    mode: str,
    settings: Mapping[str, Any],
    probe: Mapping[str, Any],
    readings: Sequence[KvguardReading],
    load_samples: Sequence[Mapping[str, Any]],
    load_start: Mapping[str, Any],
    load_end: Mapping[str, Any],
    after: Mapping[str, Any],
) -> dict[str, Any]:
    """The full report: timeline, events, figures and pass/fail checks.

    ``load_start`` is the load's ``go`` record (with ``allocated_bytes`` before it
    grew); ``load_end`` its ``oom`` or ``deadline`` record (the same shape as
    :func:`bench.gpu_load.run_until_oom` returns). Every ``t`` is on the same clock.
    """
    go = float(load_start["t"])
    oom_at = float(load_end["t"]) - go if load_end.get("event") == "oom" else None
    rel = [
        KvguardReading(**{**asdict(r), "t": r.t - go}) for r in sorted(readings, key=lambda r: r.t)
    ]
    samples = [{**s, "t": float(s["t"]) - go} for s in load_samples]
    end = oom_at if oom_at is not None else math.inf
    firsts = {
        limit: _first_below((r for r in rel if r.t >= 0), limit, end) for limit in TTE_THRESHOLDS_S
    }
    leads = {
        limit: (oom_at - at) if oom_at is not None and at is not None else None
        for limit, at in firsts.items()
    }

    timeline: list[dict[str, Any]] = []
    before_go_offsets = []
    ramp_deviation = []
    total = next((r.gpu_total_bytes for r in rel if r.gpu_total_bytes), None)
    for r in rel:
        sample = _at(samples, r.t) if r.t >= 0 else None
        reserved = sample["reserved_bytes"] if sample else load_start.get("reserved_bytes")
        offset = (
            r.gpu_used_bytes - reserved
            if r.gpu_used_bytes is not None and reserved is not None
            else None
        )
        if r.t < 0 and offset is not None:
            before_go_offsets.append(offset)
        timeline.append(
            {
                "t_s": round(r.t, 3),
                "kvguard_gpu_used_bytes": r.gpu_used_bytes,
                "kvguard_gpu_time_to_exhaustion_s": _finite(r.gpu_tte_s),
                "load_reserved_bytes": None if reserved is None else round(reserved),
                "load_allocated_bytes": round(sample["allocated_bytes"]) if sample else None,
                "load_tokens": round(sample["tokens"]) if sample else 0,
                "used_minus_reserved_bytes": offset,
            }
        )
    baseline = statistics.median(before_go_offsets) if before_go_offsets else None
    if baseline is not None and total:
        ramp_deviation = [
            abs(row["used_minus_reserved_bytes"] - baseline) / total
            for row in timeline
            if 0 <= row["t_s"] <= end and row["used_minus_reserved_bytes"] is not None
        ]
    deviation_p95 = (
        sorted(ramp_deviation)[max(0, math.ceil(0.95 * len(ramp_deviation)) - 1)]
        if ramp_deviation
        else None
    )

    kv_per_token = next((r.kv_bytes_per_token for r in reversed(rel) if r.kv_bytes_per_token), None)
    grown = int(load_end.get("allocated_bytes", 0)) - int(load_start.get("allocated_bytes", 0))
    capacity = int(load_end.get("token_capacity", 0))
    load_per_token = grown / capacity if capacity else None
    per_token_diff = (
        abs(kv_per_token - load_per_token) / load_per_token
        if kv_per_token and load_per_token
        else None
    )
    checks = {
        "nvml_matches_nvidia_smi": bool(probe.get("ok")),
        "load_reached_oom": oom_at is not None,
        "tte_under_30s_before_oom": leads[30.0] is not None and leads[30.0] > 0,
        "tte_under_10s_before_oom": leads[10.0] is not None and leads[10.0] > 0,
        "bytes_per_token_agree": per_token_diff is not None
        and per_token_diff <= BYTES_PER_TOKEN_TOLERANCE,
        "used_tracks_allocator": deviation_p95 is not None
        and deviation_p95 <= USED_TRACKING_TOLERANCE,
        "gpu_left_as_found": bool(after.get("ok")),
    }
    return {
        "mode": mode,
        "settings": dict(settings),
        "probe": dict(probe),
        "events": {
            "oom_at_s": _round(oom_at),
            "oom_error": load_end.get("error"),
            "load_end": load_end.get("event"),
            "tokens_at_end": load_end.get("tokens"),
            "first_tte_under_30s_at_s": _round(firsts[30.0]),
            "first_tte_under_10s_at_s": _round(firsts[10.0]),
            "lead_time_30s_s": _round(leads[30.0]),
            "lead_time_10s_s": _round(leads[10.0]),
        },
        "bytes_per_token": {
            "kvguard": kv_per_token,
            "load_measured": load_per_token,
            "load_shape": load_start.get("bytes_per_token"),
            "difference_ratio": per_token_diff,
        },
        "used_vs_reserved": {
            "baseline_offset_bytes": baseline,
            "ramp_deviation_p95_ratio": deviation_p95,
            "ramp_deviation_max_ratio": max(ramp_deviation) if ramp_deviation else None,
        },
        "after": dict(after),
        "ticks": len(rel),
        "timeline": timeline,
        "checks": checks,
        "passed": all(checks.values()),
    }


def _s(value: float | None, unit: str = " s") -> str:
    return "-" if value is None else f"{value:.1f}{unit}"


def _n(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def render_table(report: Mapping[str, Any], results_file: str | None = None) -> str:
    """The short table printed last: each figure and whether its check passed."""
    ev, bpt, checks = report["events"], report["bytes_per_token"], report["checks"]
    ok = {True: "ok", False: "FAIL"}
    probe_figures = ", ".join(
        f"GPU {g['index']}: total {_pct(g.get('total_diff_ratio'))},"
        f" {g.get('used_compared', 'used')} {_pct(g.get('used_diff_ratio'))}"
        for g in report["probe"].get("gpus", [])
    )
    kv, load = bpt["kvguard"], bpt["load_measured"]
    rows = [
        ("NVML vs nvidia-smi", probe_figures or "no GPU", checks["nvml_matches_nvidia_smi"]),
        (
            "real OOM (load start = 0 s)",
            _s(ev["oom_at_s"]) if ev["oom_at_s"] is not None else str(ev["load_end"]),
            checks["load_reached_oom"],
        ),
        (
            "time_to_exhaustion < 30 s first at",
            f"{_s(ev['first_tte_under_30s_at_s'])}, lead {_s(ev['lead_time_30s_s'])}",
            checks["tte_under_30s_before_oom"],
        ),
        (
            "time_to_exhaustion < 10 s first at",
            f"{_s(ev['first_tte_under_10s_at_s'])}, lead {_s(ev['lead_time_10s_s'])}",
            checks["tte_under_10s_before_oom"],
        ),
        (
            "KV bytes/token kvguard vs load",
            f"{_n(kv)} vs {_n(load)} ({_pct(bpt['difference_ratio'])})",
            checks["bytes_per_token_agree"],
        ),
        (
            "kvguard used vs allocator (p95)",
            f"{_pct(report['used_vs_reserved']['ramp_deviation_p95_ratio'])} of total",
            checks["used_tracks_allocator"],
        ),
        ("GPU left as found", "", checks["gpu_left_as_found"]),
    ]
    width = max(len(r[0]) for r in rows)
    value_width = max(len(r[1]) for r in rows)
    lines = [f"kvguard GPU check ({report['mode']}), {report['ticks']} kvguard ticks"]
    lines += [
        f"  {name:<{width}}  {value:<{value_width}}  {ok[passed]}" for name, value, passed in rows
    ]
    lines.append("PASSED" if report["passed"] else "FAILED")
    if results_file:
        lines.append(f"results: {results_file}")
    return "\n".join(lines)


def write_results(
    report: dict[str, Any], out: Path, extra: Mapping[str, str] | None = None
) -> list[Path]:
    """Write ``extra`` (name -> text), ``timeline.csv`` and, last, ``gpu-check.json``."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in (extra or {}).items():
        (out / name).write_text(text)
        written.append(out / name)
    timeline = out / "timeline.csv"
    with timeline.open("w", newline="") as handle:
        rows = report["timeline"]
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else ["t_s"])
        writer.writeheader()
        writer.writerows(rows)
    written.append(timeline)
    main = out / "gpu-check.json"
    # Everything the run left in the folder (logs and configs of the real run too).
    report["files"] = sorted({str(p) for p in out.iterdir() if p.is_file()} | {str(main)})
    main.write_text(json.dumps(report, indent=2) + "\n")
    return [*written, main]
