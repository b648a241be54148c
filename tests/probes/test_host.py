"""HostProbe against this machine's real processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import types
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from kvguard.errors import InvalidInputError, ProbeError
from kvguard.probes.host import HostProbe, process_tree


class Sleepers:
    """Starts `sleep 30` copies under one name no other process on the machine has."""

    def __init__(self, directory: Path) -> None:
        self.name = f"kvgs{os.getpid() % 100000}"  # under 15 characters: the comm limit
        self.binary = directory / self.name
        sleep = shutil.which("sleep")
        assert sleep is not None
        shutil.copy(sleep, self.binary)
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self) -> subprocess.Popen[bytes]:
        """Start one more; it is killed in teardown if the test has not."""
        proc = subprocess.Popen([str(self.binary), "30"])
        self.started.append(proc)
        return proc


@pytest.fixture
def sleeper(tmp_path: Path) -> Iterator[Sleepers]:
    """Sleeping processes under a unique name, all stopped in teardown."""
    sleepers = Sleepers(tmp_path)
    yield sleepers
    for proc in sleepers.started:
        proc.kill()
        proc.wait()


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Kill a process and reap it, so it is gone rather than a zombie."""
    proc.kill()
    proc.wait()


async def test_host_memory_is_plausible():
    """Total > available > 0, and no engine fields without an engine configured."""
    stats = await HostProbe().sample()

    assert stats.memory_total_bytes > stats.memory_available_bytes > 0
    assert stats.engine_pid is None
    assert stats.engine_resident_bytes is None
    assert stats.engine_cpu_ratio is None


async def test_own_pid_has_resident_memory_and_cpu_after_priming():
    """Watching this test's PID: RSS > 0; CPU is unknown first, then a ratio."""
    probe = HostProbe(pid=os.getpid())

    first = await probe.sample()
    sum(i * i for i in range(200_000))  # some CPU time for the interval to measure
    second = await probe.sample()

    assert first.engine_pid == os.getpid()
    assert first.engine_resident_bytes is not None
    assert first.engine_resident_bytes > 0
    assert first.engine_cpu_ratio is None  # the first call only primes the measurement
    assert second.engine_cpu_ratio is not None
    assert second.engine_cpu_ratio >= 0
    # A counter from the start: present on the first read, never falling.
    assert first.engine_cpu_seconds_total is not None
    assert second.engine_cpu_seconds_total is not None
    assert second.engine_cpu_seconds_total >= first.engine_cpu_seconds_total > 0


async def test_process_name_finds_the_subprocess(sleeper):
    """A name lookup finds the process started under that name."""
    proc = sleeper.start()
    stats = await HostProbe(process_name=sleeper.name).sample()

    assert stats.engine_pid == proc.pid
    assert stats.engine_resident_bytes is not None
    assert stats.engine_resident_bytes > 0


async def test_process_name_picks_the_oldest_and_re_resolves_when_it_dies(sleeper):
    """Of two same-named processes the oldest is watched; when it dies, the other is."""
    oldest = sleeper.start()
    younger = sleeper.start()  # same 10 ms start tick at worst: then the lower PID wins
    probe = HostProbe(process_name=sleeper.name)

    assert (await probe.sample()).engine_pid == oldest.pid
    stop(oldest)
    assert (await probe.sample()).engine_pid == younger.pid


async def test_killed_process_leaves_engine_fields_unknown(sleeper):
    """A watched process that died is not an error: the engine fields become None."""
    proc = sleeper.start()
    by_pid = HostProbe(pid=proc.pid)
    by_name = HostProbe(process_name=sleeper.name)
    assert (await by_pid.sample()).engine_pid == proc.pid
    assert (await by_name.sample()).engine_pid == proc.pid

    stop(proc)

    for probe in (by_pid, by_name):
        stats = await probe.sample()
        assert stats.memory_total_bytes > 0
        assert stats.engine_pid is None
        assert stats.engine_resident_bytes is None
        assert stats.engine_cpu_ratio is None


async def test_unreaped_zombie_counts_as_gone(sleeper):
    """A killed but not yet reaped child (a zombie) reads as gone, not as RSS 0."""
    proc = sleeper.start()
    probe = HostProbe(pid=proc.pid)
    await probe.sample()

    proc.kill()
    while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
        pass  # SIGKILL lands within microseconds; no sleep needed
    stats = await probe.sample()

    assert stats.engine_pid is None
    assert stats.engine_resident_bytes is None


async def test_psutil_failure_is_a_probe_error():
    """A psutil error becomes ProbeError naming the host probe."""

    def broken() -> None:
        raise psutil.AccessDenied(1, "virtual_memory")

    stub = types.SimpleNamespace(**{**vars(psutil), "virtual_memory": broken})

    with pytest.raises(ProbeError, match="host: AccessDenied"):
        await HostProbe(psutil_module=stub).sample()


def test_pid_and_name_together_are_refused():
    """Giving both a PID and a name is a configuration error, not a guess."""
    with pytest.raises(InvalidInputError, match="not both"):
        HostProbe(pid=1, process_name="vllm")
    with pytest.raises(InvalidInputError, match=r"engine\.pid"):
        HostProbe(pid=0)


def test_process_tree_lists_children_and_nothing_for_the_dead(sleeper):
    """process_tree gives a PID and its descendants, and () once it is gone."""
    proc = sleeper.start()

    assert process_tree(os.getpid())[0] == os.getpid()
    assert proc.pid in process_tree(os.getpid())
    stop(proc)
    assert process_tree(proc.pid) == ()
