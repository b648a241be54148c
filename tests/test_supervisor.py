"""Supervisor mode: the engine as kvguard's child — started, watched, restarted, stopped."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import psutil
import pytest

from kvguard.actuators.supervisor import Supervisor
from kvguard.config.settings import parse_config
from kvguard.core.policy import Action
from kvguard.errors import KvguardError
from kvguard.probes.engine import EngineProbe
from kvguard.runtime.assembly import Guard, build_guard
from kvguard.runtime.probing import Probes
from tests.helpers import free_port, until


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


CRASH_ONCE = """
import pathlib, sys, time
marker = pathlib.Path(sys.argv[1])
if not marker.exists():
    marker.write_text("crashed")
    print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", flush=True)
    print("RuntimeError: CUDA error: out of memory (rank 1)", flush=True)  # same OOM, again
    sys.exit(1)
print("engine up", flush=True)
time.sleep(60)
"""


async def test_a_crashed_engine_is_restarted_and_an_oom_is_counted(tmp_path: Path):
    """An exit kvguard did not ask for restarts the engine; an OOM line marks it reason oom."""
    sleeps: list[float] = []

    async def no_sleep(seconds: float) -> None:
        sleeps.append(seconds)

    events: list[tuple[str, dict]] = []
    output = io.StringIO()
    supervisor = Supervisor(
        [sys.executable, "-c", CRASH_ONCE, str(tmp_path / "marker")],
        sleep=no_sleep,
        on_event=lambda event, fields: events.append((event, fields)),
        output=output,
    )
    await supervisor.start()
    try:
        await until(lambda: "engine up" in output.getvalue())
        assert supervisor.restarts["oom"] == 1
        assert supervisor.ooms == 1  # two lines, one OOM
        assert supervisor.last_exit_code == 1
        assert sleeps == [1.0]  # the first backoff
        assert supervisor.running
        assert [e for e, _ in events] == ["engine_oom", "engine_restarted"]
        assert events[1][1]["reason"] == "oom"
        assert "CUDA out of memory" in output.getvalue()  # the engine's output passes through
        pid = supervisor.pid
    finally:
        await supervisor.stop()
    assert pid is not None
    assert not _alive(pid)


async def test_stop_terminates_and_kills_an_engine_that_ignores_sigterm():
    """SIGTERM first; an engine that ignores it is killed after stop_timeout_s."""
    ignore = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        " print('ready', flush=True); time.sleep(60)"
    )
    output = io.StringIO()
    supervisor = Supervisor([sys.executable, "-c", ignore], stop_timeout_s=0.5, output=output)
    await supervisor.start()
    await until(lambda: "ready" in output.getvalue())
    pid = supervisor.pid
    await supervisor.stop()
    assert pid is not None
    assert not _alive(pid)
    assert supervisor.last_exit_code == -9
    assert not supervisor.restarts  # kvguard stopped it: not a crash


async def test_restart_replaces_the_command_without_counting_a_crash():
    """A reconfigure restart is counted as such, and the watch goes on with the new command."""
    output = io.StringIO()
    script = "import sys, time; print('up', sys.argv[1], flush=True); time.sleep(60)"
    supervisor = Supervisor([sys.executable, "-c", script, "one"], output=output)
    await supervisor.start()
    try:
        await until(lambda: "up one" in output.getvalue())
        first = supervisor.pid
        await supervisor.restart([sys.executable, "-c", script, "two"])
        await until(lambda: "up two" in output.getvalue())
        assert supervisor.pid != first
        assert first is not None
        assert not _alive(first)
        assert supervisor.restarts == {"reconfigure": 1}
    finally:
        await supervisor.stop()


async def test_a_command_that_cannot_start_is_one_clear_error():
    """A missing program is a KvguardError naming it, not a traceback."""
    supervisor = Supervisor(["/nonexistent/engine-binary", "--serve"])
    with pytest.raises(KvguardError, match="cannot start the engine '/nonexistent/engine-binary'"):
        await supervisor.start()


def test_an_empty_command_is_refused():
    """`kvguard run --` with nothing after it says what to give."""
    with pytest.raises(KvguardError, match="after `--`"):
        Supervisor([])


async def test_the_daemon_watches_the_process_it_supervises(sim_engine):
    """Supervisor mode: the host probe follows the engine's PID (RSS, CPU) across restarts."""
    from kvguard.config.settings import parse_config  # noqa: PLC0415
    from kvguard.probes.engine import EngineProbe  # noqa: PLC0415
    from kvguard.probes.host import HostProbe  # noqa: PLC0415
    from kvguard.runtime.daemon import Daemon  # noqa: PLC0415
    from kvguard.runtime.probing import Probes  # noqa: PLC0415

    url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048)
    config = parse_config({"engine": {"url": url}}, env={})
    daemon = Daemon(config, probes=Probes(EngineProbe(url), nvml=None, host=HostProbe()))
    output = io.StringIO()
    script = "import time; print('up', flush=True); time.sleep(60)"
    daemon.supervisor = Supervisor([sys.executable, "-c", script], output=output)
    await daemon.supervisor.start()
    try:
        await until(lambda: "up" in output.getvalue())
        snapshot = await daemon.tick()
        assert snapshot.host is not None
        assert snapshot.host.engine_pid == daemon.supervisor.pid
        assert snapshot.host.engine_resident_bytes
        await daemon.supervisor.restart([sys.executable, "-c", script])
        snapshot = await daemon.tick()
        assert snapshot.host is not None
        assert snapshot.host.engine_pid == daemon.supervisor.pid
    finally:
        await daemon.supervisor.stop()
        await daemon.close()


