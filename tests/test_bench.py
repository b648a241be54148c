"""`python -m bench all --quick` as CI's smoke test, and the pure parts of the efficacy benchmark.

Benchmarks report; they do not gate. These tests check that the quick run finishes,
writes every file with every policy in it, that the figures hang together (the riding
observers share `none`'s traffic), and that the page is generated — not how fast
anything was.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.efficacy import (
    FAILURE_MODES,
    POLICIES,
    Run,
    predict_linear_alert,
    summarize,
    targets,
)

ROOT = Path(__file__).resolve().parents[1]
RUN_FIELDS = {
    "engine",
    "failure_mode",
    "pattern",
    "seed",
    "policy",
    "crashes",
    "preemptions",
    "completed",
    "goodput",
    "shed_fraction",
    "critical_lost",
    "p99_ttft_s",
    "lead_time_s",
}


def test_predict_linear_fires_when_the_trend_reaches_the_threshold_within_the_horizon():
    """Least squares over the window, projected a horizon ahead, as Prometheus does."""
    # Usage rising 0.05 per second from 0.2: 0.95 is 15 s away at t=0, 10 s away at t=5.
    rising = [(t / 10, 0.2 + 0.05 * t / 10) for t in range(-100, 200)]
    fired = predict_linear_alert(rising, window_s=5, horizon_s=10, threshold=0.95)
    assert fired == pytest.approx(5.0, abs=0.5)


def test_predict_linear_stays_quiet_on_a_flat_series_and_never_fires_in_the_warmup():
    """No trend, no alert; the warm-up is history only."""
    flat = [(t / 10, 0.9) for t in range(-100, 100)]
    assert predict_linear_alert(flat) is None
    warmup_only = [(t / 10, 0.2 + 0.1 * (t / 10 + 10)) for t in range(-100, 0)]
    assert predict_linear_alert(warmup_only) is None


def _run(policy: str, **figures) -> Run:
    base = {"engine": "sim", "failure_mode": "preempt", "pattern": "ramp", "seed": 1}
    return Run(**base, policy=policy, **figures)


def test_targets_report_misses_with_the_number():
    """A missed target says by how much and which baseline did better."""
    runs = [
        _run("none", preemptions=100, goodput=50, completed=60),
        _run("static_limit", goodput=70),
        _run("llmd_rule", goodput=40, shed_fraction=0.3),
        _run("kvguard", preemptions=20, goodput=60, shed_fraction=0.1),
    ]
    checks = {c["target"]: c for c in targets(summarize(runs)) if c["policy"] == "kvguard"}
    assert not checks["preemptions <= 10% of none"]["met"]
    assert checks["preemptions <= 10% of none"]["detail"] == "20 vs 100"
    assert not checks["goodput >= every baseline"]["met"]
    assert "static_limit 70" in checks["goodput >= every baseline"]["detail"]
    assert checks["shed <= llm-d rule's"]["met"]
    assert checks["zero crashes"]["met"]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """`python -m bench all --quick` once for the module, into a temp folder."""
    out = tmp_path_factory.mktemp("bench")
    page = out / "benchmarks.md"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "all",
            "--quick",
            "--results",
            str(out),
            "--docs",
            str(page),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, page


@pytest.mark.slow  # a long run: scripts/test.sh's second stage
def test_quick_run_writes_every_policy_for_every_pattern_and_mode(quick):
    """Every run has the documented fields; every cell has every policy."""
    out, _ = quick
    runs = json.loads((out / "efficacy.json").read_text())
    assert runs, "no runs"
    for run in runs:
        assert run.keys() >= RUN_FIELDS
    cells = {(r["failure_mode"], r["pattern"]) for r in runs}
    assert {mode for mode, _ in cells} == set(FAILURE_MODES)
    for mode, pattern in cells:
        policies = {
            r["policy"] for r in runs if (r["failure_mode"], r["pattern"]) == (mode, pattern)
        }
        assert policies == set(POLICIES), (mode, pattern)


@pytest.mark.slow  # a long run: scripts/test.sh's second stage
def test_observers_ride_on_the_unguarded_traffic(quick):
    """The alert and the dry-run share `none`'s figures; every run's figures hang together."""
    out, _ = quick
    runs = json.loads((out / "efficacy.json").read_text())
    for none in (r for r in runs if r["policy"] == "none"):
        key = (none["failure_mode"], none["pattern"], none["seed"])
        for observer in ("predict_linear", "kvguard_dry_run"):
            (twin,) = [
                r
                for r in runs
                if r["policy"] == observer and (r["failure_mode"], r["pattern"], r["seed"]) == key
            ]
            for figure in ("sent", "completed", "preemptions", "crashes"):
                assert twin[figure] == none[figure], (observer, figure)
    for r in runs:
        assert 0 <= r["completed"] <= r["sent"]
        assert r["goodput"] <= r["completed"]
        assert 0.0 <= r["shed_fraction"] <= 1.0
        if r["warned_at_s"] is not None and r["failed_at_s"] is not None:
            assert r["lead_time_s"] == pytest.approx(r["failed_at_s"] - r["warned_at_s"], abs=0.01)


@pytest.mark.slow  # a long run: scripts/test.sh's second stage
def test_quick_run_writes_the_page_with_both_parts(quick):
    """The page has the efficacy tables, the targets and the overhead part."""
    out, page = quick
    text = page.read_text()
    assert "## 1. Protection efficacy" in text
    assert "### Targets" in text
    assert "## 2." in text  # the overhead part, rendered by bench/overhead.py
    assert (out / "overhead.json").exists()
    summary = json.loads((out / "efficacy_summary.json").read_text())
    assert summary["quick"] is True
    assert summary["targets"], "no target was checked"
