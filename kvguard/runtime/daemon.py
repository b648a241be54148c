"""The loop: observe every source, build one snapshot per tick, keep the budget, decide.

Time and concurrency live here and nowhere else. Each tick (:meth:`Daemon.tick`)
is four named steps: observe (every probe concurrently, each with its own timeout;
a probe that fails or hangs marks its data stale and counts an error, and the loop
goes on), keep the budget (:mod:`kvguard.runtime.budget_keeping`), decide and act
(:class:`~kvguard.runtime.decision.Brain`), record. :meth:`Daemon.run` ticks, then
sleeps until :meth:`Daemon.next_interval` — the one place the poll interval is
computed. The clock and the sleep are injected so tests drive ticks without waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import structlog

from kvguard import __version__
from kvguard.actuators.proxy.shed_log import ShedLog
from kvguard.config.settings import Config
from kvguard.core import admission as admission_rules
from kvguard.core.budget import BudgetReport
from kvguard.core.snapshot import EngineStats, Snapshot
from kvguard.errors import InvalidInputError, ProbeError
from kvguard.probes.nvml import NvmlProbe
from kvguard.runtime.budget_keeping import BudgetKeeping, budget_for
from kvguard.runtime.decision import Brain, ControlOutcome
from kvguard.runtime.heap import TRIM_EVERY_S, trim_heap
from kvguard.runtime.probing import (
    DEFAULT_LOOP_STALL_S,
    DaemonState,
    LoopWatchdog,
    Probes,
    ProbeTracker,
)

if TYPE_CHECKING:
    from kvguard.actuators.dispatch import Actuators
    from kvguard.actuators.proxy import AdmissionProxy
    from kvguard.actuators.supervisor import Supervisor
    from kvguard.actuators.webhook import Webhooks

log = structlog.get_logger("kvguard.daemon")

# Poll at the minimum interval when the cache or the GPU is this close to full
# (earlyoom polls faster as headroom shrinks: the time to react is what is short).
FAST_POLL_KV_USAGE = 0.9
FAST_POLL_GPU_FREE_RATIO = 0.05
# Probes run concurrently, each under poll.timeout_s; a tick this much longer than
# that was held up by something that blocked the loop (a slow collector, a sync call).
TICK_OVERRUN_MARGIN_S = 0.5


def _admin_keys(config: Config) -> tuple[object, ...]:
    """What the engine's admin client was built from (it is built once, at start)."""
    engine = config.engine
    return (
        engine.url,
        engine.token,
        engine.shed_by_pause,
        engine.admin_timeout_s,
        engine.admin_attempts,
    )


