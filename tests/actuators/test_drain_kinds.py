"""Which engines' pause can drain for the fp8 switch without the proxy, and SGLang's drain.

SGLang's pause has no mode that lets running requests finish (``in_place`` freezes
them), so without the proxy its fp8 switch is refused; with the proxy the drain is
admission-side: the proxy stops admitting, waits for the running set, and cuts what
is left at ``drain_timeout_s``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from kvguard.actuators.dispatch import Actuators
from kvguard.actuators.drain import EnginePauseDrain, ProxyDrain
from kvguard.actuators.engine_admin import EngineAdmin
from kvguard.actuators.mitigations import Mitigations
from kvguard.actuators.proxy import AdmissionProxy, ProxySettings
from kvguard.actuators.reconfigure import Reconfigurer
from kvguard.core.policy import Action
from tests.actuators.conftest import Rig, streamed, supervised_rig
from tests.helpers import until


async def _no_stats() -> None:
    return None


@pytest.mark.parametrize(("kind", "drains"), [("vllm", True), ("sglang", False), ("tgi", False)])
def test_only_a_pause_that_lets_requests_finish_can_drain(kind, drains):
    """Mode=wait (vLLM) lets running requests finish; in_place (SGLang) freezes them."""
    admin = EngineAdmin("http://127.0.0.1:9", kind)
    assert EnginePauseDrain(admin, _no_stats).can_stop_admitting() is drains


# ---------------------------------------------------------------------- SGLang, no proxy
class RecordingRestarter:
    """A restarter that only records: the switch must never get this far when refused."""

    description = "test (records)"
    starts_8bit = False
    original_8bit = False

    def __init__(self) -> None:
        self.applied: list[bool] = []

    async def apply(self, *, fp8: bool) -> None:
        self.applied.append(fp8)

    def exited(self) -> str | None:
        return None


@pytest.fixture
async def sglang_admin_port() -> AsyncIterator[tuple[str, list[str]]]:
    """A stand-in for SGLang's HTTP server that records every request made to it."""
    asked: list[str] = []

    async def record(request: web.Request) -> web.Response:
        asked.append(f"{request.method} {request.path}")
        return web.json_response({})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", asked
    finally:
        await runner.cleanup()


async def test_without_the_proxy_the_sglang_switch_is_refused(sglang_admin_port):
    """No proxy: the switch is unavailable, and refused if asked anyway: no pause, no restart.

    The only drain left would be SGLang's pause, which freezes running requests: it
    could never end. With the proxy as the drain, the same switch is available.
    """
    url, asked = sglang_admin_port
    restarter = RecordingRestarter()

    def build(kind: str) -> tuple[EngineAdmin, Reconfigurer]:
        admin = EngineAdmin(url, kind, backoff_s=0.01)
        drain = EnginePauseDrain(admin, _no_stats)
        return admin, Reconfigurer(restarter, drain, engine_stats=_no_stats)

    actuators = Actuators(build, on_fp8=lambda _on: None)
    actuators.set_kind("sglang")
    why = actuators.unavailable()
    assert "no way to stop admitting" in why["kv_fp8"]
    assert "SGLang's pause freezes them in place" in why["kv_fp8"]
    assert why["revert_kv_fp8"] == why["kv_fp8"]
    assert not actuators.launch(Action("kv_fp8", "sustained pressure"))
    assert not actuators.launch(Action("revert_kv_fp8", "calm"))
    await asyncio.sleep(0.05)
    assert not actuators.switch_busy
    assert restarter.applied == []
    assert asked == []  # no /pause_generation, nothing at all
    await actuators.close()

    proxy = AdmissionProxy(ProxySettings(upstream=url), Mitigations())

    def build_with_proxy(kind: str) -> tuple[EngineAdmin, Reconfigurer]:
        drain = ProxyDrain(proxy, proxy.mitigations)
        admin = EngineAdmin(url, kind, backoff_s=0.01)
        return admin, Reconfigurer(restarter, drain, engine_stats=_no_stats)

    with_proxy = Actuators(build_with_proxy, on_fp8=lambda _on: None, proxy_in_path=True)
    with_proxy.set_kind("sglang")
    assert "kv_fp8" not in with_proxy.unavailable()
    await with_proxy.close()


# ---------------------------------------------------------------------- SGLang, proxy
DRAIN_TIMEOUT_S = 1.5


@pytest.fixture
async def sglang_behind_the_proxy() -> AsyncIterator[Rig]:
    """A supervised simulated SGLang (a child process), a probe on it, the proxy in front."""
    async with supervised_rig("sglang") as rig:
        await rig.healthy()
        yield rig


async def test_with_the_proxy_an_sglang_drain_ends(sglang_behind_the_proxy):
    """Stop admitting, wait for the running set, cut the rest at drain_timeout_s, restart.

    Two answers stream when the switch starts: a short one finishes whole within the
    drain, a long one is cut at the timeout with the drain error. Meanwhile a new
    request, critical too, gets 503. The switch ends (it does not hang on a frozen
    engine): SGLang is restarted with ``--kv-cache-dtype fp8_e5m2`` and admitted again.
    """
    rig = sglang_behind_the_proxy
    supervisor, probe, proxy, proxy_url = rig.supervisor, rig.probe, rig.proxy, rig.proxy_url
    assert probe.kind == "sglang"
    reconfigurer = rig.switch("sglang", drain_timeout_s=DRAIN_TIMEOUT_S, start_timeout_s=30)
    async with aiohttp.ClientSession() as http:
        short = asyncio.ensure_future(http.post(f"{proxy_url}/v1/completions", json=streamed(20)))
        long = asyncio.ensure_future(http.post(f"{proxy_url}/v1/completions", json=streamed(1500)))
        await until(lambda: len(proxy.inflight) == 2)
        started = time.monotonic()
        switch = asyncio.ensure_future(reconfigurer.switch(fp8=True))
        await until(lambda: proxy.mitigations.draining)
        async with http.post(
            f"{proxy_url}/v1/completions", json=streamed(5), headers={"X-Priority": "critical"}
        ) as refused:
            assert refused.status == 503
            assert (await refused.json())["error"]["code"] == "kv_cache_reconfigure"
        async with await short as answer:
            assert answer.status == 200
            assert (await answer.text()).rstrip().endswith("data: [DONE]")  # whole
        async with await long as answer:
            body = await answer.text()
        result = await asyncio.wait_for(switch, 60)
        took = time.monotonic() - started
    assert result.result == "succeeded", result.detail
    assert result.cancelled == 1
    assert DRAIN_TIMEOUT_S <= result.drain_s < DRAIN_TIMEOUT_S + 1.0
    assert took < DRAIN_TIMEOUT_S + 30
    error = json.loads(body.strip().splitlines()[-1].removeprefix("data: "))["error"]
    assert error["code"] == "kv_cache_reconfigure"
    assert "drain timeout" in error["message"]
    assert proxy.counters.cancelled["drain"] == 1
    assert not proxy.mitigations.draining  # admitting again
    argv = supervisor.argv
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8_e5m2"
    assert supervisor.restarts == {"reconfigure": 1}
