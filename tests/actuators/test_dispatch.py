"""The daemon's asynchronous actuators against real simulated engines on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from structlog.testing import capture_logs

from kvguard.actuators.dispatch import KIND_NOT_KNOWN, Actuators
from kvguard.actuators.engine_admin import EngineAdmin
from kvguard.actuators.state import EnginePauseRecord, StateFile
from kvguard.api.status import status_document
from kvguard.config.settings import parse_config
from kvguard.core.policy import Action
from kvguard.probes.engine import EngineProbe
from kvguard.runtime.assembly import build_guard
from kvguard.runtime.decision import Brain
from kvguard.runtime.probing import Probes
from kvguard.sim.runner import PoolSpec, size_pool, start_sim_server
from tests.helpers import free_port


async def _settle(actuators: Actuators) -> None:
    """Wait for the background actions to end."""
    await asyncio.gather(*actuators._tasks.values())


def _actuators(url: str, **options) -> Actuators:
    return Actuators(
        lambda kind: (EngineAdmin(url, kind, backoff_s=0.01), None),
        on_fp8=lambda _on: None,
        **options,
    )


async def test_evict_runs_in_the_background_and_its_result_is_counted(sim_engine):
    """Evict on an idle vLLM succeeds; one at a time; the ladder learns nothing is missing."""
    url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048)
    actuators = _actuators(url)
    assert "evict" in actuators.unavailable()  # the kind is not known yet
    actuators.set_kind("vllm")
    assert "evict" not in actuators.unavailable()
    assert actuators.launch(Action("evict", "test"))
    assert not actuators.launch(Action("evict", "test"))  # one already running
    await _settle(actuators)
    assert actuators.results[("evict", "succeeded")] == 1
    await actuators.close()


async def test_without_dev_mode_evict_fails_once_then_falls_through(sim_engine):
    """Without VLLM_SERVER_DEV_MODE on vLLM: one failed attempt, then unavailable with why."""
    url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048, dev_endpoints=False)
    actuators = _actuators(url)
    actuators.set_kind("vllm")
    assert actuators.launch(Action("evict", "test"))
    await _settle(actuators)
    assert actuators.results[("evict", "failed")] == 1
    why = actuators.unavailable()["evict"]
    assert "VLLM_SERVER_DEV_MODE=1" in why
    assert not actuators.launch(Action("evict", "test"))
    await actuators.close()


async def test_shed_by_pause_pauses_and_release_resumes(sim_engine):
    """Without the proxy, a critical shed pauses the engine; release and exit resume it."""
    url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048)
    actuators = _actuators(url, shed_by_pause=True)
    actuators.set_kind("vllm")

    async def paused() -> bool:
        async with aiohttp.ClientSession() as http, http.get(f"{url}/is_paused") as resp:
            return bool((await resp.json())["is_paused"])

    assert not actuators.launch(Action("shed", "test", priority="sheddable"))  # not at critical
    assert actuators.launch(Action("shed", "test", priority="standard"))
    await _settle(actuators)
    assert actuators.paused
    assert await paused()
    assert actuators.launch(Action("release", "test", target="shed"))
    await _settle(actuators)
    assert not await paused()
    assert actuators.launch(Action("shed", "test", priority="standard"))
    await _settle(actuators)
    # Down from critical to high: the floor becomes sheddable, and the pause ends.
    assert actuators.launch(Action("shed", "test", priority="sheddable"))
    await _settle(actuators)
    assert not await paused()
    assert actuators.launch(Action("shed", "test", priority="standard"))
    await _settle(actuators)
    await actuators.close()  # never leave the engine paused
    assert not await paused()
    assert not actuators.paused


class SlowPauseEngine:
    """vLLM's pause endpoints on 127.0.0.1, taking a pause only ``pause_s`` after it arrives.

    Like a pause held up on its way (a busy engine loop, a proxy): a resume sent
    meanwhile on another connection would be taken first, and the pause would stick.
    """

    def __init__(self, pause_s: float, pause_status: int = 200) -> None:
        self.pause_s = pause_s
        self.pause_status = pause_status  # 500: it pauses, then answers an error
        self.paused = False
        self.calls: list[str] = []
        self.pause_arrived = asyncio.Event()
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/pause", self._pause)
        app.router.add_post("/resume", self._resume)
        app.router.add_get("/is_paused", self._is_paused)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _pause(self, _request: web.Request) -> web.Response:
        self.calls.append("pause")
        self.pause_arrived.set()
        await asyncio.sleep(self.pause_s)
        self.paused = True
        return web.json_response({}, status=self.pause_status)

    async def _resume(self, _request: web.Request) -> web.Response:
        self.calls.append("resume")
        self.paused = False
        return web.json_response({})

    async def _is_paused(self, _request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.paused})


async def _slow_pause_engine() -> SlowPauseEngine:
    engine = SlowPauseEngine(pause_s=0.3)
    await engine.start()
    return engine


async def _until_pause_sent(engine: SlowPauseEngine) -> None:
    await asyncio.wait_for(engine.pause_arrived.wait(), 5)


async def test_a_release_during_a_slow_pause_leaves_the_engine_resumed():
    """A release while the pause is out is sent after the pause answers: the engine ends resumed."""
    engine = await _slow_pause_engine()
    actuators = _actuators(engine.url, shed_by_pause=True)
    actuators.set_kind("vllm")
    try:
        assert actuators.launch(Action("shed", "test", priority="standard"))
        await _until_pause_sent(engine)
        assert actuators.launch(Action("release", "test", target="shed"))
        assert not actuators.launch(Action("release", "test", target="shed"))  # already asked
        await _settle(actuators)
        assert engine.calls == ["pause", "resume"]
        assert not engine.paused
        assert not actuators.paused
        assert actuators.results[("pause", "succeeded")] == 1
        assert actuators.results[("resume", "succeeded")] == 1
    finally:
        await actuators.close()
        await engine.stop()


async def test_the_last_wish_wins_and_a_flip_back_costs_no_call():
    """Release, then shed again, while the pause is out: no resume is sent; it stays paused."""
    engine = await _slow_pause_engine()
    actuators = _actuators(engine.url, shed_by_pause=True)
    actuators.set_kind("vllm")
    try:
        assert actuators.launch(Action("shed", "test", priority="standard"))
        await _until_pause_sent(engine)
        assert actuators.launch(Action("release", "test", target="shed"))
        assert actuators.launch(Action("shed", "test", priority="standard"))
        await _settle(actuators)
        assert engine.calls == ["pause"]
        assert engine.paused
        assert actuators.paused
    finally:
        await actuators.close()  # resumes: kvguard never leaves the engine paused
        await engine.stop()
    assert engine.calls == ["pause", "resume"]


@contextlib.asynccontextmanager
async def shed_by_pausing(pause_status: int) -> AsyncIterator[tuple[SlowPauseEngine, Actuators]]:
    """An engine answering pauses with ``pause_status``, already asked to pause once."""
    engine = SlowPauseEngine(pause_s=0.0, pause_status=pause_status)
    await engine.start()
    actuators = _actuators(engine.url, shed_by_pause=True)
    actuators.set_kind("vllm")
    try:
        assert actuators.launch(Action("shed", "test", priority="standard"))
        await _settle(actuators)
        yield engine, actuators
    finally:
        await actuators.close()
        await engine.stop()


async def test_a_pause_that_failed_after_it_acted_is_still_resumed_on_release():
    """The engine paused, then answered 500: the pause counts as failed, yet a release resumes."""
    async with shed_by_pausing(500) as (engine, actuators):
        assert actuators.results[("pause", "failed")] == 1
        assert not actuators.paused  # not known to be paused: /metrics says 0
        assert engine.paused  # ... but it is
        assert actuators.launch(Action("release", "test", target="shed"))
        await _settle(actuators)
        assert not engine.paused
        assert engine.calls[-1] == "resume"
        assert not actuators.launch(Action("release", "test", target="shed"))  # resumed: done


@pytest.mark.parametrize("status", [404, 400], ids=["no-endpoint", "refused"])
async def test_a_pause_refused_outright_owes_no_resume(status):
    """No pause endpoint (404), or a pause refused (400): never paused, a release sends nothing."""
    async with shed_by_pausing(status) as (engine, actuators):
        assert not actuators.launch(Action("release", "test", target="shed"))
        assert engine.calls == ["pause"]


async def test_the_proxy_in_the_path_means_no_engine_pause(sim_engine):
    """With the proxy, shedding is the proxy's: the engine is never paused for it."""
    url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048)
    actuators = _actuators(url, shed_by_pause=True, proxy_in_path=True)
    actuators.set_kind("vllm")
    assert not actuators.launch(Action("shed", "test", priority="standard"))
    await actuators.close()


