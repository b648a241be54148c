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
from bench.overhead_scrape import FIXTURE, GPU_POOL_BLOCKS, ROOT, build_fixture, with_pool
from kvguard.probes.engines import ADAPTERS, EngineScrape


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
    assert set(configs) == {"2hz", "2hz_proxy", "10hz", "10hz_proxy"}
    for figures in configs.values():
        assert 0 <= figures["cpu_s_per_wall_s"] < 2
        assert 10 < figures["rss_peak_mib"] < 1024
        assert figures["ticks"] > 0


@pytest.mark.slow  # a long run: scripts/test.sh's second stage
def test_proxy_answered_every_request(result):
    """Every request through every path got a 200, and each path has its ratios."""
    proxy = result["proxy"]
    expected = {"direct", "kvguard", "aiohttp_floor"}
    expected |= {"nginx", "nginx_admission"} if NGINX else set()
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
            assert per["nginx_admission"]["throughput_vs_nginx"] > 0
    if NGINX:
        # Through nginx, kvguard answered each completion's /admission check.
        assert proxy["proxy_cpu"]["nginx_admission"]["cpu_ms_per_request"] > 0
        assert proxy["proxy_cpu"]["nginx_admission"]["nginx_cpu_ms_per_request"] > 0
    for one in proxy["per_round"]:
        for target in expected:
            for kind in ("json", "stream"):
                assert set(one[target][kind]["open_statuses"]) == {"200"}


@pytest.mark.slow  # a long run: scripts/test.sh's second stage
def test_scrape_read_the_whole_exposition(result):
    """The probe parsed the 4-engine fixture: usage and queues summed over engines."""
    scrape = result["scrape"]
    assert scrape["bytes"] >= 100_000
    assert scrape["pages"] == 2  # the page and its twin, in turn
    for figures in ("tick", "tick_cpu", "parse_only", "parse_cold"):
        assert scrape[figures]["p50_ms"] > 0, figures
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
        # The parts: the decision is in force before the client sees the 503.
        assert run["parts_ms"]["tick_to_decision_in_force"] >= 0
        assert run["parts_ms"]["in_force_to_client_503"] >= 0


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


def test_the_twin_page_changes_every_engine_and_nothing_else():
    """The twin swaps busy and idle engines: the same lines in the same order, new figures."""
    page, twin = build_fixture().split("\n"), build_fixture(busy_even=False).split("\n")
    assert len(page) == len(twin)
    changed = [(a, b) for a, b in zip(page, twin, strict=True) if a != b]
    assert changed
    for a, b in changed:  # only sample values of per-engine series differ
        assert 'engine="' in a
        assert a.rsplit(" ", 1)[0] == b.rsplit(" ", 1)[0]
    reads = ADAPTERS["vllm"]
    seen = [
        reads.parse(EngineScrape(metrics_text=text)) for text in (build_fixture(), "\n".join(twin))
    ]
    assert seen[0].requests_running == seen[1].requests_running  # two busy engines either way
    assert [e.requests_running for e in seen[0].engines] != [
        e.requests_running for e in seen[1].engines
    ]


def test_a_gpu_size_pool_is_the_capture_with_its_pool_scaled():
    """The proxy benchmark's engine page: the idle capture, only its pool's labels scaled."""
    idle = (ROOT / "tests" / "fixtures" / "engines" / "vllm-cpu-idle.txt").read_text()
    page = with_pool(idle, GPU_POOL_BLOCKS)
    changed = [(a, b) for a, b in zip(idle.split("\n"), page.split("\n"), strict=True) if a != b]
    assert len(changed) == 1
    assert changed[0][0].startswith("vllm:cache_config_info{")
    stats = ADAPTERS["vllm"].parse(EngineScrape(metrics_text=page))
    assert stats.kv_capacity_blocks == GPU_POOL_BLOCKS
    assert stats.kv_capacity_tokens == GPU_POOL_BLOCKS * 128
