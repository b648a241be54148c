"""trtllm-serve's JSON iteration stats: fixture -> adapter -> figures, and the probe over HTTP.

The fixture is written from TensorRT-LLM's source (tests/fixtures/engines/trtllm_serve.README.md
names the commits and lines); the Triton ``nv_trt_llm_*`` reading is tested in
test_engine_adapters.py and must keep passing beside these.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web

from kvguard.core.snapshot import EngineStats
from kvguard.errors import ProbeError
from kvguard.probes.engine import EngineProbe
from kvguard.probes.engines import ADAPTERS, EngineScrape, detect_kind

FIXTURE = Path(__file__).parents[1] / "fixtures" / "engines" / "trtllm_serve_iteration_stats.json"
TRITON_FIXTURE = FIXTURE.with_name("trtllm-triton-0.19.0.txt")
ADAPTER = ADAPTERS["trtllm"]

# The newest iteration of the fixture (iter 42), by hand from the file.
BUSY = EngineStats(
    kind="trtllm",
    up=True,
    kv_cache_usage_ratio=1495 / 4096,
    kv_capacity_tokens=4096 * 32,
    kv_capacity_blocks=4096,
    block_size=32,
    kv_used_tokens=1495 * 32,
    requests_running=8.0,
    requests_waiting=3.0,
)


def fixture_text() -> str:
    """The fixture's body, as trtllm-serve sends it."""
    return FIXTURE.read_text()


def with_latest(**changes: object) -> str:
    """The fixture with keys of its newest iteration replaced (``kv_`` keys in kvCacheStats)."""
    body = json.loads(fixture_text())
    for key, value in changes.items():
        if key.startswith("kv_"):
            body[-1]["kvCacheStats"][key[3:]] = value
        else:
            body[-1][key] = value
    return json.dumps(body, separators=(",", ":"))


# ------------------------------------------------------------------ the adapter


def test_newest_iteration_gives_capacity_use_and_queue():
    """Capacity is maxNumBlocks x tokensPerBlock, use usedNumBlocks; the last iteration counts."""
    assert ADAPTER.parse(EngineScrape(fixture_text())) == BUSY


def test_used_blocks_fall_back_to_max_minus_free():
    """Without usedNumBlocks, used is maxNumBlocks - freeNumBlocks (2601 free of 4096)."""
    body = json.loads(fixture_text())
    del body[-1]["kvCacheStats"]["usedNumBlocks"]
    stats = ADAPTER.parse(EngineScrape(json.dumps(body)))
    assert stats.kv_used_tokens == (4096 - 2601) * 32
    assert stats.kv_cache_usage_ratio == 1495 / 4096


def test_empty_list_keeps_capacity_and_leaves_the_present_unknown():
    """``[]`` (no iteration since the last read) is neither capacity 0 nor an error."""
    first = ADAPTER.parse(EngineScrape(fixture_text()))
    stats = ADAPTER.parse(EngineScrape("[]", previous=first))
    assert stats == EngineStats(
        kind="trtllm",
        up=True,
        kv_capacity_tokens=131072,
        kv_capacity_blocks=4096,
        block_size=32,
    )


def test_empty_list_before_any_iteration_is_all_unknown():
    """Before the first request trtllm-serve answers ``[]``: everything unknown, engine up."""
    assert ADAPTER.parse(EngineScrape("[]\n")) == EngineStats(kind="trtllm", up=True)


def test_null_kv_cache_stats_leave_kv_unknown_but_count_requests():
    """An executor without a KV cache manager writes kvCacheStats null (empty C++ optional)."""
    stats = ADAPTER.parse(EngineScrape(with_latest(kvCacheStats=None)))
    assert stats.kv_capacity_tokens is None
    assert stats.kv_cache_usage_ratio is None
    assert stats.kv_used_tokens is None
    assert (stats.requests_running, stats.requests_waiting) == (8.0, 3.0)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"kv_maxNumBlocks": -1}, "maxNumBlocks"),
        ({"kv_tokensPerBlock": "32"}, "tokensPerBlock"),
        ({"kv_usedNumBlocks": 1.5}, "usedNumBlocks"),
        ({"kv_usedNumBlocks": 5000}, "usedNumBlocks"),
        ({"numActiveRequests": True}, "numActiveRequests"),
        ({"numQueuedRequests": 2**60}, "numQueuedRequests"),
        ({"kvCacheStats": [1]}, "kvCacheStats"),
    ],
)
def test_garbage_figures_are_probe_errors_naming_the_key(changes, named):
    """A figure that is no count fails the probe and names the key, as a garbage series does."""
    with pytest.raises(ProbeError, match=named):
        ADAPTER.parse(EngineScrape(with_latest(**changes)))


@pytest.mark.parametrize("body", ["[1, 2]", '[{"iter": 1}', "[NaN", '[{"iter": 1}, []]'])
def test_malformed_json_is_a_probe_error(body):
    """A body that starts like a list but is not a list of objects is malformed."""
    with pytest.raises(ProbeError, match="malformed trtllm-serve iteration stats"):
        ADAPTER.parse(EngineScrape(body))


def test_detect_kind_names_trtllm_for_the_json_list():
    """Auto-detection: a JSON list of objects (even empty) is trtllm-serve; Triton's text too."""
    assert detect_kind(fixture_text()) == "trtllm"
    assert detect_kind("[]") == "trtllm"
    assert detect_kind(TRITON_FIXTURE.read_text()) == "trtllm"
    assert detect_kind("[not json") is None


def test_health_path_follows_the_server_that_answered():
    """trtllm-serve's /health for its JSON; Triton's /v2/health/ready for exposition text."""
    assert ADAPTER.health_path_for(fixture_text()) == "/health"
    assert ADAPTER.health_path_for(TRITON_FIXTURE.read_text()) == "/v2/health/ready"


# ------------------------------------------------------------------ the probe over HTTP


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[list[str]], Awaitable[str]]]:
    """A stand-in trtllm-serve: /metrics answers the next body of a list, /health 200."""
    runners: list[web.AppRunner] = []

    async def start(bodies: list[str]) -> str:
        answers = iter(bodies)

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text=next(answers), content_type="application/json")

        async def health(_: web.Request) -> web.Response:
            return web.Response(status=200)

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.mark.parametrize("kind", ["auto", "trtllm"])
async def test_probe_reads_trtllm_serve_and_its_health(serve, kind):
    """Auto-detected or configured: figures from the JSON, up from trtllm-serve's /health."""
    url = await serve([fixture_text(), "[]"])
    probe = EngineProbe(url, kind=kind)
    try:
        first = await probe.sample()
        assert probe.kind == "trtllm"
        assert first == BUSY
        # The next read drained nothing: capacity stays, the rest is unknown, still up.
        second = await probe.sample()
        assert second.up is True
        assert second.kv_capacity_tokens == 131072
        assert second.kv_cache_usage_ratio is None
        assert second.requests_running is None
    finally:
        await probe.close()