class Daemon(BudgetKeeping):
    """Runs the probes every tick and keeps the budget and reconciliation current.

    ``loop_stall_s``: a timer the event loop runs this late is reported as a stall
    (:class:`LoopWatchdog`, while :meth:`run` runs).
    """

    def __init__(
        self,
        config: Config,
        *,
        probes: Probes | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        dry_run: bool = False,
        loop_stall_s: float = DEFAULT_LOOP_STALL_S,
        brain: Brain | None = None,
        budget: BudgetReport | None = None,
        proxy: AdmissionProxy | None = None,
        actuators: Actuators | None = None,
        supervisor: Supervisor | None = None,
        webhooks: Webhooks | None = None,
    ) -> None:
        self.config = config
        self.dry_run = dry_run
        if not loop_stall_s > 0:
            raise InvalidInputError("loop_stall_s", loop_stall_s, "must be > 0 seconds")
        self.loop_stall_s = loop_stall_s
        self._overrunning = False
        self.clock = clock
        self.wall_clock = wall_clock
        # Freed heap pages go back to the kernel once a minute (kvguard.runtime.heap: RSS
        # would otherwise creep up with fragmentation, like a leak).
        self.trim_heap: Callable[[], bool] = trim_heap
        self._heap_trimmed_at = clock()
        # The collaborators, built by kvguard.runtime.assembly.build_guard (a bare
        # Daemon, as tests build it, has none of them): the admission proxy, the
        # engine admin and fp8 switch, the supervised engine and the webhooks.
        self.webhooks = webhooks
        self.brain = brain or Brain(config, dry_run=dry_run, on_event=self.notify)
        self.mitigations = self.brain.mitigations
        self.proxy = proxy
        # The proxy's sheds, summed into a `requests_shed` line at most every 10 s.
        self._shed_log = ShedLog(proxy.counters) if proxy is not None else None
        self.actuators = actuators
        self.supervisor = supervisor
        self.probes = probes or Probes.from_config(config, self._engine_command())
        self.state = DaemonState(started_at=clock())
        self.state.trackers = {name: ProbeTracker(p) for name, p in self.probes.all().items()}
        self._budget_memory: int | None = None
        # The engine's 8-bit KV dtype while [model] says otherwise (kvguard's fp8 switch,
        # or an operator's): the budget follows the engine, or every figure is 2x off.
        self._engine_kv_dtype: str | None = None
        self.version = __version__
        self._reported_mismatch: int | None = None
        self._engine_cache: dict[str, object] | None = None
        self._nvml_total: int | None = None
        self._closing: list[asyncio.Task[None]] = []
        if budget is not None:  # computed by the assembly (the proxy needed it first)
            self._adopt_budget(budget, config.gpu.memory_bytes)
        else:
            self.refresh_budget()

    # ------------------------------------------------------------------ one tick
    async def tick(self) -> Snapshot:
        """One tick: observe, keep the budget, decide and act, record; returns the snapshot."""
        started = self.clock()
        snapshot = await self._observe()
        self._keep_budget(snapshot)
        self._decide_and_act(snapshot)
        self._record(snapshot, started)
        return snapshot

    async def _observe(self) -> Snapshot:
        """Run every probe once (concurrently, each with its timeout) into one snapshot."""
        host = self.probes.host
        if self.supervisor is not None and host is not None:
            host.follow(self.supervisor.pid)  # the engine kvguard started (it may restart)
        nvml = self.probes.nvml
        # Opt-in ([gpu] follow_engine): NVML reports PIDs of the host's namespace, which
        # in a container match nothing, so following by PID there would watch no GPU.
        follow = self.supervisor is not None and self.config.gpu.follow_engine
        if follow and self.supervisor is not None and nvml is not None:
            nvml.follow(self.supervisor.pid)
        trackers = self.state.trackers
        await asyncio.gather(*(self._sample(name, t) for name, t in trackers.items()))
        now = self.clock()
        return Snapshot(
            taken_at=now,
            gpus=trackers["nvml"].value if "nvml" in trackers else None,
            host=trackers["host"].value if "host" in trackers else None,
            engine=self._engine_view(trackers["engine"]),
            sources={name: t.reading(now) for name, t in trackers.items()},
        )

    def _keep_budget(self, snapshot: Snapshot) -> None:
        """The budget on the GPUs' real total, reconciled with what the engine reports."""
        gpus = snapshot.gpus
        if gpus:
            self._nvml_total = min(g.total_bytes for g in gpus)
            if self.config.gpu.memory_bytes is None:
                self._refresh_budget_safely(self._nvml_total)
        trackers = self.state.trackers
        fresh = trackers["engine"].ok if "engine" in trackers else False
        self._reconcile(snapshot.engine if fresh else None)

    def _decide_and_act(self, snapshot: Snapshot) -> None:
        """The decision step: forecast, pattern, ladder; its plan put in force (live mode)."""
        actuators = self.actuators
        if actuators is not None:
            actuators.set_kind(self.probes.engine.kind)
            self.brain.unavailable = actuators.unavailable()
        self.brain.step(snapshot, self.wall_clock())
        if self.proxy is not None:
            # Re-reserve answers past their learned length (the long ones a pool runs
            # out on) and cancel if the pool would not last until kvguard can act
            # again: two of the intervals it will wait now. Not two of its shortest:
            # after a calm spell the next tick comes a whole interval later, and a
            # burst of answers admitted at a short learned length fills a small pool
            # in less than that (found by an adversarial client run).
            self.proxy.review_reservations(
                snapshot.taken_at,
                admission_rules.OVERRUN_READINGS_AHEAD * self.next_interval(),
            )
        self._say_shed()
        # The engine's fresh count of what it holds may leave room for requests waiting.
        self._recheck_held_requests()

    def _record(self, snapshot: Snapshot, started: float) -> None:
        """Publish the tick for the exporter and /status; report a tick that overran."""
        now = snapshot.taken_at
        state = self.state
        state.snapshot = snapshot
        state.ticks_total += 1
        state.tick_duration_s = now - started
        state.last_tick_at = now
        budget_s = self.config.poll.timeout_s + TICK_OVERRUN_MARGIN_S
        overran = state.tick_duration_s > budget_s
        if overran:
            state.tick_overruns_total += 1
        if overran and not self._overrunning:  # once per run of slow ticks, not per tick
            log.warning(
                "tick_overran",
                duration_s=round(state.tick_duration_s, 3),
                budget_s=budget_s,
                probes={n: round(t.duration_s, 3) for n, t in state.trackers.items()},
            )
        self._overrunning = overran

    async def _sample(self, name: str, tracker: ProbeTracker[Any]) -> None:
        started = self.clock()
        try:
            value = await asyncio.wait_for(tracker.probe.sample(), self.config.poll.timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            self._failed(name, tracker, f"timed out after {self.config.poll.timeout_s:g} s")
        except Exception as exc:  # noqa: BLE001 - any probe bug must not stop the loop
            if not isinstance(exc, ProbeError):
                self._failed(name, tracker, f"unexpected {type(exc).__name__}: {exc}")
            elif not tracker.probe.available:
                # A source that is not there (no NVIDIA driver) is not failing: the
                # probe said so once; counting it every tick would only page people.
                tracker.ok, tracker.error = False, str(exc)
            else:
                self._failed(name, tracker, str(exc))
        else:
            if not tracker.ok and tracker.ever_failed:
                log.info("probe_recovered", probe=name)
            tracker.value, tracker.read_at, tracker.ok, tracker.error = (
                value,
                self.clock(),
                True,
                None,
            )
        finally:
            tracker.duration_s = self.clock() - started

    def _failed(self, name: str, tracker: ProbeTracker[Any], error: str) -> None:
        if tracker.ok or not tracker.ever_failed or tracker.error != error:
            # One event per change of state, not one per tick: a dead engine must
            # not flood the log at two lines a second.
            log.warning("probe_failed", probe=name, error=error)
        tracker.ok, tracker.error, tracker.ever_failed = False, error, True
        tracker.errors_total += 1

    def _engine_view(self, tracker: ProbeTracker[EngineStats]) -> EngineStats | None:
        """The engine as last seen; marked down while its probe fails."""
        if tracker.value is None:
            return None
        return tracker.value if tracker.ok else replace(tracker.value, up=False)

    def notify(self, event: str, fields: dict[str, Any]) -> None:
        """Send an event to the webhooks, if any (never blocks, never raises)."""
        if self.webhooks is not None:
            self.webhooks.notify(event, **fields)

    # ------------------------------------------------------------------ the loop
    def next_interval(self) -> float:
        """Seconds from one tick's start to the next's.

        The minimum interval while headroom is small, and while an escalation waits
        for confirmation: it takes ``confirm_ticks`` ticks, so at the full interval
        a confirmed ``high`` would come ``confirm_ticks`` x ``interval_s`` late.
        """
        poll = self.config.poll
        snapshot = self.state.snapshot
        if snapshot is None:
            return poll.interval_s
        decision = self.brain.decision
        if decision is not None and decision.state.pending is not None:
            return poll.min_interval_s
        usage = snapshot.engine.kv_cache_usage_ratio if snapshot.engine else None
        demand = decision.signals.kv_demand if decision is not None else None
        if max(usage or 0.0, demand or 0.0) >= FAST_POLL_KV_USAGE:
            return poll.min_interval_s
        for gpu in snapshot.gpus or ():
            if gpu.total_bytes and gpu.free_bytes / gpu.total_bytes <= FAST_POLL_GPU_FREE_RATIO:
                return poll.min_interval_s
        return self._interval_for_headroom(poll.min_interval_s, poll.interval_s)

    def _interval_for_headroom(self, shortest: float, longest: float) -> float:
        """The time the headroom lasts at the worst fill rate seen, clamped (earlyoom's rule).

        Headroom is the KV tokens left under ``high``'s usage threshold; the worst
        fill rate is the larger of the demand's slope and the engine's prompt +
        answer token rates (what could arrive if nothing finished). A burst that
        could fill the headroom within one interval is then seen within it.
        """
        fc = self.brain.forecast
        if fc is None or fc.kv.level is None or not fc.kv.capacity:
            return longest
        threshold = self.config.policy.high.kv_usage or FAST_POLL_KV_USAGE
        headroom = threshold * fc.kv.capacity - fc.kv.level
        fills = (
            fc.kv.slope_per_s,
            (fc.prompt_fill_per_s or 0.0) + (fc.generation_fill_per_s or 0.0),
        )
        worst = max((f for f in fills if f is not None and math.isfinite(f)), default=0.0)
        if worst <= 0:
            return longest
        return min(longest, max(shortest, headroom / worst))

    def maybe_trim_heap(self) -> None:
        """Return freed heap memory to the kernel if ``TRIM_EVERY_S`` passed since the last time."""
        now = self.clock()
        if now - self._heap_trimmed_at >= TRIM_EVERY_S:
            self._heap_trimmed_at = now
            self.trim_heap()

    async def run(
        self,
        stop: asyncio.Event,
        *,
        after_tick: Callable[[Snapshot], Awaitable[None] | None] | None = None,
    ) -> None:
        """Tick until ``stop`` is set; a set ``stop`` lets the current tick finish.

        Ticks start :meth:`next_interval` apart: the wait after a tick is the interval
        less the time the tick (and ``after_tick``) took, never below zero, so a
        0.05 s interval gives 20 ticks a second while a tick takes under 0.05 s.
        The loop watchdog (:class:`LoopWatchdog`) runs beside the ticks meanwhile.
        """
        watchdog = asyncio.ensure_future(LoopWatchdog(self.state, stall_s=self.loop_stall_s).run())
        try:
            while not stop.is_set():
                started = self.clock()
                snapshot = await self.tick()
                if after_tick is not None:
                    result = after_tick(snapshot)
                    if result is not None:
                        await result
                self.maybe_trim_heap()
                elapsed = self.clock() - started
                await self._wait(stop, max(0.0, self.next_interval() - elapsed))
        finally:
            watchdog.cancel()
            await asyncio.gather(watchdog, return_exceptions=True)

    async def _wait(self, stop: asyncio.Event, seconds: float) -> None:
        """Wait ``seconds`` or until ``stop`` is set; with nothing left, still yield once."""
        if seconds <= 0:
            await asyncio.sleep(0)  # an overrunning loop must not starve the server
            return
        with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)

    def reload(self, config: Config) -> None:
        """Adopt a new, already validated config, all or nothing.

        The new budget and probes are built first; if either fails, the error
        propagates and nothing changed. Probes are rebuilt only when their settings
        changed, and keep their error counts.
        """
        old = self.config
        budget_changed = (
            old.model != config.model or old.gpu.memory_bytes != config.gpu.memory_bytes
        )
        budget = (
            budget_for(config, config.gpu.memory_bytes or self._nvml_total, self._engine_kv_dtype)
            if budget_changed
            else None
        )
        probes_changed = (old.engine, old.gpu, old.poll) != (
            config.engine,
            config.gpu,
            config.poll,
        ) or (old.engine.token != config.engine.token)
        probes = Probes.from_config(config, self._engine_command()) if probes_changed else None
        if probes is not None:
            new, before = probes.nvml, self.probes.nvml
            if isinstance(new, NvmlProbe) and isinstance(before, NvmlProbe):
                new.continue_from(before)  # NVML's state is the host's, not the config's
        # These are built once at start (the engine's admin client, the fp8 switch, the
        # supervisor, the webhooks): say so rather than pretend they changed.
        kept = [
            name
            for name, before, after in (
                ("reconfigure", old.reconfigure, config.reconfigure),
                ("webhook", old.webhook, config.webhook),
                ("webhook.secret", old.webhook.secret, config.webhook.secret),
                ("engine (admin client)", _admin_keys(old), _admin_keys(config)),
                ("proxy", old.proxy, config.proxy),
                ("server.listen", old.server.listen, config.server.listen),
            )
            if before != after
        ]
        if kept:
            log.warning("reload_needs_restart", sections=kept, hint="restart kvguard to apply them")
        # What needs a restart stays as it runs, so /status (and /admit, /readyz, which
        # read [proxy]) report what is really in force until that restart.
        config = replace(
            config,
            reconfigure=old.reconfigure,
            webhook=old.webhook,
            proxy=old.proxy,
            server=replace(config.server, listen=old.server.listen),
        )
        # Nothing below raises: the swap is complete or never started.
        self.config = config
        self.brain.reconfigure(config)
        if probes is not None:
            self._closing.append(
                asyncio.get_running_loop().create_task(self._close_probes(self.probes))
            )
            self.probes = probes
            trackers: dict[str, ProbeTracker[Any]] = {}
            for name, probe in probes.all().items():
                previous = self.state.trackers.get(name)
                trackers[name] = ProbeTracker(probe)
                if previous is not None:
                    trackers[name].errors_total = previous.errors_total
                    trackers[name].ever_failed = previous.ever_failed
            self.state.trackers = trackers
        if budget_changed:
            self.state.budget = budget
            self._budget_memory = config.gpu.memory_bytes or self._nvml_total
            self.state.reconciliation = None
        log.info("config_reloaded", source=config.source)

    def _engine_command(self) -> list[str] | None:
        """The supervised engine's command line (it says llama.cpp's cache layout), if any."""
        return self.supervisor.argv if self.supervisor is not None else None

    def _say_shed(self, *, final: bool = False) -> None:
        """Log what the proxy shed since the last ``requests_shed`` line, when it is due."""
        if self._shed_log is not None:
            shed = self._shed_log.due(self.clock(), final=final)
            if shed is not None:
                log.info("requests_shed", **shed)

    async def close(self) -> None:
        """Release every probe's resources (and wait for probes replaced by reloads)."""
        self._say_shed(final=True)  # a burst's sheds not yet said are not left unsaid
        await asyncio.gather(*self._closing, return_exceptions=True)
        await self._close_probes(self.probes)

    @staticmethod
    async def _close_probes(probes: Probes) -> None:
        results = await asyncio.gather(
            *(probe.close() for probe in probes.all().values()), return_exceptions=True
        )
        for result in results:  # closing one must not stop the others
            if isinstance(result, Exception):
                log.warning("probe_close_failed", error=str(result))

    # ---- control (called by the HTTP API)
    def switch_in_progress(self) -> str | None:
        """Why the mode must not change now (the fp8 switch is under way), or None."""
        actuators = self.actuators
        if self.mitigations.draining or (actuators is not None and actuators.switch_busy):
            return (
                "the fp8 KV switch is draining or restarting the engine; retry when it is done"
                " (/status -> actions.reconfigure.busy)"
            )
        return None

    def set_dry_run(self, dry_run: bool, reason: str) -> ControlOutcome:
        """Switch to dry-run or live (``/control/dry-run|live``), for ``reason``.

        Refused (nothing changes) while the fp8 switch is under way:
        :meth:`switch_in_progress` says why. Requests the proxy holds for room are
        re-checked against what is in force now.
        """
        refused = self.switch_in_progress()
        if refused is not None:
            return ControlOutcome(changed=False, refused=refused)
        fp8_on = self.actuators is not None and self.actuators.kv_fp8
        changed = self.brain.set_dry_run(dry_run, reason, now=self.clock(), fp8_on=fp8_on)
        self.dry_run = dry_run
        self._recheck_held_requests()
        return ControlOutcome(changed=changed)

    def release(self, reason: str) -> ControlOutcome:
        """Lift every mitigation in force now (``/control/release``), for ``reason``."""
        released = tuple(self.brain.release(reason))
        self._recheck_held_requests()
        return ControlOutcome(changed=bool(released), released=released)

    def _recheck_held_requests(self) -> None:
        if self.proxy is not None:
            self.proxy.wake()  # requests held for room re-check against what is in force