async def _paused(url: str) -> bool:
    """The simulated vLLM's own answer to GET /is_paused."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/is_paused") as resp:
        return bool((await resp.json())["is_paused"])


async def test_a_pause_kvguard_cannot_record_is_refused_and_status_says_why(sim_engine, tmp_path):
    """An unwritable state file: the engine-side shed fails with the reason; the proxy's shed stays.

    The engine is never paused (a kvguard killed now would leave nothing paused), the
    ladder logs ``action_unavailable`` for ``engine_pause`` and /status lists it.
    """
    url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048)
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the state folder should be: every write fails
    state = StateFile(blocker / "state" / "state.json")
    config = parse_config({"engine": {"url": url, "kind": "vllm", "shed_by_pause": True}}, env={})
    guard = build_guard(
        config, probes=Probes(EngineProbe(url), nvml=None, host=None), serve_api=False, state=state
    )
    daemon, actuators = guard.daemon, guard.daemon.actuators
    assert actuators is not None
    try:
        await daemon.tick()  # the kind is known: the admin client exists
        await _settle(actuators)
        outcomes = daemon.mitigations.apply(
            [Action("shed", "critical", priority="standard")], "critical", 5
        )
        assert [outcome for _, outcome in outcomes] == ["applied"]
        await _settle(actuators)
        assert actuators.results[("pause", "failed")] == 1
        assert not actuators.paused
        assert not await _paused(url)
        why = actuators.unavailable()["engine_pause"]
        assert f"cannot write {blocker}" in why
        assert "KVGUARD_STATE_DIR" in why
        with capture_logs() as logs:
            await daemon.tick()
        said = [e for e in logs if e["event"] == "action_unavailable"]
        assert [e["action"] for e in said if e["action"] == "engine_pause"] == ["engine_pause"]
        assert status_document(daemon)["actions"]["unavailable"]["engine_pause"] == why
        assert daemon.mitigations.sheds("standard")  # the proxy's own shed is in force

        # Writable again: the next shed pauses, and the refusal is no longer listed.
        blocker.unlink()
        record = EnginePauseRecord(state, url)
        assert actuators.launch(Action("release", "calm", target="shed")) is False
        assert actuators.launch(Action("shed", "critical", priority="standard"))
        await _settle(actuators)
        assert await _paused(url)
        assert record.paused
        assert "engine_pause" not in actuators.unavailable()
    finally:
        await actuators.close()
        await daemon.close()
    assert not await _paused(url)


async def test_an_engine_paused_by_someone_else_is_reported_and_left_paused(sim_engine, tmp_path):
    """Paused at start with no record of kvguard pausing it: said once, never resumed by kvguard.

    Not even at exit: the pause belongs to whoever made it (an operator, a training job
    updating weights).
    """
    url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048)
    async with aiohttp.ClientSession() as http, http.post(f"{url}/pause?mode=keep") as resp:
        assert resp.status == 200
    record = EnginePauseRecord(StateFile(tmp_path / "state.json"), url)
    actuators = _actuators(url, pause_record=record)
    with capture_logs() as logs:
        actuators.set_kind("vllm")
        await _settle(actuators)
    said = [e for e in logs if e["event"] == "engine_paused_at_start"]
    assert len(said) == 1
    assert said[0]["engine"] == url
    assert said[0]["resumed"] is False
    assert said[0]["log_level"] == "warning"
    assert actuators.paused_elsewhere
    assert not actuators.paused  # not kvguard's: kvguard_engine_paused stays 0
    assert actuators.results[("resume", "succeeded")] == 0
    assert not actuators.launch(Action("release", "calm", target="shed"))  # nothing of ours
    await actuators.close()
    assert await _paused(url)


async def test_a_shed_asked_for_during_the_start_check_is_carried_out(sim_engine):
    """The start check and the pauses share one task: a shed meanwhile is sent after it."""
    url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048)
    actuators = _actuators(url, shed_by_pause=True)
    actuators.set_kind("vllm")  # the check is under way
    assert actuators.launch(Action("shed", "critical", priority="standard"))
    await _settle(actuators)
    assert actuators.paused
    assert not actuators.paused_elsewhere  # its own pause came after the check
    assert await _paused(url)
    await actuators.close()
    assert not await _paused(url)


async def test_the_daemon_sends_level_changes_and_actions_to_webhooks(sim_server):
    """A tick that enters a level reaches a real webhook receiver, with its reasons."""
    events: list[dict] = []

    async def receive(request: web.Request) -> web.Response:
        events.append(json.loads(await request.read()))
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/hook", receive)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    server = await sim_server(kv_capacity_tokens=4096, max_model_len=2048, per_token_s=0.001)
    config = parse_config(
        {
            "engine": {"url": server.url, "kind": "vllm"},
            # Any use of the cache is pressure here, so one request changes the level.
            "policy": {"confirm_ticks": 1, "elevated": {"kv_usage": 0.001}},
            "webhook": {"urls": [f"http://127.0.0.1:{port}/hook"]},
        },
        env={},
    )
    guard = build_guard(
        config, probes=Probes(EngineProbe(server.url), nvml=None, host=None), serve_api=False
    )
    await guard.start()  # the webhooks
    daemon, actuators = guard.daemon, guard.daemon.actuators
    assert daemon.webhooks is not None
    assert actuators is not None
    try:
        async with aiohttp.ClientSession() as http:
            request = asyncio.ensure_future(
                http.post(
                    f"{server.url}/v1/completions",
                    json={"prompt": "word " * 200, "max_tokens": 400},
                )
            )
            for _ in range(200):
                await daemon.tick()
                if daemon.brain.decision and daemon.brain.decision.level != "ok":
                    break
                await asyncio.sleep(0.01)
            (await request).close()
        await daemon.webhooks.close()
    finally:
        await actuators.close()
        await daemon.close()
        await runner.cleanup()
    changes = [e for e in events if e["event"] == "level_changed"]
    assert changes, events
    assert changes[0]["previous"] == "ok"
    assert changes[0]["level"] == "elevated"
    assert any("kv_usage" in reason for reason in changes[0]["crossed"])
    assert actuators.kind == "vllm"
    # No restart mode: the fp8 switch is unavailable, and the ladder says why.
    assert "[reconfigure] mode" in daemon.brain.unavailable["kv_fp8"]


async def test_an_opt_in_left_off_is_said_at_info_not_warned(sim_engine):
    """A default start (no restart configured): the fp8 switch's absence is info, not a warning."""
    url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048)
    config = parse_config({"engine": {"url": url, "kind": "vllm"}}, env={})
    guard = build_guard(
        config, probes=Probes(EngineProbe(url), nvml=None, host=None), serve_api=False
    )
    daemon, actuators = guard.daemon, guard.daemon.actuators
    assert actuators is not None
    try:
        with capture_logs() as logs:
            await daemon.tick()
            await daemon.tick()
    finally:
        await actuators.close()
        await daemon.close()
    said = {e["action"]: e["log_level"] for e in logs if e["event"] == "action_unavailable"}
    assert said.get("kv_fp8") == "info"
    assert said.get("revert_kv_fp8") == "info"
    assert not [e for e in logs if e["log_level"] == "warning"], logs


