"""kvguard's own faults: SIGKILL while the engine is paused, SIGTERM mid-drain, a stalled loop.

Real processes and a simulated vLLM on 127.0.0.1. SIGHUP with a bad config (the old
config is kept) is tested in tests/test_run.py; docs/reliability.md lists where each
fault of the matrix is tested.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import aiohttp
import pytest
from structlog.testing import capture_logs

from kvguard.actuators.dispatch import Actuators
from kvguard.actuators.drain import EnginePauseDrain
from kvguard.actuators.engine_admin import EngineAdmin
from kvguard.actuators.reconfigure import Reconfigurer, ReconfigureTimes
from kvguard.actuators.state import LOCK_FILE_NAME, EnginePauseRecord, StateFile, state_dir
from kvguard.api.telemetry import daemon_registry
from kvguard.config.settings import parse_config
from kvguard.core.policy import Action
from kvguard.core.snapshot import EngineStats
from kvguard.errors import InvalidInputError
from kvguard.probes.engine import EngineProbe
from kvguard.runtime.assembly import Guard
from kvguard.runtime.daemon import Daemon
from kvguard.runtime.probing import Probes
from tests.helpers import free_port, strict_json, until

KVGUARD = str(Path(sys.executable).parent / "kvguard")


async def is_paused(url: str) -> bool:
    """The simulated vLLM's own answer to GET /is_paused."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/is_paused") as resp:
        return bool((await resp.json())["is_paused"])


async def read_events(proc: asyncio.subprocess.Process, until: str, timeout: float = 20) -> list:
    """JSON log events from the process's stderr, up to the first ``until`` event."""
    assert proc.stderr is not None
    events: list[dict] = []
    async with asyncio.timeout(timeout):
        while True:
            line = await proc.stderr.readline()
            assert line, f"process exited before {until!r}: {events}"
            if not line.startswith(b"{"):
                continue  # a supervised engine's own output
            events.append(strict_json(line))
            if events[-1]["event"] == until:
                return events


# ---------------------------------------------------------------------- the state file
def test_state_dir_follows_the_documented_order(tmp_path):
    """KVGUARD_STATE_DIR, then systemd's STATE_DIRECTORY (first entry), then XDG, then ~."""
    assert state_dir({"KVGUARD_STATE_DIR": "/a", "STATE_DIRECTORY": "/b"}) == Path("/a")
    assert state_dir({"STATE_DIRECTORY": "/var/lib/kvguard:/var/lib/x"}) == Path("/var/lib/kvguard")
    assert state_dir({"XDG_STATE_HOME": "/x"}) == Path("/x/kvguard")
    assert state_dir({"HOME": str(tmp_path)}) == tmp_path / ".local/state/kvguard"


def test_state_writes_are_whole_and_a_bad_file_is_ignored_with_a_reason(tmp_path):
    """Atomic writes leave no temporary file; corrupt or foreign files read as empty, logged."""
    state = StateFile(tmp_path / "state" / "state.json", wall_clock=lambda: 1234.5)
    record = EnginePauseRecord(state, "http://127.0.0.1:8000")
    assert not record.paused
    record.mark(True)
    assert record.paused
    assert json.loads(state.path.read_text()) == {
        "version": 1,
        "engines": {"http://127.0.0.1:8000": {"paused": True, "since": 1234.5}},
    }
    assert not EnginePauseRecord(state, "http://127.0.0.1:9000").paused  # another engine
    record.mark(False)
    assert not record.paused
    assert sorted(p.name for p in state.path.parent.iterdir()) == [".state.lock", "state.json"]

    for junk in ("{not json", '{"version": 99}', "[]"):
        state.path.write_text(junk)
        with capture_logs() as logs:
            assert not record.paused
        assert [e["event"] for e in logs] == ["state_file_unreadable"]
        record.mark(True)  # a bad file is replaced, not a reason to refuse the pause
        assert record.paused


def test_a_state_write_that_fails_is_logged_not_raised_and_says_why(tmp_path):
    """An unwritable state directory: logged, and the record says the note is not on disk.

    A pause is then refused (the SIGKILL test below): it could not be undone by a
    successor.
    """
    blocker = tmp_path / "file"
    blocker.write_text("")
    state = StateFile(blocker / "state.json")  # its parent is a file: mkdir fails
    record = EnginePauseRecord(state, "http://127.0.0.1:8000")
    with capture_logs() as logs:
        assert record.mark(True) is False
    assert [e["event"] for e in logs] == ["state_file_unreadable", "state_file_write_failed"]
    assert record.write_error is not None
    assert record.write_error.startswith(f"cannot write {blocker / 'state.json'}: ")
    assert not record.paused
    blocker.unlink()
    assert record.mark(True) is True  # writable again: the note is written, the error gone
    assert record.write_error is None


