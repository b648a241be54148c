"""The efficacy benchmark: its arithmetic, its rules, its plan, and a quick run end to end.

Benchmarks report; they do not gate. These tests check the instrument: that intervals
and ties are computed as docs/benchmarks.md says, that the baselines follow their
published rules, that the flags run what they name, that one run writes one file with
its commit and every setting, and that the page is generated from it — not how well any
policy did.
"""

import itertools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import efficacy, efficacy_plot, report
from bench.efficacy_policies import (
    LLMD_KV_UTIL,
    LLMD_QUEUE_DEPTH,
    LLMD_STALENESS_S,
    llmd_saturated,
    predict_linear_alert,
)
from bench.efficacy_stats import bootstrap_median, compare, summarize, workload_of
from tests.test_doc_links import broken_links

ROOT = Path(__file__).resolve().parents[1]


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


def test_llmd_rule_is_strict_and_counts_stale_metrics_as_saturated():
    """llm-d's detector: `>` on both thresholds; metrics older than 200 ms saturate."""
    fresh = LLMD_STALENESS_S / 2
    assert not llmd_saturated(LLMD_QUEUE_DEPTH, LLMD_KV_UTIL, fresh)  # at the line: not over
    assert llmd_saturated(LLMD_QUEUE_DEPTH + 1, 0.0, fresh)
    assert llmd_saturated(0.0, LLMD_KV_UTIL + 0.01, fresh)
    assert llmd_saturated(0.0, 0.0, LLMD_STALENESS_S + 0.01)
    assert llmd_saturated(None, None, 0.0)  # nothing read yet


def test_bootstrap_interval_holds_the_median_and_is_repeatable():
    """The interval brackets the median, is the same every time, and collapses for one seed."""
    values = [0.52, 0.61, 0.58, 0.9, 0.55]
    first = bootstrap_median(values)
    assert first == bootstrap_median(values)
    assert first["median"] == 0.58
    assert first["low"] <= first["median"] <= first["high"]
    assert first["low"] < first["high"]
    assert bootstrap_median([0.4]) == {"median": 0.4, "low": 0.4, "high": 0.4, "n": 1}
    assert bootstrap_median([])["median"] is None


def test_a_difference_inside_the_intervals_is_a_tie():
    """Win or loss only when the intervals do not overlap."""
    low = {"median": 0.5, "low": 0.45, "high": 0.55, "n": 5}
    overlapping = {"median": 0.6, "low": 0.54, "high": 0.66, "n": 5}
    apart = {"median": 0.8, "low": 0.7, "high": 0.9, "n": 5}
    assert compare(overlapping, low, higher_is_better=True) == "tie"
    assert compare(apart, low, higher_is_better=True) == "win"
    assert compare(low, apart, higher_is_better=True) == "loss"
    assert compare(low, {"median": None}, higher_is_better=True) == "n/a"
    one_seed = {"median": 0.9, "low": 0.9, "high": 0.9, "n": 1}
    assert compare(one_seed, low, higher_is_better=True) == "n/a"  # no interval: no verdict


def _run(policy: str, seed: int, attained: float, **more) -> dict:
    sent = 100
    return {
        "policy": policy,
        "pattern": "ramp",
        "trace": None,
        "speed": None,
        "failure_mode": "preempt",
        "seed": seed,
        "max_num_seqs": more.pop("max_num_seqs", 256),
        "crashes": 0,
        "sent": sent,
        "slo_attainment": attained,
        "goodput_tokens": attained * 1000,
        "shed": more.pop("shed", 0),
        "refused": 0,
        "by_priority": {},
        **more,
    }


def test_static_best_is_the_sweep_value_with_the_best_median_attainment():
    """The oracle picks in hindsight, per workload and mode, and keeps the whole sweep."""
    runs = [_run("none", s, 0.3) for s in (1, 2, 3)]
    for n, level in ((8, 0.4), (32, 0.7), (128, 0.5)):
        runs += [_run("static", s, level + s / 100, max_num_seqs=n) for s in (1, 2, 3)]
    runs += [_run("kvguard", s, 0.71 + s / 100) for s in (1, 2, 3)]
    entry = summarize(runs)["ramp"]["preempt"]
    best = entry["policies"]["static_best"]
    assert best["max_num_seqs"] == 32
    assert best["slo_attainment"]["median"] == pytest.approx(0.72)
    assert set(best["sweep"]) == {"8", "32", "128"}
    assert "static" not in entry["policies"]  # only the oracle is a row
    assert entry["verdicts"]["none"]["slo_attainment"] == "win"
    assert entry["verdicts"]["static_best"]["slo_attainment"] == "tie"


