"""Supervisor mode: kvguard launches the engine as its child and owns its life.

``kvguard run --config F -- <engine command…>`` starts the command (an argv; never a
shell), passes its output through to kvguard's stderr line by line, and watches it:

* an exit kvguard did not ask for is a crash: it is counted
  (``kvguard_engine_restarts_total{reason="crash"|"oom"}``), and the engine is started
  again after a backoff that doubles per crash in a row (1 s … 60 s), reset once the
  engine has stayed up for a minute; from the crash until the new engine answers
  healthy, ``on_restarting`` says so (the admission proxy's ``502`` answers meanwhile
  carry ``Retry-After``);
* a CUDA out-of-memory in its output (PyTorch's ``OutOfMemoryError``, CUDA's
  ``out of memory``, cuBLAS allocation failures) marks the crash as ``oom`` and counts
  ``kvguard_engine_oom_total`` even when the engine survives it;
* :meth:`Supervisor.restart` replaces the command (the fp8 switch) and
  :meth:`Supervisor.stop` ends the child at kvguard's own shutdown: SIGTERM, then
  SIGKILL after ``stop_timeout_s``. The engine never outlives kvguard: on Linux the
  child also asks the kernel for SIGTERM when kvguard dies (``PR_SET_PDEATHSIG``), so
  a kvguard killed by SIGKILL or the OOM killer does not leave an orphaned engine
  holding the GPU for the next kvguard to start a second one beside.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import math
import os
import re
import signal
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import IO, Any

import structlog

from kvguard.errors import KvguardError

log = structlog.get_logger("kvguard.supervisor")

# What engines print when the GPU runs out (PyTorch, CUDA runtime, cuBLAS, ggml).
OOM_PATTERNS = re.compile(
    r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory"
    r"|cudaErrorMemoryAllocation|CUBLAS_STATUS_ALLOC_FAILED"
    r"|ggml_backend_cuda_buffer_type_alloc_buffer: allocating .* failed",
    re.IGNORECASE,
)
BACKOFF_MAX_S = 60.0
STABLE_AFTER_S = 60.0  # up this long: the next crash starts the backoff afresh
OOM_RECENT_S = 30.0  # an OOM line this close to an exit makes it an OOM exit
RESTART_REASONS = ("crash", "oom", "reconfigure")  # why the engine was restarted
# The Retry-After clients get while a crashed engine restarts: at least the backoff (the
# engine cannot be back sooner), and never under this (how soon it comes up is unknown).
RESTART_RETRY_AFTER_MIN_S = 5
HEALTH_POLL_S = 0.5  # how often a restarted engine is asked whether it is up yet

EventSink = Callable[[str, dict[str, Any]], None]
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _load_prctl() -> Callable[..., int] | None:
    """The C library's prctl, loaded now: a child must not load libraries before exec."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    prctl: Callable[..., int] = libc.prctl
    return prctl


_PRCTL = _load_prctl()