SLEEPER = "import sys, time; print(sys.argv[1], flush=True); time.sleep(60)"


async def test_a_reconfigure_during_a_crash_restart_leaves_one_engine(tmp_path: Path):
    """The crash restart's spawn is in flight when a reconfigure restart comes.

    The reconfigure waits for it, then replaces it: one engine runs, with the new
    command, and the crash restart's engine is stopped rather than left beside it.
    """
    woken = asyncio.Event()
    backoff = asyncio.Event()

    async def held_sleep(_seconds: float) -> None:
        woken.set()
        await backoff.wait()

    output = io.StringIO()
    marker = str(tmp_path / "marker")
    supervisor = Supervisor(
        [sys.executable, "-c", CRASH_ONCE, marker], sleep=held_sleep, output=output
    )
    await supervisor.start()
    try:
        await asyncio.wait_for(woken.wait(), 10)  # it crashed; the backoff holds
        backoff.set()
        await asyncio.sleep(0)  # the crash restart wakes and starts spawning...
        await supervisor.restart([sys.executable, "-c", SLEEPER, "reconfigured"])  # ...then this
        await until(lambda: "reconfigured" in output.getvalue())
        # No engine with the crashed command is left (the crash restart's was stopped).
        await until(lambda: not _running_with(marker))
        assert supervisor.running
        assert supervisor.argv[-1] == "reconfigured"
    finally:
        await supervisor.stop()


