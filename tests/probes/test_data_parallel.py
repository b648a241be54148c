"""Data-parallel vLLM reported per engine: shares in the snapshot, per-rank series, /status.

A vLLM started with ``--data-parallel-size N`` labels its series ``engine="0"`` …
``"N-1"``. The deployment stays one :class:`EngineStats` for the decision (counts and
capacity added up, the fullest engine's usage); beside it, each engine's own figures
are kept as an :class:`EngineShare` and exported as ``kvguard_engine_*{dp_rank}``.
Expected figures are read from the fixture text with prometheus_client's parser,
independently of the adapter.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from kvguard.api.app import build_app
from kvguard.api.telemetry import daemon_registry
from kvguard.config.settings import parse_config
from kvguard.core.snapshot import EngineShare
from kvguard.probes.engine import EngineProbe
from kvguard.probes.engines import ADAPTERS, EngineScrape
from kvguard.runtime.daemon import Daemon
from kvguard.runtime.probing import Probes

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
DP2 = FIXTURES / "engines" / "vllm_sim_dp2.txt"
DP4 = FIXTURES / "bench" / "vllm-cpu-dp4.txt"
SINGLE = sorted((FIXTURES / "engines").glob("vllm*.txt"))
SINGLE.remove(DP2)


def per_engine(text: str, sample: str) -> dict[int, float]:
    """``{engine index: value}`` of one sample name, straight from the exposition."""
    return {
        int(s.labels["engine"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == sample
    }


def blocks_per_engine(text: str) -> dict[int, int]:
    """``{engine index: num_gpu_blocks}`` from ``vllm:cache_config_info``'s labels."""
    return {
        int(s.labels["engine"]): int(s.labels["num_gpu_blocks"])
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vllm:cache_config_info"
    }


def parse(text: str) -> tuple[EngineShare, ...]:
    """The shares the vLLM adapter makes of ``text``."""
    return ADAPTERS["vllm"].parse(EngineScrape(text)).engines


def without_engine(text: str, index: int) -> str:
    """``text`` less every sample line of engine ``index`` (a rank that went away)."""
    label = f'engine="{index}"'
    return "\n".join(line for line in text.splitlines() if label not in line) + "\n"


# ------------------------------------------------------------------ the adapter
@pytest.mark.parametrize(("path", "count"), [(DP2, 2), (DP4, 4)])
def test_each_engine_s_share_is_what_its_series_say(path, count):
    """One share per engine label, in index order, each with that engine's own figures."""
    text = path.read_text()
    shares = parse(text)
    assert [s.index for s in shares] == list(range(count))
    usage = per_engine(text, "vllm:kv_cache_usage_perc")
    running = per_engine(text, "vllm:num_requests_running")
    waiting = per_engine(text, "vllm:num_requests_waiting")
    preemptions = per_engine(text, "vllm:num_preemptions_total")
    blocks = blocks_per_engine(text)
    for share in shares:
        assert share.kv_cache_usage_ratio == usage[share.index]
        assert share.kv_capacity_blocks == blocks[share.index]
        assert share.requests_running == running[share.index]
        assert share.requests_waiting == waiting[share.index]
        assert share.preemptions_total == preemptions[share.index]


def test_the_two_engine_fixture_in_figures():
    """Engine 0 at 93% with 11 running, 1 waiting, 1 preemption; engine 1 at 21%, 3 running."""
    assert parse(DP2.read_text()) == (
        EngineShare(0, 0.9333333333333333, 256, 11.0, 1.0, 1.0),
        EngineShare(1, 0.21176470588235294, 256, 3.0, 0.0, 0.0),
    )


@pytest.mark.parametrize("path", [DP2, DP4])
def test_the_deployment_figures_are_unchanged_and_the_shares_add_up_to_them(path):
    """The decision's figures stay the sums and the fullest usage; the shares agree."""
    stats = ADAPTERS["vllm"].parse(EngineScrape(path.read_text()))
    shares = stats.engines
    assert stats.kv_cache_usage_ratio == max(s.kv_cache_usage_ratio or 0.0 for s in shares)
    assert stats.kv_capacity_blocks == sum(s.kv_capacity_blocks or 0 for s in shares)
    assert stats.requests_running == sum(s.requests_running or 0.0 for s in shares)
    assert stats.requests_waiting == sum(s.requests_waiting or 0.0 for s in shares)
    assert stats.preemptions_total == sum(s.preemptions_total or 0.0 for s in shares)


@pytest.mark.parametrize("path", SINGLE, ids=lambda p: p.name)
def test_a_single_engine_has_no_shares(path):
    """One engine index (or none): the deployment's figures say it all, the list is empty."""
    assert parse(path.read_text()) == ()


def test_a_dp4_engine_left_alone_has_no_shares():
    """Three of four engines gone: what remains is one engine, reported as such."""
    text = DP4.read_text()
    for index in (1, 2, 3):
        text = without_engine(text, index)
    assert parse(text) == ()


def test_figures_an_engine_does_not_report_are_unknown_and_odd_labels_name_no_rank():
    """No cache_config_info for engine 1: its blocks are None. engine="x" / "01" are ignored."""
    text = (
        'vllm:kv_cache_usage_perc{engine="0"} 0.5\n'
        'vllm:kv_cache_usage_perc{engine="1"} 0.25\n'
        'vllm:kv_cache_usage_perc{engine="x"} 0.75\n'
        'vllm:num_requests_running{engine="01"} 7\n'
        'vllm:num_requests_running{engine="1"} 2\n'
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="101"} 1.0\n'
    )
    assert parse(text) == (
        EngineShare(0, 0.5, 101, None, None, None),
        EngineShare(1, 0.25, None, 2.0, None, None),
    )


