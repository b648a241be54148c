"""Host memory and the engine process's footprint: the only module that imports psutil.

:class:`HostProbe` reads the host's total and available memory and, when the
engine's PID or process name is configured, that process's resident memory and
CPU use. An engine that is not running is not an error: its fields are ``None``
(the engine probe reports it down); only psutil failing is.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from typing import Any, TypeAlias

import psutil

from kvguard.core.snapshot import HostStats
from kvguard.errors import InvalidInputError, ProbeError

PROBE_NAME = "host"

# psutil is untyped here (see the import), and tests may hand in a stand-in module.
PsutilModule: TypeAlias = Any
PsutilProcess: TypeAlias = Any


def process_tree(pid: int, *, psutil_module: PsutilModule = None) -> tuple[int, ...]:
    """``pid`` and the PIDs of all its descendants; ``()`` when ``pid`` is not running.

    Engines often hold the GPU in child processes (vLLM's engine core, tensor
    parallel workers), so selecting GPUs "by the engine's PID" needs the whole
    tree. Never raises: a process that vanishes while being read is left out.
    """
    ps = psutil if psutil_module is None else psutil_module
    try:
        root = ps.Process(pid)
        children = root.children(recursive=True)
    except ps.Error:
        return ()
    return (pid, *(child.pid for child in children))


class HostProbe:
    """Reads host memory and the engine process; a :class:`~kvguard.probes.base.FollowingProbe`.

    Give ``pid`` to watch one process, or ``process_name`` to watch the oldest
    running process of that name (psutil's ``name()``, e.g. ``llama-server``); the
    process found is remembered and looked up again once it exits. Neither: host
    memory only. ``psutil_module`` replaces psutil (tests).
    """

    name: str = PROBE_NAME
    available: bool = True  # the host is always there to ask

    def __init__(
        self,
        *,
        pid: int | None = None,
        process_name: str | None = None,
        psutil_module: PsutilModule = None,
    ) -> None:
        if pid is not None and process_name is not None:
            raise InvalidInputError(
                "engine.process_name",
                process_name,
                "give engine.pid or engine.process_name, not both",
            )
        if pid is not None and pid <= 0:
            raise InvalidInputError("engine.pid", pid, "a positive process id")
        if process_name is not None and not process_name.strip():
            raise InvalidInputError("engine.process_name", process_name, "a process name")
        self._pid = pid
        self._process_name = process_name
        self._ps: PsutilModule = psutil if psutil_module is None else psutil_module
        self._process: PsutilProcess = None  # the psutil.Process being watched
        # A sample abandoned by the daemon's timeout may still be running in its thread.
        self._lock = threading.Lock()

    def follow(self, pid: int | None) -> None:
        """Watch ``pid`` from now on (supervisor mode: the engine kvguard started)."""
        if pid is not None and pid != self._pid and self._process_name is None:
            # No lock: a sample may hold it in its thread, and the loop must not wait.
            # Each assignment is atomic; a sample running now finishes on the old PID.
            self._pid, self._process = pid, None

    async def sample(self) -> HostStats:
        """Host memory and, when configured and running, the engine process.

        Runs in a thread: a name lookup reads every process in /proc. Raises
        :class:`ProbeError` when psutil fails (not when the engine is gone).
        """
        return await asyncio.to_thread(self._sample_locked)

    async def close(self) -> None:
        """Nothing to release; forgets the watched process."""
        self._process = None

    def _sample_locked(self) -> HostStats:
        with self._lock:
            try:
                return self._sample_sync()
            except self._ps.Error as exc:
                raise ProbeError(PROBE_NAME, f"{type(exc).__name__}: {exc}") from None
            except OSError as exc:
                raise ProbeError(PROBE_NAME, f"reading /proc: {exc}") from None

    def _sample_sync(self) -> HostStats:
        memory = self._ps.virtual_memory()
        stats = HostStats(
            memory_total_bytes=int(memory.total), memory_available_bytes=int(memory.available)
        )
        if self._pid is None and self._process_name is None:
            return stats
        found = self._engine_process()
        if found is None:
            return stats
        process, fresh = found
        try:
            with process.oneshot():
                # A zombie still has a /proc entry (RSS 0) but is gone for our purposes.
                zombie = process.status() == self._ps.STATUS_ZOMBIE
                resident = int(process.memory_info().rss)
                cpu_percent = float(process.cpu_percent(None))
                times = process.cpu_times()
                cpu_seconds = float(times.user + times.system)
        except self._ps.NoSuchProcess:
            zombie = True
        if zombie:
            self._process = None
            return stats
        return replace(
            stats,
            engine_pid=int(process.pid),
            engine_resident_bytes=resident,
            # The first cpu_percent(None) only starts the interval it measures.
            engine_cpu_ratio=None if fresh else cpu_percent / 100,
            engine_cpu_seconds_total=cpu_seconds,
        )

    def _engine_process(self) -> tuple[PsutilProcess, bool] | None:
        """The watched process and whether it was just found; None when not running."""
        # is_running() also notices a PID reused by another process.
        if self._process is not None and self._process.is_running():
            return self._process, False
        self._process = None
        if self._pid is not None:
            try:
                process = self._ps.Process(self._pid)
            except self._ps.NoSuchProcess:
                return None
        else:
            process = self._oldest_named()
            if process is None:
                return None
        self._process = process
        return process, True

    def _oldest_named(self) -> PsutilProcess:
        """The oldest live process named ``process_name`` (the engine, not its workers)."""
        ps = self._ps
        matches = [
            proc
            for proc in ps.process_iter(["name", "create_time", "status"])
            if proc.info["name"] == self._process_name
            and proc.info["status"] != ps.STATUS_ZOMBIE
            and proc.info["create_time"] is not None
        ]
        if not matches:
            return None
        return min(matches, key=lambda proc: (proc.info["create_time"], proc.pid))