def test_shares_are_of_requests_sent_and_workloads_are_named_by_trace_and_speed():
    """Shed share = shed / sent; a trace replay is `file@Fx`."""
    runs = [_run("kvguard", 1, 0.5, shed=25)]
    row = summarize(runs)["ramp"]["preempt"]["policies"]["kvguard"]
    assert row["shed_fraction"]["median"] == 0.25
    trace = {"trace": "azure.csv", "speed": 4.0, "pattern": None}
    assert workload_of(trace) == "azure.csv@4x"


def _plan(*argv: str) -> efficacy.Plan:
    return efficacy.plan_from(efficacy.parser().parse_args(list(argv)))


def test_flags_run_what_they_name(tmp_path):
    """--traces alone runs only traces; nothing given runs every workload; errors exit."""
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    only = _plan("--traces", str(trace), "--speed", "2", "8")
    assert [w.name for w in only.workloads] == ["t.csv@2x", "t.csv@8x"]
    patterns = _plan("--patterns", "ramp", "steady_underload")
    assert [w.name for w in patterns.workloads] == ["ramp", "steady_underload"]
    everything = _plan()
    names = [w.name for w in everything.workloads]
    assert set(efficacy.WORKLOAD_PATTERNS) <= set(names)
    assert "azure-llm-2023-code.csv@1x" in names
    assert "azure-llm-2023-code.csv@4x" in names
    # Every (mode, workload, seed) gets each policy once and every sweep value once.
    runs = _plan("--patterns", "ramp", "--seeds", "2", "--static-sweep", "4", "16").traffic_runs()
    assert len(runs) == 2 * 1 * 2 * (4 + 2)
    with pytest.raises(SystemExit, match="--seeds 0"):
        _plan("--seeds", "0")
    with pytest.raises(SystemExit, match="no such file"):
        _plan("--traces", str(tmp_path / "missing.csv"))


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """`python -m bench efficacy` on a small plan once for the module, into a temp folder."""
    out = tmp_path_factory.mktemp("bench")
    done = subprocess.run(
        [
            *(sys.executable, "-m", "bench", "efficacy"),
            *("--patterns", "bursty_short", "--seeds", "1", "--pattern-s", "3"),
            *("--static-sweep", "8", "--out-dir", str(out)),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


@pytest.mark.slow  # a run of every policy in both modes: scripts/test.sh's second stage
def test_one_run_writes_one_file_with_its_commit_settings_and_every_policy(quick):
    """Meta names the commit and every setting; each mode has every policy; the page too."""
    doc = json.loads((quick / "efficacy.json").read_text())
    meta = doc["meta"]
    assert len(meta["commit"]) == 40
    assert meta["settings"]["client"]["retries"] == efficacy.RETRIES
    assert meta["settings"]["slo"] == {"ttft_s": 2.0, "tpot_s": 0.1}
    assert meta["loadavg_at_start"]
    assert meta["started"]
    for mode in efficacy.FAILURE_MODES:
        policies = {r["policy"] for r in doc["runs"] if r["failure_mode"] == mode}
        assert policies == set(efficacy.POLICIES), mode
        assert set(doc["summary"]["bursty_short"][mode]["policies"]) >= {
            "none",
            "static_best",
            "engine_priority",
            "llmd_rule",
            "kvguard",
        }
    page = (quick / "benchmarks.md").read_text()
    assert meta["commit"] in page
    assert "### Headline: SLO attainment" in page
    assert "**This is a reduced run**" in page


@pytest.mark.slow  # a run of every policy in both modes: scripts/test.sh's second stage
def test_every_sent_request_ends_one_way_and_observers_share_none_traffic(quick):
    """Completed + shed + refused + failed + unfinished = sent; observers are `none`'s twins."""
    runs = json.loads((quick / "efficacy.json").read_text())["runs"]
    for r in runs:
        ends = r["completed"] + r["shed"] + r["refused"] + r["failed"] + r["unfinished"]
        assert ends == r["sent"], r["policy"]
        assert 0 <= r["slo_met"] <= r["completed"]
        if r["warned_at_s"] is not None and r["failed_at_s"] is not None:
            assert r["lead_time_s"] == pytest.approx(r["failed_at_s"] - r["warned_at_s"], abs=0.01)
    for none in (r for r in runs if r["policy"] == "none"):
        for observer in ("predict_linear", "kvguard_dry_run"):
            (twin,) = [
                r
                for r in runs
                if r["policy"] == observer
                and (r["failure_mode"], r["seed"]) == (none["failure_mode"], none["seed"])
            ]
            for figure in ("sent", "completed", "slo_met", "preemptions", "crashes"):
                assert twin[figure] == none[figure], (observer, figure)


def test_a_report_links_its_plots_from_where_it_is_written(tmp_path):
    """Beside its results (a partial run's page) or in docs/, every image and link resolves."""
    subset = tmp_path / "bench" / "results" / "efficacy_subset"
    subset.mkdir(parents=True)
    shutil.copy(ROOT / "bench" / "results" / "efficacy_process" / "efficacy.json", subset)
    (subset / "efficacy_mixed.png").write_bytes(b"")
    beside = report.write(subset, subset / "benchmarks.md")
    published = report.write(subset, tmp_path / "docs" / "benchmarks.md")
    assert "![efficacy_mixed.png](efficacy_mixed.png)" in beside.read_text()
    assert (
        "![efficacy_mixed.png](../bench/results/efficacy_subset/efficacy_mixed.png)"
        in published.read_text()
    )
    assert broken_links(beside, root=tmp_path) == []
    assert broken_links(published, root=tmp_path) == []
    assert report.link(report.ANALYSIS, ROOT / "docs" / "benchmarks.md") == "../bench/analysis.md"


def _timeline(actions: list[tuple[float, str]]) -> dict:
    """A kvguard run's timeline for the plots: usage rising to the pool, demand past it."""
    engine = [(t / 10, min(1.0, t / 100), 0, 0) for t in range(-20, 300)]
    forecast = [(t / 10, min(1.0, t / 100), 1.2, "high" if t > 50 else "ok") for t in range(300)]
    return {"engine": engine, "forecast": forecast, "actions": actions}


KINDS = ["shed", "tighten_window", "evict", "cancel_largest", "kv_fp8", "revert_kv_fp8",
         "release shed", "release tighten_window"]  # fmt: skip


@pytest.mark.parametrize(
    "actions",
    [
        pytest.param([(10 + i / 8, kind) for i, kind in enumerate(KINDS)], id="8-kinds-in-1s"),
        pytest.param([(10 + i / 8, KINDS[i % 2]) for i in range(8)], id="8-actions-2-kinds"),
        pytest.param([], id="no-action"),
    ],
)
def test_efficacy_plot_labels_do_not_overlap_when_actions_come_close(actions):
    """Eight actions within a second: every text of the picture drawn apart, none under 8 pt."""
    pytest.importorskip("matplotlib")
    from matplotlib.text import Text  # noqa: PLC0415 - optional, like the plots

    series = {
        "none": _timeline([]),
        "kvguard": _timeline(actions),
        "kvguard_dry_run": _timeline([]),
    }
    fig = efficacy_plot.figure("mixed", series, seed=1)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    lanes = {t.get_text() for t in fig.axes[1].get_yticklabels()}
    assert lanes >= {kind for _, kind in actions}  # each kind labels its own lane
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
    overlapping = [
        (a, b)
        for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2)
        if box_a.overlaps(box_b)
    ]
    assert overlapping == []
    assert min(t.get_fontsize() for t in texts) >= efficacy_plot.LABEL_PT >= 8


def test_efficacy_plot_writes_one_png_per_workload(tmp_path):
    """plot() saves each workload's figure under its name, an earlier run's PNGs gone."""
    pytest.importorskip("matplotlib")
    (tmp_path / "efficacy_old.png").write_bytes(b"")
    series = {"mixed": {"kvguard": _timeline([(1.0, "shed")]), "none": _timeline([])}}
    assert efficacy_plot.plot(series, tmp_path, seed=1) == ["efficacy_mixed.png"]
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["efficacy_mixed.png"]
    assert (tmp_path / "efficacy_mixed.png").read_bytes().startswith(b"\x89PNG")