@pytest.mark.parametrize("kind", ["sglang", "tgi", "trtllm"])
def test_other_engines_report_no_shares(kind):
    """Only vLLM has per-engine figures here; the others leave the list empty."""
    fixture = {
        "sglang": "sglang_sim_busy.txt",
        "tgi": "tgi-3.3.7.txt",
        "trtllm": "trtllm-triton-0.19.0.txt",
    }[kind]
    text = (FIXTURES / "engines" / fixture).read_text()
    assert ADAPTERS[kind].parse(EngineScrape(text)).engines == ()


# ------------------------------------------------------------------ the daemon: /metrics, /status
class Clock:
    """A monotonic clock the test moves by hand (no sleeping between ticks)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Replay:
    """What the loopback engine serves at /metrics; the test swaps it between ticks."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.status = 200


@pytest.fixture
async def dp_engine() -> AsyncIterator[tuple[str, Replay]]:
    """A loopback server replaying vLLM's exposition of data-parallel engines (dp2 first)."""
    replay = Replay(DP2.read_text())

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=replay.text, content_type="text/plain", status=replay.status)

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", replay
    await runner.cleanup()


@pytest.fixture
async def guard(dp_engine) -> AsyncIterator[tuple[Daemon, Callable[[], Awaitable[None]], Replay]]:
    """A daemon watching the loopback engine (no GPU, no host probe), and a tick function."""
    url, replay = dp_engine
    clock = Clock()
    probes = Probes(engine=EngineProbe(url, kind="vllm", timeout_s=2.0), nvml=None, host=None)
    config = parse_config({"engine": {"url": url, "kind": "vllm"}}, env={})
    daemon = Daemon(config, probes=probes, clock=clock)

    async def tick() -> None:
        clock.now += 0.5
        await daemon.tick()

    yield daemon, tick, replay
    await daemon.close()


def rank_values(daemon: Daemon, name: str) -> dict[str, float]:
    """``{dp_rank: value}`` of one per-rank family as a scrape of the daemon sees it."""
    registry = daemon_registry(daemon)
    return {
        s.labels["dp_rank"]: s.value
        for family in registry.collect()
        for s in family.samples
        if s.name == name
    }


async def test_one_series_per_rank_and_a_rank_that_vanished_is_dropped(guard):
    """dp4: four ranks; engine 3 gone: three; one engine left: no per-rank series at all."""
    daemon, tick, replay = guard
    dp4 = DP4.read_text()
    replay.text = dp4
    await tick()
    usage = per_engine(dp4, "vllm:kv_cache_usage_perc")
    running = per_engine(dp4, "vllm:num_requests_running")
    waiting = per_engine(dp4, "vllm:num_requests_waiting")
    assert rank_values(daemon, "kvguard_engine_kv_cache_usage_ratio") == {
        str(i): v for i, v in usage.items()
    }
    assert rank_values(daemon, "kvguard_engine_requests_running") == {
        str(i): v for i, v in running.items()
    }
    assert rank_values(daemon, "kvguard_engine_requests_waiting") == {
        str(i): v for i, v in waiting.items()
    }
    # The deployment-wide families keep one unlabelled series each.
    registry = daemon_registry(daemon)
    assert registry.get_sample_value("kvguard_kv_cache_usage_ratio") == max(usage.values())
    assert registry.get_sample_value("kvguard_requests_running") == sum(running.values())

    replay.text = without_engine(dp4, 3)
    await tick()
    for name in (
        "kvguard_engine_kv_cache_usage_ratio",
        "kvguard_engine_requests_running",
        "kvguard_engine_requests_waiting",
    ):
        assert sorted(rank_values(daemon, name)) == ["0", "1", "2"], name

    replay.text = (FIXTURES / "engines" / "vllm_sim_busy.txt").read_text()
    await tick()
    assert rank_values(daemon, "kvguard_engine_kv_cache_usage_ratio") == {}
    assert daemon_registry(daemon).get_sample_value("kvguard_kv_cache_usage_ratio") is not None


async def test_a_failing_engine_exports_no_rank_figures(guard):
    """While the engine's metrics fail, its per-rank series are left out, not kept stale."""
    daemon, tick, replay = guard
    await tick()
    assert set(rank_values(daemon, "kvguard_engine_kv_cache_usage_ratio")) == {"0", "1"}
    replay.status = 500
    await tick()
    assert rank_values(daemon, "kvguard_engine_kv_cache_usage_ratio") == {}
    assert rank_values(daemon, "kvguard_engine_requests_running") == {}


async def test_status_lists_each_engine_under_the_engine_section(guard):
    """GET /status: engine.engines is a list, one object per engine, in index order."""
    daemon, tick, _ = guard
    await tick()
    runner = web.AppRunner(build_app(daemon), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{port}/status") as resp,
        ):
            assert resp.status == 200
            doc = json.loads(await resp.text())
    finally:
        await runner.cleanup()
    engine = doc["engine"]
    assert engine["kv_cache_usage_ratio"] == pytest.approx(0.9333333333333333)
    assert engine["requests_running"] == 14
    assert engine["engines"] == [
        {
            "index": 0,
            "kv_cache_usage_ratio": 0.9333333333333333,
            "kv_capacity_blocks": 256,
            "requests_running": 11.0,
            "requests_waiting": 1.0,
            "preemptions_total": 1.0,
        },
        {
            "index": 1,
            "kv_cache_usage_ratio": 0.21176470588235294,
            "kv_capacity_blocks": 256,
            "requests_running": 3.0,
            "requests_waiting": 0.0,
            "preemptions_total": 0.0,
        },
    ]
