"""`python -m bench.overhead --quick` end to end: every measurement runs and reports.

A smoke test of the benchmark, not of kvguard's speed: it checks the result's shape and
that each figure is a sane number, never how fast anything was (benchmarks report,
they do not gate).
"""

from __future__ import annotations

import json
import math

import pytest

from bench import overhead
from bench.overhead_procs import NGINX
from bench.overhead_scrape import FIXTURE, build_fixture


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    """One quick run for every test below (it takes about half a minute)."""
    out = tmp_path_factory.mktemp("overhead") / "overhead.json"
    doc = overhead.run(quick=True, out=out)
    assert json.loads(out.read_text()) == doc
    return doc


@pytest.mark.slow  # a long run: scripts/test.sh's second stage
def test_every_phase_ran_without_error(result):
    """Daemon, proxy, scrape and reaction each produced figures, none an error."""
    for phase in ("daemon", "proxy", "scrape", "reaction"):
        assert "error" not in result[phase], result[phase]
    assert result["quick"] is True
    machine = result["machine"]
    assert machine["cores"] >= 1
    assert machine["python"].count(".") == 2
    assert isinstance(machine["shared_with_other_processes"], bool)


@pytest.mark.slow  # a long run: scripts/test.sh's second stage
def test_daemon_figures_are_sane(result):
    """Four configurations; each daemon used some CPU, held some memory, and ticked."""
    configs = result["daemon"]["configs"]
    assert set(configs) == {"2hz", "2hz_proxy", "20hz", "20hz_proxy"}
    for figures in configs.values():
        assert 0 <= figures["cpu_s_per_wall_s"] < 2
        assert 10 < figures["rss_peak_mib"] < 1024
        assert figures["ticks"] > 0


@pytest.mark.slow  # a long run: scripts/test.sh's second stage
def test_proxy_answered_every_request(result):
    """Every request through every path got a 200, and each path has its ratios."""
    proxy = result["proxy"]
    expected = {"direct", "kvguard"} | ({"nginx"} if NGINX else set())
    assert set(proxy["targets"]) == expected
    assert (proxy["nginx_skipped"] is None) == (NGINX is not None)
    for kind in ("json", "stream"):
        per = proxy["summary"][kind]
        for target in expected:
            assert per[target]["ok"] == per[target]["sent"] > 0, (kind, target)
            assert per[target]["throughput_rps"] > 0
        assert _finite(per["kvguard"]["added_p50_ms"])
        assert per["kvguard"]["throughput_vs_direct"] > 0
        if NGINX:
            assert per["kvguard"]["throughput_vs_nginx"] > 0
    for one in proxy["per_round"]:
        for target in expected:
            for kind in ("json", "stream"):
                assert set(one[target][kind]["open_statuses"]) == {"200"}


@pytest.mark.slow  # a long run: scripts/test.sh's second stage
def test_scrape_read_the_whole_exposition(result):
    """The probe parsed the 4-engine fixture: usage and queues summed over engines."""
    scrape = result["scrape"]
    assert scrape["bytes"] >= 100_000
    assert scrape["tick"]["p50_ms"] > 0
    assert scrape["seen"]["requests_running"] == 10
    assert scrape["seen"]["requests_waiting"] == 14


@pytest.mark.slow  # a long run: scripts/test.sh's second stage
def test_reaction_shed_in_every_trial(result):
    """Each trial reached high and got a 503; the plan at that tick was a shed."""
    reaction = result["reaction"]
    for run in reaction["runs"]:
        assert run["shed"], run
        assert run["level"] in ("high", "critical")
        assert any(step.startswith("shed") for step in run["plan"])
        assert run["reaction_ms"] is not None


@pytest.mark.slow  # a long run: scripts/test.sh's second stage
def test_targets_and_markdown(result):
    """Each target row has a value and a verdict; the docs section shows them."""
    rows = result["targets"]
    assert len(rows) >= 12
    for row in rows:
        assert _finite(row["value"]), row
        assert isinstance(row["met"], bool)
    text = overhead.render_markdown(result)
    assert text.startswith("## 2. Overhead")
    assert "### Targets" in text
    for row in rows:
        assert row["name"] in text
    assert result["machine"]["cpu"] in text


def test_fixture_is_what_the_builder_makes():
    """The committed data-parallel exposition is exactly the builder's output."""
    assert FIXTURE.read_text() == build_fixture()