MARKER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from kvguard.actuators.state import StateFile
    state, name = StateFile(Path(sys.argv[1])), sys.argv[2]
    for n in range(40):
        # What a write reported as done (a pause is sent only then), one per line.
        if state.set_engine_paused(f"http://127.0.0.1:{name}{n:02d}", True):
            print(f"http://127.0.0.1:{name}{n:02d}", flush=True)
    """
)


def test_two_kvguards_writing_the_state_file_at_once_lose_no_entry(tmp_path):
    """Two processes (one kvguard per engine) mark 40 engines each at once.

    Every note a write reported as done is kept. Idle, all 80 are done; on a loaded
    machine a writer that cannot have the lock in time reports failure (its pause is
    then not sent) rather than write unlocked over the other's note.
    """
    path = tmp_path / "state.json"
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", MARKER, str(path), name], stdout=subprocess.PIPE, text=True
        )
        for name in ("1", "2")
    ]
    outputs = [w.communicate(timeout=60)[0] for w in writers]
    assert [w.returncode for w in writers] == [0, 0]
    done = {line for out in outputs for line in out.splitlines()}
    engines = json.loads(path.read_text())["engines"]
    assert set(engines) == done
    assert len(done) >= 60  # most writes get the lock in time, even under load
    assert all(entry["paused"] is True for entry in engines.values())


def test_a_write_without_the_lock_fails_and_says_why(tmp_path):
    """A neighbour holding the lock past the wait: the write fails, nothing is written."""
    state = StateFile(tmp_path / "state.json")
    assert state.set_engine_paused("http://127.0.0.1:1", True)
    with (tmp_path / LOCK_FILE_NAME).open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another kvguard, stuck mid-write
        assert not state.set_engine_paused("http://127.0.0.1:2", True)
        assert state.write_error is not None
        assert LOCK_FILE_NAME in state.write_error
    assert json.loads((tmp_path / "state.json").read_text())["engines"].keys() == {
        "http://127.0.0.1:1"
    }


# ---------------------------------------------------------------------- SIGKILL
PAUSER = textwrap.dedent(
    """
    import asyncio, sys
    from kvguard.runtime.assembly import build_guard
    from kvguard.config.settings import parse_config
    from kvguard.runtime.daemon import Daemon
    from kvguard.runtime.probing import Probes
    from kvguard.core.policy import Action
    from kvguard.probes.engine import EngineProbe
    from kvguard.api.logs import configure_logging

    async def main(url):
        configure_logging("warning", "json")  # stderr: stdout says "paused" only
        config = parse_config({"engine": {"url": url, "shed_by_pause": True}}, env={})
        probes = Probes(engine=EngineProbe(url), nvml=None, host=None)
        daemon = build_guard(config, probes=probes, serve_api=False).daemon
        actuators = daemon.actuators  # the state file from $KVGUARD_STATE_DIR
        await daemon.tick()  # learns the engine's kind: the admin client is built
        assert actuators.launch(Action("shed", "critical", priority="standard"))
        while not actuators.paused or not all(t.done() for t in actuators._tasks.values()):
            await asyncio.sleep(0.01)
        print("paused", flush=True)
        await asyncio.sleep(60)  # killed here, holding the engine paused

    asyncio.run(main(sys.argv[1]))
    """
)


async def test_sigkill_while_the_engine_is_paused_is_undone_by_the_next_kvguard(
    sim_engine, tmp_path
):
    """A kvguard pauses the engine (engine-side shed) and is SIGKILLed.

    The engine stays paused; the next `kvguard run` finds the note in its state file and
    resumes it.
    """
    url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048)
    env = {**os.environ, "KVGUARD_STATE_DIR": str(tmp_path / "state")}
    pauser = await asyncio.create_subprocess_exec(
        sys.executable, "-c", PAUSER, url, env=env, stdout=asyncio.subprocess.PIPE
    )
    assert pauser.stdout is not None
    try:
        async with asyncio.timeout(20):
            assert await pauser.stdout.readline() == b"paused\n"
    finally:
        pauser.kill()  # SIGKILL: no shutdown code runs
        await pauser.wait()
    assert pauser.returncode == -signal.SIGKILL
    assert await is_paused(url)  # the outage a dead kvguard leaves behind
    state = StateFile(tmp_path / "state" / "state.json")
    assert state.engine_paused(url)

    config = tmp_path / "kvguard.toml"
    config.write_text(
        f'[engine]\nurl = "{url}"\n[server]\nlisten = "127.0.0.1:{free_port()}"\n'
        '[poll]\ninterval_s = 0.2\n[log]\nformat = "json"\n'
    )
    proc = await asyncio.create_subprocess_exec(
        KVGUARD, "run", "--config", str(config), env=env, stderr=asyncio.subprocess.PIPE
    )
    try:
        events = await read_events(proc, until="stale_pause_resumed")
        assert "stale_pause_found" in [e["event"] for e in events]
        assert not await is_paused(url)
        assert not state.engine_paused(url)  # the note is cleared once the resume worked
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0


UNRECORDED_PAUSER = textwrap.dedent(
    """
    import asyncio, json, sys
    from kvguard.runtime.assembly import build_guard
    from kvguard.config.settings import parse_config
    from kvguard.runtime.probing import Probes
    from kvguard.core.policy import Action
    from kvguard.probes.engine import EngineProbe
    from kvguard.api.logs import configure_logging

    async def main(url):
        configure_logging("warning", "json")
        config = parse_config({"engine": {"url": url, "shed_by_pause": True}}, env={})
        probes = Probes(engine=EngineProbe(url), nvml=None, host=None)
        daemon = build_guard(config, probes=probes, serve_api=False).daemon
        actuators = daemon.actuators  # the state file from $KVGUARD_STATE_DIR: unwritable
        await daemon.tick()
        while not all(t.done() for t in actuators._tasks.values()):
            await asyncio.sleep(0.01)  # the start check
        actuators.launch(Action("shed", "critical", priority="standard"))
        while not all(t.done() for t in actuators._tasks.values()):
            await asyncio.sleep(0.01)
        print(json.dumps({"paused": actuators.paused, **actuators.unavailable()}), flush=True)
        await asyncio.sleep(60)  # killed here

    asyncio.run(main(sys.argv[1]))
    """
)


async def test_sigkill_with_an_unwritable_state_dir_leaves_the_engine_serving(sim_engine, tmp_path):
    """KVGUARD_STATE_DIR cannot be written: kvguard refuses to pause, then is SIGKILLed.

    Before, it paused anyway (logging state_file_write_failed) and the next kvguard,
    finding no note, never resumed the engine. Now the pause is never sent, and says
    why; after the SIGKILL the engine serves, and the next kvguard finds nothing to undo.
    """
    url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048)
    blocker = tmp_path / "file"
    blocker.write_text("")  # root ignores permissions: a file where a folder must be
    env = {**os.environ, "KVGUARD_STATE_DIR": str(blocker / "state")}
    pauser = await asyncio.create_subprocess_exec(
        sys.executable, "-c", UNRECORDED_PAUSER, url, env=env, stdout=asyncio.subprocess.PIPE
    )
    assert pauser.stdout is not None
    try:
        async with asyncio.timeout(20):
            said = json.loads(await pauser.stdout.readline())
    finally:
        pauser.kill()  # SIGKILL: no shutdown code runs
        await pauser.wait()
    assert pauser.returncode == -signal.SIGKILL
    assert said["paused"] is False
    assert f"cannot write {blocker}" in said["engine_pause"]
    assert not await is_paused(url)  # nothing was left paused by the dead kvguard
    async with aiohttp.ClientSession() as http:
        body = {"prompt": "hello", "max_tokens": 4}
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200


async def test_kvguard_run_reports_an_engine_someone_else_paused_and_leaves_it(
    sim_engine, tmp_path
):
    """Paused, and no note says kvguard did it: `kvguard run` says so and does not resume it."""
    url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048)
    async with aiohttp.ClientSession() as http, http.post(f"{url}/pause?mode=keep") as resp:
        assert resp.status == 200
    config = tmp_path / "kvguard.toml"
    config.write_text(
        f'[engine]\nurl = "{url}"\n[server]\nlisten = "127.0.0.1:{free_port()}"\n'
        '[poll]\ninterval_s = 0.2\n[log]\nformat = "json"\n'
    )
    env = {**os.environ, "KVGUARD_STATE_DIR": str(tmp_path / "state")}
    proc = await asyncio.create_subprocess_exec(
        KVGUARD, "run", "--config", str(config), env=env, stderr=asyncio.subprocess.PIPE
    )
    try:
        said = (await read_events(proc, until="engine_paused_at_start"))[-1]
        assert said["engine"] == url
        assert said["resumed"] is False
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    assert await is_paused(url)  # not kvguard's pause, not kvguard's to end (at exit neither)


async def test_a_supervised_engine_does_not_outlive_a_sigkilled_kvguard(tmp_path):
    """Supervisor mode: SIGKILL kvguard and its engine gets SIGTERM from the kernel."""
    config = tmp_path / "kvguard.toml"
    config.write_text(
        f'[engine]\nurl = "http://127.0.0.1:{free_port()}"\n'
        f'[server]\nlisten = "127.0.0.1:{free_port()}"\n[log]\nformat = "json"\n'
    )
    engine = [sys.executable, "-c", "import time; time.sleep(120)"]
    proc = await asyncio.create_subprocess_exec(
        KVGUARD,
        "run",
        "--config",
        str(config),
        "--",
        *engine,
        env={**os.environ, "KVGUARD_STATE_DIR": str(tmp_path / "state")},
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        started = (await read_events(proc, until="engine_started"))[-1]
    finally:
        proc.kill()
        await proc.wait()
    pid = started["pid"]
    deadline = time.monotonic() + 10
    while _alive(pid):
        assert time.monotonic() < deadline, f"engine {pid} outlived kvguard"
        await asyncio.sleep(0.05)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its new parent to reap it does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


# ---------------------------------------------------------------------- SIGTERM mid-drain
class StuckRestarter:
    """A restart that never comes: the switch stays in its drain/restart phase."""

    description = "test (never restarts)"
    starts_8bit = False
    original_8bit = False

    def __init__(self) -> None:
        self.called = asyncio.Event()

    async def apply(self, *, fp8: bool) -> None:
        self.called.set()
        await asyncio.sleep(3600)

    def exited(self) -> str | None:
        return None


async def test_sigterm_during_a_drain_resumes_the_engine_before_exit(sim_server, tmp_path):
    """The fp8 switch has paused the engine to drain it when kvguard is told to stop.

    The shutdown path SIGTERM takes (kvguard.runtime.assembly.Guard.close) resumes the engine
    first.
    """
    server = await sim_server(kv_capacity_tokens=4096, max_model_len=2048, per_token_s=0.01)
    url = server.url
    config = parse_config({"engine": {"url": url}}, env={})
    state = StateFile(tmp_path / "state.json")
    record = EnginePauseRecord(state, url)
    restarter = StuckRestarter()

    async def stats() -> EngineStats | None:
        return await daemon.probes.engine.sample()

    def build(kind: str):
        admin = EngineAdmin(url, kind, backoff_s=0.01, on_pause_change=record.mark)
        drain = EnginePauseDrain(admin, stats)
        times = ReconfigureTimes(drain_timeout_s=30, start_timeout_s=30)
        return admin, Reconfigurer(restarter, drain, engine_stats=stats, times=times)

    actuators = Actuators(build, on_fp8=lambda _on: None, pause_record=record)
    probes = Probes(engine=EngineProbe(url), nvml=None, host=None)
    daemon = Daemon(config, probes=probes, actuators=actuators)
    # A long request in flight: the drain waits for it with the engine paused.
    async with aiohttp.ClientSession() as http:
        body = {"prompt": "word " * 50, "max_tokens": 1500, "stream": True}
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            await resp.content.readline()
            await daemon.tick()
            actuators.set_kind("vllm")
            assert actuators.launch(Action("kv_fp8", "sustained pressure"))
            await until(lambda: is_paused(url))
            assert record.paused
            assert not restarter.called.is_set()  # still draining

            async with asyncio.timeout(15):
                await Guard(daemon).close()  # what `kvguard run` does on SIGTERM

    assert not await is_paused(url)
    assert not record.paused
    assert actuators.results[("kv_fp8", "failed")] == 1  # cut short: never reported applied


async def test_exit_resumes_an_engine_a_lost_pause_answer_may_have_paused(sim_server, tmp_path):
    """A pause whose answer never came leaves `paused` false; the record says paused.

    On exit kvguard resumes on the record's word too: the engine may be paused.
    """
    server = await sim_server(kv_capacity_tokens=4096, max_model_len=2048)
    url = server.url
    record = EnginePauseRecord(StateFile(tmp_path / "state.json"), url)

    def build(kind: str):
        admin = EngineAdmin(url, kind, backoff_s=0.01, on_pause_change=record.mark)
        return admin, None

    actuators = Actuators(build, on_fp8=lambda _on: None, pause_record=record)
    actuators.set_kind("vllm")
    # What a pause that reached the engine but timed out on the way back leaves behind.
    async with aiohttp.ClientSession() as http, http.post(f"{url}/pause") as resp:
        assert resp.status == 200
    record.mark(True)
    assert not actuators.paused
    assert await is_paused(url)

    await actuators.close()

    assert not await is_paused(url)


# ---------------------------------------------------------------------- a stalled loop
class BlockingProbe:
    """A probe with a synchronous call inside: it blocks the whole event loop."""

    name = "host"
    available = True

    def follow(self, pid: int | None) -> None:
        return None

    def __init__(self, block_s: float) -> None:
        self.block_s = block_s

    async def sample(self) -> None:
        time.sleep(self.block_s)  # noqa: ASYNC251 - the fault under test

    async def close(self) -> None:
        return None


async def test_a_probe_that_blocks_the_loop_is_caught_by_tick_metrics_and_the_watchdog(
    sim_engine,
):
    """A call that never yields escapes wait_for.

    The tick duration, the overrun counter and the loop watchdog (event_loop_stalled)
    make it visible.
    """
    url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048)
    config = parse_config({"engine": {"url": url}, "poll": {"timeout_s": 0.2}}, env={})
    probes = Probes(engine=EngineProbe(url, timeout_s=0.2), nvml=None, host=BlockingProbe(1.0))
    daemon = Daemon(config, probes=probes, loop_stall_s=0.5)
    registry = daemon_registry(daemon)
    stop = asyncio.Event()

    async def after_tick(_snapshot) -> None:
        if daemon.state.ticks_total >= 2:
            stop.set()

    with capture_logs() as logs:
        async with asyncio.timeout(20):
            await daemon.run(stop, after_tick=after_tick)
    await daemon.close()
    names = [e["event"] for e in logs]
    assert names.count("tick_overran") == 1  # once per run of slow ticks
    assert "event_loop_stalled" in names
    stalled = next(e for e in logs if e["event"] == "event_loop_stalled")
    assert stalled["stalled_s"] >= 0.5
    assert registry.get_sample_value("kvguard_tick_duration_seconds") >= 1.0
    assert registry.get_sample_value("kvguard_tick_overruns_total") == 2
    assert registry.get_sample_value("kvguard_event_loop_stalls_total") >= 1
    assert registry.get_sample_value("kvguard_event_loop_lag_max_seconds") >= 0.5


async def test_a_healthy_loop_reports_no_stall(sim_engine):
    """Without a blocking call: no stall, no overrun, the lag stays far under the threshold."""
    url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048)
    config = parse_config({"engine": {"url": url}, "poll": {"interval_s": 0.1}}, env={})
    daemon = Daemon(config, probes=Probes(engine=EngineProbe(url), nvml=None, host=None))
    stop = asyncio.Event()

    async def after_tick(_snapshot) -> None:
        if daemon.state.ticks_total >= 5:
            stop.set()

    async with asyncio.timeout(20):
        await daemon.run(stop, after_tick=after_tick)
    await daemon.close()
    assert daemon.state.loop_stalls_total == 0
    assert daemon.state.tick_overruns_total == 0


async def test_metrics_count_the_tasks_on_the_loop():
    """kvguard_event_loop_tasks: the tasks alive when /metrics is read, leftovers included."""
    config = parse_config({"engine": {"url": "http://127.0.0.1:1"}}, env={})
    daemon = Daemon(
        config, probes=Probes(engine=EngineProbe(config.engine.url), nvml=None, host=None)
    )
    registry = daemon_registry(daemon)
    release = asyncio.Event()
    before = registry.get_sample_value("kvguard_event_loop_tasks")
    held = [asyncio.ensure_future(release.wait()) for _ in range(25)]
    try:
        assert registry.get_sample_value("kvguard_event_loop_tasks") == before + 25
    finally:
        release.set()
        await asyncio.gather(*held)
        await daemon.close()
    assert registry.get_sample_value("kvguard_event_loop_tasks") == before


def test_the_stall_threshold_must_be_positive():
    """A clear error names the setting."""
    config = parse_config({"engine": {"url": "http://127.0.0.1:1"}}, env={})
    with pytest.raises(InvalidInputError, match="loop_stall_s: must be > 0 seconds, got 0"):
        Daemon(
            config,
            probes=Probes(engine=EngineProbe(config.engine.url), nvml=None, host=None),
            loop_stall_s=0,
        )