async def test_nothing_is_said_unavailable_before_the_engine_answers():
    """An engine still starting (``kvguard run -- <command>``): its actions are not said missing.

    Before the engine's first reading its kind is unknown, so neither the admin client
    nor the fp8 switch is built: the actions are left off the ladder for now, but the
    log must not say "no way to restart the engine" of an engine kvguard can restart.
    """
    port = free_port()
    config = parse_config(
        {
            "engine": {"url": f"http://127.0.0.1:{port}"},
            "reconfigure": {"mode": "command", "command": ["/bin/true"]},
        },
        env={},
    )
    guard = build_guard(
        config,
        probes=Probes(EngineProbe(config.engine.url, timeout_s=0.5), nvml=None, host=None),
        serve_api=False,
    )
    daemon, actuators = guard.daemon, guard.daemon.actuators
    assert actuators is not None
    server = None
    try:
        with capture_logs() as starting:
            await daemon.tick()  # nothing listens yet
        assert set(daemon.brain.unavailable) == {"evict", "kv_fp8", "revert_kv_fp8"}
        assert set(daemon.brain.unavailable.values()) == {KIND_NOT_KNOWN}
        assert not [e for e in starting if e["event"].startswith("action_")], starting
        # The engine answers now.
        server = await start_sim_server(
            size_pool(PoolSpec(kv_capacity_tokens=4096, max_model_len=2048)),
            port=port,
        )
        with capture_logs() as answering:
            await daemon.tick()
            await daemon.tick()
    finally:
        await actuators.close()
        await daemon.close()
        if server is not None:
            await server.stop()
    # Evict is found out by calling it (engine_admin_unavailable); the command restarts
    # the engine for the fp8 switch: nothing is missing, and nothing was said missing.
    assert daemon.brain.unavailable == {}
    assert not [e for e in answering if e["event"].startswith("action_")], answering


def test_an_action_said_unavailable_is_said_available_again():
    """The log is not left saying an action is missing once it is back (e.g. after a reload)."""
    brain = Brain(parse_config({"engine": {"url": "http://127.0.0.1:9"}}, env={}))
    with capture_logs() as logs:
        brain.unavailable = {"evict": "vllm offers no cache eviction kvguard can call"}
        brain._policy()
        brain._policy()  # said once
        brain.unavailable = {}
        brain._policy()
    assert [(e["event"], e["action"]) for e in logs] == [
        ("action_unavailable", "evict"),
        ("action_available", "evict"),
    ]