def _running_with(argument: str) -> list[int]:
    """PIDs of live (not zombie) processes with ``argument`` on their command line."""
    return [
        p.pid
        for p in psutil.process_iter(["cmdline", "status"])
        if argument in (p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE
    ]


# ---------------------------------------------------------------------- Retry-After
SIM_ENGINE = [sys.executable, "-m", "kvguard.cli.main", "sim-engine"]


@contextlib.asynccontextmanager
async def supervised_behind_the_proxy(**reconfigure: float) -> AsyncIterator[Guard]:
    """A kvguard in supervisor mode: a simulated vLLM as its child, its proxy on 127.0.0.1."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = parse_config(
        {
            "engine": {"url": url, "kind": "vllm"},
            "proxy": {"enabled": True},
            "reconfigure": {"crash_backoff_s": 1.0, **reconfigure},
        },
        env={},
    )
    command = [*SIM_ENGINE, "--port", str(port), "--kv-capacity-tokens", "4096"]
    command += ["--max-model-len", "2048"]
    guard = build_guard(
        config,
        engine_command=command,
        probes=Probes(EngineProbe(url), nvml=None, host=None),
        serve_api=False,
    )
    await guard.start(proxy_listen="127.0.0.1:0")
    try:
        assert guard.proxy_url is not None
        await until(
            lambda: _status(guard, "GET", "/v1/models", 200), timeout_s=30, what="the engine is up"
        )
        yield guard
    finally:
        await guard.close()


async def _answer(guard: Guard, method: str, path: str) -> tuple[int, str | None]:
    """One request through the proxy: its status and its Retry-After."""
    body = {"prompt": "hi", "max_tokens": 2} if method == "POST" else None
    async with (
        aiohttp.ClientSession(trust_env=False) as http,
        http.request(method, f"{guard.proxy_url}{path}", json=body) as resp,
    ):
        await resp.read()
        return resp.status, resp.headers.get("Retry-After")


async def _status(guard: Guard, method: str, path: str, status: int) -> bool:
    return (await _answer(guard, method, path))[0] == status


async def _answers_until_back(guard: Guard) -> list[tuple[int, str | None]]:
    """Requests through the proxy every 20 ms until the engine answers 200 again."""
    seen: list[tuple[int, str | None]] = []
    async with asyncio.timeout(60):
        while not seen or seen[-1][0] != 200 or not any(s >= 500 for s, _ in seen):
            seen.append(await _answer(guard, "GET", "/v1/models"))
            seen.append(await _answer(guard, "POST", "/v1/completions"))
            await asyncio.sleep(0.02)
    return seen


async def test_requests_while_a_crashed_engine_restarts_get_retry_after():
    """SIGKILL the supervised engine: every 502/503 until it is back carries Retry-After.

    From the moment the supervisor sees the exit: at least the backoff (1 s here),
    never under 5 s. Once the engine answers healthy the mark is lifted: a 502 with no
    restart under way has no Retry-After.
    """
    async with supervised_behind_the_proxy() as guard:
        supervisor, mitigations = guard.daemon.supervisor, guard.daemon.mitigations
        assert supervisor is not None
        assert supervisor.pid is not None
        os.kill(supervisor.pid, signal.SIGKILL)
        # From the moment the supervisor sees the exit (before it, kvguard cannot know).
        await until(lambda: mitigations.restart_retry_after_s is not None, what="the crash seen")
        seen = await _answers_until_back(guard)
        errors = [(status, after) for status, after in seen if status >= 500]
        assert errors, seen
        assert {status for status, _ in errors} <= {502, 503}
        assert all(after == "5" for _, after in errors), errors
        await until(lambda: mitigations.restart_retry_after_s is None, what="the mark lifted")
        assert supervisor.restarts["crash"] == 1

        await supervisor.stop()  # gone for good, not restarting: a plain 502
        assert await _answer(guard, "GET", "/v1/models") == (502, None)


async def test_requests_while_the_fp8_switch_restarts_the_engine_get_retry_after():
    """The fp8 switch restarts the supervised engine: its 502s carry Retry-After too.

    The drain's own 503s (generation requests) already did; the rest of the traffic
    (here /v1/models) reaches a stopped engine, and now says when to come back.
    """
    async with supervised_behind_the_proxy(start_timeout_s=30.0, drain_timeout_s=5.0) as guard:
        actuators, mitigations = guard.daemon.actuators, guard.daemon.mitigations
        assert actuators is not None
        actuators.set_kind("vllm")
        assert actuators.launch(Action("kv_fp8", "test"))
        seen = await _answers_until_back(guard)
        await asyncio.gather(*actuators._tasks.values())
        assert actuators.results[("kv_fp8", "succeeded")] == 1
        errors = [(status, after) for status, after in seen if status >= 500]
        assert 502 in {status for status, _ in errors}, seen  # the engine was down a while
        assert all(after is not None for _, after in errors), errors
        assert {after for status, after in errors if status == 502} == {"30"}  # start_timeout_s
        assert mitigations.restart_retry_after_s is None