def _die_with_parent(parent_pid: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGTERM when kvguard dies (Linux only)."""
    prctl = _PRCTL
    if prctl is None:
        return None

    def arm() -> None:  # runs in the child, between fork and exec: no allocation-heavy work
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent_pid:  # kvguard died before the line above: go now
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


class Supervisor:
    """One engine process: started, watched, restarted on a crash, stopped with kvguard.

    ``on_restarting`` and ``healthy`` (both optional) mark a crash restart for the
    proxy: told a Retry-After in seconds at the crash, and None once ``healthy()``
    says the new engine answers (it is polled every :data:`HEALTH_POLL_S` until then).
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        stop_timeout_s: float = 30.0,
        backoff_s: float = 1.0,
        on_event: EventSink | None = None,
        output: IO[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        on_restarting: Callable[[int | None], None] | None = None,
        healthy: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        if not argv:
            raise KvguardError("the engine command is empty: give it after `--`")
        self.argv: list[str] = list(argv)
        self.stop_timeout_s = stop_timeout_s
        self.backoff_s = backoff_s
        self.on_event = on_event or (lambda _event, _fields: None)
        self.output = output if output is not None else sys.stderr
        self.clock = clock
        self.sleep = sleep
        # Told the seconds clients should wait when a crash restart begins, and None once
        # the engine answers ``healthy`` again (without ``healthy``: once it is spawned).
        self.on_restarting = on_restarting or (lambda _retry_after_s: None)
        self.healthy = healthy
        self.restarts: Counter[str] = Counter()  # reason (RESTART_REASONS) -> restarts
        self.ooms = 0
        self.last_exit_code: int | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._watchers: list[asyncio.Task[None]] = []
        self._pumps: list[asyncio.Task[None]] = []
        self._expected: set[int] = set()  # ids of processes kvguard itself stopped
        self._closing = False
        self._started_at = 0.0
        self._last_oom_at: float | None = None
        self._crashes_in_a_row = 0
        # One spawn at a time: a crash restart in flight when a reconfigure restart or a
        # stop comes finishes first and is then replaced or stopped, never left running
        # beside (or after) the engine kvguard tracks.
        self._spawning = asyncio.Lock()

    @property
    def pid(self) -> int | None:
        """The engine's PID while it runs."""
        process = self._process
        return process.pid if process is not None and process.returncode is None else None

    @property
    def program(self) -> str:
        """The engine's program, without its arguments (they can hold an API key)."""
        return self.argv[0]

    @property
    def restarts_by_reason(self) -> dict[str, int]:
        """Restarts so far by reason (those of :data:`RESTART_REASONS` seen), a copy."""
        return dict(self.restarts)

    @property
    def running(self) -> bool:
        """Whether the engine process is alive."""
        return self.pid is not None

    async def start(self) -> None:
        """Start the engine; raises :class:`KvguardError` when the command cannot run."""
        await self._spawn()

    async def restart(self, argv: Sequence[str]) -> None:
        """Stop the engine and start ``argv`` in its place; raises when it cannot start."""
        self.argv = list(argv)
        self.restarts["reconfigure"] += 1
        async with self._spawning:
            await self._terminate()
            await self._spawn()
        # A crash restart this one replaced is over: the caller (the fp8 switch) waits
        # for health and marks its own restart.
        self.on_restarting(None)
        self.on_event("engine_restarted", {"reason": "reconfigure", "pid": self.pid})

    async def stop(self) -> None:
        """End the engine for good: SIGTERM, then SIGKILL after ``stop_timeout_s``."""
        self._closing = True
        async with self._spawning:
            await self._terminate()
        tasks = [*self._watchers, *self._pumps]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.on_restarting(None)  # stopped for good: no restart to wait for

    # ------------------------------------------------------------------ internals
    async def _spawn(self) -> None:
        try:
            process = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C to kvguard's terminal is kvguard's to pass on
                preexec_fn=_die_with_parent(os.getpid()),
            )
        except OSError as exc:
            raise KvguardError(f"cannot start the engine {self.argv[0]!r}: {exc.strerror}") from exc
        self._process = process
        self._started_at = self.clock()
        assert process.stdout is not None  # noqa: S101 - asked for a pipe
        self._pumps = [p for p in self._pumps if not p.done()]
        self._pumps.append(asyncio.ensure_future(self._pump(process.stdout)))
        self._watchers = [w for w in self._watchers if not w.done()]
        self._watchers.append(asyncio.ensure_future(self._watch(process)))
        # The program and how many arguments, never the arguments: they may hold an API key.
        log.info("engine_started", pid=process.pid, program=self.argv[0], args=len(self.argv) - 1)

    async def _pump(self, stream: asyncio.StreamReader) -> None:
        """Pass the engine's output through, line by line, and look for OOMs in it."""
        while True:
            try:
                line = await stream.readline()
            except (ValueError, asyncio.LimitOverrunError):  # an over-long line: skip it
                continue
            if not line:
                return
            text = line.decode("utf-8", "replace")
            with contextlib.suppress(OSError, ValueError):
                self.output.write(text)
                self.output.flush()
            if OOM_PATTERNS.search(text):
                now = self.clock()
                recent = self._last_oom_at is not None and now - self._last_oom_at <= OOM_RECENT_S
                self._last_oom_at = now
                if recent:
                    continue  # one OOM prints several such lines (traceback, each TP worker)
                self.ooms += 1
                log.error("engine_oom", pid=self.pid, line=text.strip()[:300])
                self.on_event("engine_oom", {"pid": self.pid, "line": text.strip()[:300]})

    async def _terminate(self) -> None:
        process = self._process
        if process is None or process.returncode is not None:
            return
        self._expected.add(id(process))
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), self.stop_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            log.warning("engine_killed", pid=process.pid, after_s=self.stop_timeout_s)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                # The whole group (it was started in a session of its own): an engine's
                # workers must not be orphaned when its main process will not stop.
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
        self.last_exit_code = process.returncode

    async def _watch(self, process: asyncio.subprocess.Process) -> None:
        """Restart the engine when ``process`` exits without being asked to."""
        code = await process.wait()
        if self._closing or id(process) in self._expected or process is not self._process:
            self._expected.discard(id(process))
            return
        now = self.clock()
        self.last_exit_code = code
        oom = self._last_oom_at is not None and now - self._last_oom_at <= OOM_RECENT_S
        reason = "oom" if oom else "crash"
        self.restarts[reason] += 1
        if now - self._started_at >= STABLE_AFTER_S:
            self._crashes_in_a_row = 0
        log.error("engine_crashed", exit_code=code, reason=reason)
        self.on_event("engine_restarted", {"reason": reason, "exit_code": code})
        while not self._closing:
            delay = min(BACKOFF_MAX_S, self.backoff_s * 2**self._crashes_in_a_row)
            self._crashes_in_a_row += 1
            self.on_restarting(max(RESTART_RETRY_AFTER_MIN_S, math.ceil(delay)))
            await self.sleep(delay)
            async with self._spawning:
                if self._closing or self._process is not process:
                    return  # stopped, or a reconfigure started another meanwhile
                try:
                    await self._spawn()
                except KvguardError as exc:
                    # Keep trying after the next backoff rather than giving the engine up.
                    log.error("engine_restart_failed", error=str(exc))  # noqa: TRY400 - one line says it
                    continue
                spawned = self._process
            await self._until_healthy(spawned)
            return

    async def _until_healthy(self, process: asyncio.subprocess.Process | None) -> None:
        """Hold the restarting mark until ``process`` answers healthy; then lift it.

        Left as it is when ``process`` exits first (its own watcher restarts it and
        keeps the mark) or is replaced by a reconfigure (which lifted the mark).
        """
        check = self.healthy
        while check is not None:
            if self._closing:
                return  # stop() lifts it
            if process is not self._process or process is None or process.returncode is not None:
                return
            try:
                if await check():
                    break
            except Exception:  # a check that fails means "not up yet"
                log.debug("engine_health_check_failed", exc_info=True)
            await self.sleep(HEALTH_POLL_S)
        self.on_restarting(None)
