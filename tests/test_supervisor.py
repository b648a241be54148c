"""Supervisor mode: the engine as kvguard's child — started, watched, restarted, stopped."""

from __future__ import annotations

import asyncio
import io
import os
import sys
from pathlib import Path

import psutil
import pytest

from kvguard.actuators.supervisor import Supervisor
from kvguard.errors import KvguardError
from tests.helpers import until


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
