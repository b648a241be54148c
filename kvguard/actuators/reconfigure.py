"""The fp8 KV switch: drain the engine, restart it with other KV flags, re-admit.

Engines take the KV-cache dtype at start only, so kvguard switches it by a controlled
restart (:meth:`Reconfigurer.switch`):

1. stop admitting — the proxy answers every generation request ``503`` with
   ``Retry-After`` (:class:`ProxyDrain`), or the engine pauses (:class:`EnginePauseDrain`);
2. wait for the requests in flight to finish, up to ``drain_timeout_s``; the rest are
   cancelled with a clear error and counted (``reason="drain"``);
3. restart the engine with the fp8 flags of its kind (or, to revert, its original
   ones) — through the supervisor, a systemd drop-in, or a command of yours;
4. wait for it to answer healthy, up to ``start_timeout_s``, and check the cache dtype
   it reports (where it reports one); from the restart until then ``on_restarting``
   says so (the proxy's ``502`` answers carry ``Retry-After``);
5. re-admit. A failed restart rolls back to the original flags and raises a critical
   event; admission is re-opened whatever happened.

No shell anywhere: commands are argv lists, the environment carries the change.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import structlog

from kvguard.actuators.engine_flags import FP8_FLAGS, is_8bit, kv_dtype_of, with_fp8
from kvguard.actuators.supervisor import Supervisor
from kvguard.core.snapshot import EngineStats
from kvguard.errors import KvguardError

log = structlog.get_logger("kvguard.reconfigure")
DROPIN_NAME = "50-kvguard-kv-cache.conf"
HEALTH_POLL_S = 0.5


# Exits of a restarted engine (the supervisor retries it) that end the wait for health.
EXITS_THAT_END_THE_WAIT = 2


class ReconfigureError(KvguardError):
    """A restart step failed; the message says which and why."""


@dataclass(frozen=True)
class ReconfigureResult:
    """What one switch did."""

    action: str  # kv_fp8 | revert_kv_fp8
    result: str  # succeeded | rolled_back | failed
    detail: str
    drain_s: float = 0.0
    cancelled: int = 0
    cache_dtype: str | None = None  # as the engine reports it afterwards, if it does


class Restarter(Protocol):
    """Restarts the engine with an 8-bit KV cache (``fp8``) or its original one."""

    description: str
    starts_8bit: bool  # the engine runs with kvguard's fp8 flags already (a kept drop-in)
    original_8bit: bool  # its own command asks for an 8-bit cache

    async def apply(self, *, fp8: bool) -> None:
        """Restart; raises :class:`ReconfigureError` when the restart itself fails."""

    def exited(self) -> str | None:
        """Why the engine cannot come up since the last :meth:`apply`: it exited (None: no sign)."""


class Drain(Protocol):
    """Stops and re-opens admission, and says what is still in flight."""

    def can_stop_admitting(self) -> bool:
        """Whether this drain has a way to stop admission at all."""

    async def stop_admitting(self, retry_after_s: int) -> str | None:
        """Stop new requests; returns why it cannot (None when it did)."""

    async def inflight(self) -> int | None:
        """Requests still in flight (None: unknown right now)."""

    async def cancel_rest(self) -> int:
        """Cancel what is still in flight after the drain timeout; returns how many."""

    async def readmit(self) -> None:
        """Open admission again."""


# ---------------------------------------------------------------------- restarters
class SupervisorRestarter:
    """Supervisor mode: kvguard restarts its own child with the rewritten command."""

    def __init__(self, supervisor: Supervisor, kind: str) -> None:
        self.supervisor = supervisor
        self.kind = kind
        self.original = list(supervisor.argv)
        self.description = f"supervisor ({supervisor.argv[0]})"
        self.starts_8bit = False  # kvguard started it with its own command
        self.original_8bit = is_8bit(kv_dtype_of(self.original, kind))
        self._exits_before = 0

    async def apply(self, *, fp8: bool) -> None:
        """Restart the child with fp8 flags, or with the command it was started with."""
        # The child inherits kvguard's environment (llama.cpp reads LLAMA_ARG_* there).
        argv = with_fp8(self.original, self.kind, os.environ) if fp8 else self.original
        try:
            await self.supervisor.restart(argv)
        except KvguardError as exc:
            raise ReconfigureError(str(exc)) from exc
        # Counted from here: an exit of the engine it replaced, seen by that engine's
        # watcher while the new one was being spawned, is not the new engine's.
        self._exits_before = self._exits()

    def exited(self) -> str | None:
        """The restarted child exited twice on its own: it rejects its flags.

        Once may be passing (the old engine's memory or port not yet released); the
        supervisor then starts it again after its backoff. Exiting again with the same
        flags is an answer: waiting out ``start_timeout_s`` (600 s by default) with
        admission stopped would refuse traffic for nothing.
        """
        exits = self._exits() - self._exits_before
        if exits < EXITS_THAT_END_THE_WAIT:
            return None
        code = self.supervisor.last_exit_code
        return f"the engine exited {exits} times (last with code {code}) before it was healthy"

    def _exits(self) -> int:
        restarts = self.supervisor.restarts
        return restarts["crash"] + restarts["oom"]


def engine_environment(kind: str, *, fp8: bool) -> dict[str, str]:
    """The variables that carry the change to a unit or a command."""
    flags = FP8_FLAGS.get(kind, ()) if fp8 else ()
    dtype = kv_dtype_of(flags, kind) if fp8 else "auto"
    return {
        "KVGUARD_ACTION": "kv_fp8" if fp8 else "revert_kv_fp8",
        "KVGUARD_KV_CACHE_DTYPE": dtype,
        "KVGUARD_ENGINE_FLAGS": " ".join(flags),
    }


async def run_argv(argv: Sequence[str], *, env: Mapping[str, str], timeout_s: float) -> None:
    """Run ``argv`` (no shell) with ``env`` added; raises unless it exits 0 in time."""
    try:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, **env},
        )
    except OSError as exc:
        raise ReconfigureError(f"cannot run {argv[0]!r}: {exc.strerror}") from exc
    try:
        output, _ = await asyncio.wait_for(process.communicate(), timeout_s)
    except (asyncio.TimeoutError, TimeoutError) as exc:
        process.kill()
        await process.wait()
        raise ReconfigureError(f"{argv[0]!r} did not finish within {timeout_s:g} s") from exc
    if process.returncode != 0:
        # The output and the arguments may hold credentials: they go to the log only
        # (the error travels further, to /status and the webhooks).
        tail = output.decode("utf-8", "replace").strip().splitlines()[-5:]
        log.warning(
            "restart_command_failed", program=argv[0], exit_code=process.returncode, output=tail
        )
        raise ReconfigureError(
            f"{argv[0]!r} exited {process.returncode} (its output is in kvguard's log:"
            " restart_command_failed)"
        )


class SystemdRestarter:
    """Systemd mode: a drop-in for the engine's unit carries the flags; then a restart.

    The drop-in sets ``KVGUARD_ENGINE_FLAGS`` (and ``KVGUARD_KV_CACHE_DTYPE``); the
    unit's ``ExecStart=`` must end with ``$KVGUARD_ENGINE_FLAGS`` (unbraced, so systemd
    splits it into words). Reverting removes the drop-in.
    """

    def __init__(
        self,
        unit: str,
        kind: str,
        *,
        dropin_dir: str = "/etc/systemd/system",
        systemctl: Sequence[str] = ("systemctl",),
        timeout_s: float = 600.0,
    ) -> None:
        self.unit = unit
        self.kind = kind
        self.dropin = Path(dropin_dir) / f"{unit}.d" / DROPIN_NAME
        self.systemctl = list(systemctl)
        self.timeout_s = timeout_s
        self.description = f"systemd ({unit})"
        # The drop-in is kvguard's state on disk: it outlives a kvguard restart.
        self.starts_8bit = self.dropin.exists()
        self.original_8bit = False

    async def apply(self, *, fp8: bool) -> None:
        """Write (or remove) the drop-in, reload systemd, restart the unit."""
        try:
            if fp8:
                env = engine_environment(self.kind, fp8=True)
                lines = [f'"{k}={v}"' for k, v in env.items() if k != "KVGUARD_ACTION"]
                body = (
                    "# Written by kvguard: the fp8 KV switch. Removed when it reverts.\n"
                    f"[Service]\nEnvironment={' '.join(lines)}\n"
                )
                self.dropin.parent.mkdir(parents=True, exist_ok=True)
                partial = self.dropin.with_suffix(".tmp")
                partial.write_text(body, encoding="utf-8")
                partial.replace(self.dropin)  # atomic: systemd never reads half a file
            else:
                self.dropin.unlink(missing_ok=True)
        except OSError as exc:
            raise ReconfigureError(f"cannot write {self.dropin}: {exc.strerror}") from exc
        await run_argv([*self.systemctl, "daemon-reload"], env={}, timeout_s=self.timeout_s)
        await run_argv([*self.systemctl, "restart", self.unit], env={}, timeout_s=self.timeout_s)

    def exited(self) -> str | None:
        """Unknown here: systemd restarts the unit by its own rules; health decides."""
        return None


class CommandRestarter:
    """Command mode: your argv does the restart (``kubectl patch``, Slurm, …).

    It gets ``KVGUARD_ACTION`` (``kv_fp8`` or ``revert_kv_fp8``),
    ``KVGUARD_KV_CACHE_DTYPE`` and ``KVGUARD_ENGINE_FLAGS`` in its environment and
    must exit 0 once the restart is under way; kvguard then waits for health.
    """

    def __init__(self, argv: Sequence[str], kind: str, *, timeout_s: float = 600.0) -> None:
        self.argv = list(argv)
        self.kind = kind
        self.timeout_s = timeout_s
        self.description = f"command ({self.argv[0]})"
        # Nothing on this side records a switch: after a kvguard restart it assumes the
        # engine runs its original flags (docs/mitigations.md says so).
        self.starts_8bit = False
        self.original_8bit = False

    async def apply(self, *, fp8: bool) -> None:
        """Run the command with the change in its environment."""
        await run_argv(
            self.argv, env=engine_environment(self.kind, fp8=fp8), timeout_s=self.timeout_s
        )

    def exited(self) -> str | None:
        """Unknown here: the engine runs wherever the command put it; health decides."""
        return None


# ---------------------------------------------------------------------- the switch
@dataclass(frozen=True)
class ReconfigureTimes:
    """How long each wait of the switch may last."""

    drain_timeout_s: float = 60.0
    start_timeout_s: float = 600.0


class Reconfigurer:
    """Runs the drain → restart → verify → re-admit sequence, one at a time.

    ``on_restarting`` is told the seconds clients should wait when the restart
    begins, and None when the switch ends (the engine healthy, or given up on).
    """

    def __init__(
        self,
        restarter: Restarter,
        drain: Drain,
        *,
        engine_stats: Callable[[], Awaitable[EngineStats | None]],
        times: ReconfigureTimes = ReconfigureTimes(),
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        on_restarting: Callable[[int | None], None] | None = None,
    ) -> None:
        self.restarter = restarter
        self.on_restarting = on_restarting or (lambda _retry_after_s: None)
        self.drain = drain
        self.engine_stats = engine_stats
        self.times = times
        self.on_event = on_event or (lambda _event, _fields: None)
        self.clock = clock
        self.sleep = sleep
        self.fp8 = restarter.starts_8bit
        # The command kvguard would revert to already asks for an 8-bit cache: nothing to do.
        self.original_8bit = restarter.original_8bit
        self.busy = False
        # (action, result), present from the start: 0 is not absent.
        self.results: Counter[tuple[str, str]] = Counter(
            {
                (a, r): 0
                for a in ("kv_fp8", "revert_kv_fp8")
                for r in ("succeeded", "rolled_back", "failed")
            }
        )
        self.last_drain_s: float | None = None
        self.cancelled = 0

    async def switch(self, *, fp8: bool) -> ReconfigureResult:
        """Switch the engine's KV cache to 8 bits (``fp8``) or back; never raises."""
        action = "kv_fp8" if fp8 else "revert_kv_fp8"
        if self.busy:
            return self._done(ReconfigureResult(action, "failed", "a switch is already running"))
        self.busy = True
        try:
            return self._done(await self._switch(action, fp8=fp8))
        finally:
            self.busy = False

    async def _switch(self, action: str, *, fp8: bool) -> ReconfigureResult:
        # Clients should come back after the restart, but OpenAI's SDK ignores
        # Retry-After over 60 s (and retries at once): cap it there.
        retry_after = int(self.times.drain_timeout_s + self.times.start_timeout_s)
        try:
            # Inside the try: a pause that was sent but not answered is still undone.
            why_not = await self.drain.stop_admitting(max(1, min(60, retry_after)))
            if why_not is not None:
                return ReconfigureResult(action, "failed", f"cannot stop admitting: {why_not}")
            log.warning("drain_started", action=action, timeout_s=self.times.drain_timeout_s)
            drain_s, cancelled = await self._wait_for_drain()
            self.last_drain_s = drain_s
            self.cancelled += cancelled
            try:
                dtype = await self._restart(fp8=fp8)
            except ReconfigureError as exc:
                return await self._roll_back(action, str(exc), drain_s, cancelled)
            self.fp8 = fp8
            detail = (
                f"restarted by {self.restarter.description}; cache dtype {dtype or 'unreported'}"
            )
            return ReconfigureResult(action, "succeeded", detail, drain_s, cancelled, dtype)
        finally:
            self.on_restarting(None)
            await self.drain.readmit()

    async def _wait_for_drain(self) -> tuple[float, int]:
        started = self.clock()
        deadline = started + self.times.drain_timeout_s
        while self.clock() < deadline:
            left = await self.drain.inflight()
            if left == 0:
                return self.clock() - started, 0
            await self.sleep(min(HEALTH_POLL_S, max(0.0, deadline - self.clock())))
        cancelled = await self.drain.cancel_rest()
        if cancelled:
            log.warning("drain_timed_out", cancelled=cancelled, after_s=self.times.drain_timeout_s)
        return self.clock() - started, cancelled

    async def _restart(self, *, fp8: bool) -> str | None:
        """Restart and wait healthy; the engine's dtype, checked where it says one."""
        # The engine is down from here until healthy: as long as it may take to start,
        # capped at 60 s as the drain's answers are (OpenAI's SDK ignores longer ones).
        self.on_restarting(max(1, min(60, math.ceil(self.times.start_timeout_s))))
        await self.restarter.apply(fp8=fp8)
        stats = await self._wait_healthy()
        dtype = stats.cache_dtype
        if dtype is not None and is_8bit(dtype) != fp8:
            want = "an 8-bit" if fp8 else "its original"
            raise ReconfigureError(f"the engine came back with cache dtype {dtype}, not {want}")
        return dtype

    async def _wait_healthy(self) -> EngineStats:
        deadline = self.clock() + self.times.start_timeout_s
        while True:
            try:
                stats = await self.engine_stats()
            except KvguardError:
                stats = None
            if stats is not None and stats.up:
                return stats
            exited = self.restarter.exited()
            if exited is not None:
                raise ReconfigureError(exited)
            if self.clock() >= deadline:
                raise ReconfigureError(
                    f"the engine was not healthy within {self.times.start_timeout_s:g} s"
                )
            await self.sleep(HEALTH_POLL_S)

    async def _roll_back(
        self, action: str, error: str, drain_s: float, cancelled: int
    ) -> ReconfigureResult:
        log.error("reconfigure_failed", action=action, error=error, rolling_back_to_fp8=self.fp8)
        try:
            dtype = await self._restart(fp8=self.fp8)
        except ReconfigureError as exc:
            detail = f"{error}; the rollback failed too: {exc}"
            return ReconfigureResult(action, "failed", detail, drain_s, cancelled)
        detail = f"{error}; rolled back to the flags it ran with before"
        return ReconfigureResult(action, "rolled_back", detail, drain_s, cancelled, dtype)

    def _done(self, result: ReconfigureResult) -> ReconfigureResult:
        self.results[(result.action, result.result)] += 1
        fields = {
            "action": result.action,
            "result": result.result,
            "detail": result.detail,
            "drain_s": round(result.drain_s, 3),
            "cancelled": result.cancelled,
            "cache_dtype": result.cache_dtype,
        }
        if result.result == "succeeded":
            log.warning("reconfigured", **fields)
        else:
            # A failed switch leaves the engine as it was, or worse: page someone.
            log.error("reconfigure_alert", severity="critical", **fields)
        self.on_event("action_result", {**fields, "severity": _severity(result)})
        return result


def _severity(result: ReconfigureResult) -> str:
    return "info" if result.result == "succeeded" else "critical"
