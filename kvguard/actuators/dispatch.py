"""The asynchronous actuators: engine admin calls and the fp8 switch, off the loop.

The ladder decides once per tick and must never wait for an engine: an eviction is
retried for seconds, a drain-and-restart takes minutes. :class:`Actuators` starts
each as a background task (one per kind at a time), counts how it ended
(``kvguard_action_results_total{action,result}``), logs it (``action_result``),
sends it to the webhooks, and tells the ladder what the engine's KV cache really is
after a switch. It also says which actions this engine cannot take, so the ladder
falls through to the next one (and the log says why, once). Given the state
file's record (:mod:`kvguard.actuators.state`), it resumes an engine that an earlier kvguard
paused and never resumed (it was killed) as soon as the engine's kind is known.

With no such record it asks the engine whether it is paused (vLLM ``GET
/is_paused``) and, if so, says so (``engine_paused_at_start``) but does not resume
it: kvguard never pauses without a record, so the pause is someone else's — an
operator, or a training job holding the engine for a weight update — and resuming
it under them could serve half-updated weights. Leaving it is visible (the log line,
:attr:`Actuators.paused_elsewhere`, the engine's own refusals) and one call undoes it.
A pause kvguard cannot record is refused outright (``engine_pause`` in
:meth:`Actuators.unavailable`, with why), so an engine-side shed then fails with
that reason while the proxy's own shed goes on.

Pause and resume go to the engine one at a time, in order, from one task: a resume
asked for while a pause is in flight is sent once the pause has answered, so the
engine cannot take the resume first and stay paused; whatever was asked last is
what the engine ends in.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from kvguard.actuators.engine_admin import AdminResult, EngineAdmin
from kvguard.actuators.engine_flags import supports_fp8
from kvguard.actuators.reconfigure import Reconfigurer
from kvguard.actuators.state import EnginePauseRecord
from kvguard.core.policy import Action

# Why the fp8 switch is off at the defaults: an opt-in the operator has not taken, not a
# fault (the ladder says it at info, not as a warning).
NO_RESTART_CONFIGURED = (
    'no way to restart the engine: set [reconfigure] mode, or run it as "-- <command>"'
)
# Until the engine's first good reading, what it can do is not known: its actions are
# left off the ladder meanwhile, and nothing is said of them until it is known.
KIND_NOT_KNOWN = "the engine's kind is not known yet"
log = structlog.get_logger("kvguard.actuators")
_PAUSE_TASK = "engine_pause"  # the one task that pauses and resumes the engine
EventSink = Callable[[str, dict[str, Any]], None]


@dataclass(frozen=True)
class SwitchReport:
    """The fp8 switch as /status and /metrics show it (a copy: reading it changes nothing)."""

    mode: str  # how the engine is restarted ([reconfigure] mode)
    restarter: str  # the restarter's description
    fp8: bool  # the engine runs with the 8-bit KV cache
    busy: bool  # draining or restarting now
    last_drain_s: float | None  # how long the last drain took
    cancelled: int  # requests drains left over and cancelled
    results: Mapping[tuple[str, str], int]  # (action, result) -> switches


class Actuators:
    """Starts evict, kv_fp8, revert_kv_fp8 and the engine-side shed; records results."""

    def __init__(
        self,
        build: Callable[[str], tuple[EngineAdmin | None, Reconfigurer | None]],
        *,
        on_fp8: Callable[[bool], None],
        shed_by_pause: bool = False,
        proxy_in_path: bool = False,
        on_event: EventSink | None = None,
        pause_record: EnginePauseRecord | None = None,
    ) -> None:
        self.build = build
        # What an earlier kvguard left behind (kvguard.actuators.state): a pause it never undid.
        self.pause_record = pause_record
        self.admin: EngineAdmin | None = None
        self.reconfigurer: Reconfigurer | None = None
        self.on_fp8 = on_fp8
        self.shed_by_pause = shed_by_pause
        self.proxy_in_path = proxy_in_path
        self.on_event = on_event or (lambda _event, _fields: None)
        self.kind: str | None = None  # the engine's kind, once known
        self.mode = "off"  # the fp8 switch's restart mode, for /status
        # (action, succeeded|failed), present from the start: 0 is not absent.
        self.results: Counter[tuple[str, str]] = Counter(
            {
                (a, r): 0
                for a in ("evict", "pause", "resume", "kv_fp8", "revert_kv_fp8")
                for r in ("succeeded", "failed")
            }
        )
        self.paused = False  # the engine is paused by kvguard (engine-side shed)
        # The engine said at start that it was paused, and no record says kvguard did it:
        # someone else's pause, left alone (see the module doc). Cleared by a resume.
        self.paused_elsewhere = False
        # Why the last pause was refused unsent (its record could not be written).
        self._pause_unrecordable: str | None = None
        # A pause that failed may still have reached the engine (a timeout, a 5xx after
        # it acted): until a resume works, a release must still send one.
        self._resume_owed = False
        # What the engine should end in (paused or not); read by the pause task.
        self._pause_wanted = False
        self._tasks: dict[str, asyncio.Task[None]] = {}

    # ------------------------------------------------------------------ what can act
    def set_kind(self, kind: str | None) -> None:
        """Build the engine's admin client and the fp8 switch once its kind is known."""
        if kind is None or self.kind is not None:
            return
        self.kind = kind
        self.admin, self.reconfigurer = self.build(kind)
        if self.reconfigurer is not None and self.reconfigurer.fp8:
            self.on_fp8(True)  # kvguard's fp8 drop-in outlived a restart of kvguard
        self._reconcile_stale_pause()

    def _reconcile_stale_pause(self) -> None:
        """Resume an engine an earlier kvguard paused and could not resume (it was killed).

        Without a record of one, ask the engine whether it is paused all the same.
        """
        record = self.pause_record
        admin = self.admin
        if record is None or not record.paused:
            if admin is not None and admin.supports("pause"):
                self._start(_PAUSE_TASK, self._check_paused_at_start())
            return
        if admin is None or not admin.supports("resume"):
            log.warning(
                "stale_pause_unresolved",
                engine=record.engine_url,
                reason=f"{self.kind} offers no resume endpoint kvguard can call",
            )
            return
        log.warning("stale_pause_found", engine=record.engine_url)
        self.paused = True  # until the resume says otherwise: /metrics shows the truth
        self._pause_wanted = False
        self._start(_PAUSE_TASK, self._resume_stale())

    def unavailable(self) -> dict[str, str]:
        """Actions this engine cannot take now, with why (the ladder falls through)."""
        out: dict[str, str] = {}
        if self.kind is None:
            # Neither the admin client nor the fp8 switch is built before the kind is
            # known: "no restart configured" would be untrue of `kvguard run -- <cmd>`.
            return dict.fromkeys(("evict", "kv_fp8", "revert_kv_fp8"), KIND_NOT_KNOWN)
        admin = self.admin
        if admin is None or not admin.supports("evict"):
            out["evict"] = (
                f"{self.kind} offers no cache eviction kvguard can call"
                " (vLLM needs VLLM_SERVER_DEV_MODE=1)"
            )
        why = self._why_no_switch()
        if why is not None:
            out["kv_fp8"] = out["revert_kv_fp8"] = why
        if self._pause_unrecordable is not None:
            # Not an action of the ladder: listed so /status and the log say why the
            # engine-side shed (and the drain by pause) did nothing.
            out["engine_pause"] = self._pause_unrecordable
        return out

    def _why_no_switch(self) -> str | None:
        if self.kind is not None and not supports_fp8(self.kind):
            return (
                f"kvguard cannot switch the KV dtype of {self.kind} (it is built into its engine)"
            )
        reconfigurer = self.reconfigurer
        if reconfigurer is None:
            return NO_RESTART_CONFIGURED
        if reconfigurer.original_8bit:
            return "the engine already starts with an 8-bit KV cache"
        if not reconfigurer.drain.can_stop_admitting():
            return (
                "no way to stop admitting for the drain: enable [proxy], or use an engine"
                " whose pause lets running requests finish (vLLM in dev mode; SGLang's"
                " pause freezes them in place, so a drain through it could not end)"
            )
        return None

    # ------------------------------------------------------------------ what is under way
    @property
    def switch_busy(self) -> bool:
        """Whether the fp8 switch is draining or restarting the engine now."""
        return self.reconfigurer is not None and self.reconfigurer.busy

    @property
    def kv_fp8(self) -> bool:
        """Whether the engine runs with the 8-bit KV cache, as the fp8 switch knows it.

        False without a switch: kvguard then never changed the engine's cache.
        """
        return self.reconfigurer is not None and self.reconfigurer.fp8

    def switch_report(self) -> SwitchReport | None:
        """The fp8 switch's state and counts; None without one (or before the kind is known)."""
        reconfigurer = self.reconfigurer
        if reconfigurer is None:
            return None
        return SwitchReport(
            mode=self.mode,
            restarter=reconfigurer.restarter.description,
            fp8=reconfigurer.fp8,
            busy=reconfigurer.busy,
            last_drain_s=reconfigurer.last_drain_s,
            cancelled=reconfigurer.cancelled,
            results=dict(reconfigurer.results),
        )

    # ------------------------------------------------------------------ starting
    def launch(self, action: Action) -> bool:
        """Start ``action`` in the background; False when nothing can act on it now."""
        kind = action.kind
        if kind == "evict" and self.admin is not None and self.admin.supports("evict"):
            return self._start("evict", self._evict())
        if kind in ("kv_fp8", "revert_kv_fp8") and self.reconfigurer is not None:
            # What unavailable() says the ladder cannot do is not done when asked anyway
            # (SGLang without the proxy: a drain through its pause could not end).
            if self.reconfigurer.busy or self._why_no_switch() is not None:
                return False
            return self._start(kind, self._switch(fp8=kind == "kv_fp8"))
        if kind == "shed" and self._pause_sheds() and action.priority == "standard":
            return self._steer_pause(paused=True)
        if (kind == "release" and action.target == "shed") or (
            kind == "shed" and action.priority != "standard"  # down from critical
        ):
            return self._steer_pause(paused=False)
        return False

    def _steer_pause(self, *, paused: bool) -> bool:
        """Head the engine for ``paused``; False when it is already there or headed there."""
        running = self._tasks.get(_PAUSE_TASK)
        busy = running is not None and not running.done()
        if busy:
            there = self._pause_wanted == paused
        else:
            there = self.paused if paused else not (self.paused or self._resume_owed)
        if there:
            return False
        self._pause_wanted = paused
        if not busy:  # else the running task reads the new wish when its call ends
            self._tasks[_PAUSE_TASK] = asyncio.ensure_future(self._follow_pause_wish())
        return True

    def _pause_sheds(self) -> bool:
        return (
            self.shed_by_pause
            and not self.proxy_in_path
            and self.admin is not None
            and self.admin.supports("pause")
        )

    def _start(self, name: str, work: Coroutine[Any, Any, None]) -> bool:
        running = self._tasks.get(name)
        if running is not None and not running.done():
            work.close()  # one of each at a time: the running one will do
            return False
        self._tasks[name] = asyncio.ensure_future(work)
        return True

    # ------------------------------------------------------------------ the work
    async def _evict(self) -> None:
        assert self.admin is not None  # noqa: S101 - launch checked it
        self._admin_done(await self.admin.evict())

    async def _follow_pause_wish(self) -> None:
        """Pause or resume, one call at a time, until the last call made is the last wish.

        Never two calls at once: an engine could take them in either order. A wish
        that flips and flips back while a call is out costs no call at all.
        """
        while True:
            wanted = self._pause_wanted
            if wanted:
                await self._pause()
            else:
                await self._resume()
            if self._pause_wanted == wanted:
                return

    async def _pause(self) -> None:
        assert self.admin is not None  # noqa: S101 - launch checked it
        # vLLM stops admitting as soon as the pause arrives but answers later: from
        # now on the engine may be paused, so a cancelled call still gets a resume.
        self.paused = True
        result = await self.admin.pause()
        self.paused = result.ok
        self._note_unrecorded(result)
        # A pause refused outright changes nothing (a resume still owed stays owed); one
        # that timed out or hit a transient error may have paused the engine.
        self._resume_owed = self._resume_owed or result.ok or result.uncertain
        self._admin_done(result)

    async def _resume(self) -> None:
        assert self.admin is not None  # noqa: S101 - launch checked it
        result = await self.admin.resume()
        self.paused = not result.ok
        self.paused_elsewhere = self.paused_elsewhere and not result.ok
        # Failed: the next release tries again. An engine with no resume cannot be asked.
        self._resume_owed = not result.ok and result.supported
        self._admin_done(result)

    def _note_unrecorded(self, result: AdminResult) -> None:
        """Remember why a pause was refused unrecorded; a pause that was sent clears it."""
        if result.unrecorded:
            record = self.pause_record
            where = record.write_error if record is not None else None
            self._pause_unrecordable = (
                "kvguard pauses the engine only once the pause is recorded in its state file,"
                f" and {where or 'the record could not be written'}"
                " (set KVGUARD_STATE_DIR or systemd's StateDirectory= to a writable folder)"
            )
        elif result.action == "pause" and result.supported:
            self._pause_unrecordable = None

    async def _check_paused_at_start(self) -> None:
        """Say so when the engine is paused with no record of kvguard pausing it; leave it."""
        admin = self.admin
        assert admin is not None  # noqa: S101 - the caller checked it
        # One task with the pauses and resumes: the answer cannot be kvguard's own pause.
        if await admin.is_paused():
            self.paused_elsewhere = True
            log.warning(
                "engine_paused_at_start",
                engine=admin.url,
                resumed=False,
                reason="paused, and kvguard's state file has no record of kvguard pausing it:"
                " someone else's pause is left to them",
            )
        if self._pause_wanted:  # a shed asked for meanwhile: this task carries it out
            await self._follow_pause_wish()

    async def _resume_stale(self) -> None:
        await self._follow_pause_wish()
        record = self.pause_record
        if not self.paused and record is not None:
            log.info("stale_pause_resumed", engine=record.engine_url)

    async def _switch(self, *, fp8: bool) -> None:
        reconfigurer = self.reconfigurer
        assert reconfigurer is not None  # noqa: S101 - launch checked it
        action = "kv_fp8" if fp8 else "revert_kv_fp8"
        outcome = "failed"
        try:
            result = await reconfigurer.switch(fp8=fp8)
            outcome = "succeeded" if result.result == "succeeded" else "failed"
        except Exception as exc:  # noqa: BLE001 - a bug here must not leave the ladder wrong
            log.error("action_result", action=action, result="failed", detail=repr(exc)[:300])  # noqa: TRY400
        finally:
            self.results[(action, outcome)] += 1
            # Whatever happened, the ladder learns what the engine's cache is now; and a
            # restarted engine starts unpaused.
            self.on_fp8(reconfigurer.fp8)
            self.paused = self._resume_owed = False

    def _admin_done(self, result: AdminResult) -> None:
        outcome = "succeeded" if result.ok else "failed"
        self.results[(result.action, outcome)] += 1
        fields = {
            "action": result.action,
            "result": outcome,
            "detail": result.detail,
            "attempts": result.attempts,
        }
        if result.ok:
            log.info("action_result", **fields)
        else:
            log.warning("action_result", **fields)
        self.on_event("action_result", fields)

    # ------------------------------------------------------------------ the end
    async def close(self) -> None:
        """Wait for running actions briefly, and never leave the engine paused."""
        tasks = [t for t in self._tasks.values() if not t.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # The record too: a pause whose answer never came (a timeout) may have reached
        # the engine though `paused` says no; a resume the engine did not need is harmless.
        record = self.pause_record
        maybe_paused = self.paused or self._resume_owed or (record is not None and record.paused)
        if maybe_paused and self.admin is not None:
            with contextlib.suppress(Exception):
                result = await self.admin.resume()
                self.paused = not result.ok
                log.info("engine_resumed_at_exit", ok=result.ok, detail=result.detail)
        if self.admin is not None:
            await self.admin.close()
