"""The loop: observe every source, build one snapshot per tick, keep the budget, decide.

Time and concurrency live here and nowhere else. Each tick runs every probe
concurrently with its own timeout; a probe that fails or hangs marks its data
stale and counts an error, and the loop goes on. The clock and the sleep are
injected so tests drive ticks without waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import structlog

from kvguard import __version__
from kvguard.actuators.proxy import AdmissionProxy
from kvguard.config.model_files import load_model_files
from kvguard.config.settings import Config
from kvguard.core.budget import BudgetReport, budget_inputs_from, plan_budget
from kvguard.core.snapshot import EngineStats, GpuMemory, HostStats, Snapshot, SourceReading
from kvguard.core.units import DTYPE_BYTES
from kvguard.errors import InvalidInputError, KvguardError, ProbeError
from kvguard.probes.base import Probe
from kvguard.probes.engine import EngineProbe
from kvguard.probes.host import HostProbe
from kvguard.probes.nvml import GpuSelector, NvmlProbe
from kvguard.runtime.decision import Brain
from kvguard.runtime.heap import TRIM_EVERY_S, trim_heap

if TYPE_CHECKING:
    from kvguard.actuators.dispatch import Actuators
    from kvguard.actuators.supervisor import Supervisor
    from kvguard.actuators.webhook import Webhooks

T = TypeVar("T")
log = structlog.get_logger("kvguard.daemon")

# Poll at the minimum interval when the cache or the GPU is this close to full
# (earlyoom polls faster as headroom shrinks: the time to react is what is short).
FAST_POLL_KV_USAGE = 0.9
FAST_POLL_GPU_FREE_RATIO = 0.05
# A reported KV capacity this far from the budget's prediction is logged.
RECONCILIATION_TOLERANCE = 0.05
# The loop watchdog wakes this often and reports the loop stalled when a wake-up is
# this late: a stalled loop also stalls the proxy and the HTTP API, not only the ticks.
LOOP_WATCH_PERIOD_S = 0.1
DEFAULT_LOOP_STALL_S = 1.0
# Probes run concurrently, each under poll.timeout_s; a tick this much longer than
# that was held up by something that blocked the loop (a slow collector, a sync call).
TICK_OVERRUN_MARGIN_S = 0.5


def budget_for(
    config: Config, gpu_memory_bytes: int | None, kv_cache_dtype: str | None = None
) -> BudgetReport | None:
    """The VRAM budget of ``config``'s ``[model]`` on GPUs of ``gpu_memory_bytes``.

    ``kv_cache_dtype`` replaces ``[model] kv_cache_dtype`` (the engine's, after an fp8
    switch). None without ``model.config``; raises :class:`KvguardError` for an
    unusable one.
    """
    model = config.model
    if model.config is None:
        return None
    files = load_model_files(model.config)
    overrides: dict[str, object] = {"gpu_memory_bytes": gpu_memory_bytes}
    if kv_cache_dtype is not None:
        overrides["kv_cache_dtype"] = kv_cache_dtype
    inputs = budget_inputs_from(model, **overrides)
    return plan_budget(
        files.config, inputs, index_total_size=files.index_total_size, source=files.source
    )


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


@dataclass
class ProbeTracker(Generic[T]):
    """One probe's last good value, its staleness and its error count."""

    probe: Probe[T]
    value: T | None = None
    read_at: float | None = None
    ok: bool = False
    error: str | None = None
    errors_total: int = 0
    duration_s: float = 0.0
    ever_failed: bool = False

    def reading(self, now: float) -> SourceReading:
        """The source's state for the snapshot."""
        age = None if self.read_at is None else now - self.read_at
        available = getattr(self.probe, "available", True) is not False
        return SourceReading(self.ok, age, self.error, available)


@dataclass(frozen=True)
class Reconciliation:
    """The budget's predicted KV capacity against what the engine reports."""

    predicted_tokens: int
    reported_tokens: int

    @property
    def difference_tokens(self) -> int:
        """Reported minus predicted: positive when the engine got more than forecast."""
        return self.reported_tokens - self.predicted_tokens

    @property
    def difference_ratio(self) -> float | None:
        """The difference relative to the prediction."""
        return self.difference_tokens / self.predicted_tokens if self.predicted_tokens else None


@dataclass
class Probes:
    """The probes one daemon runs; built from the config, or injected by tests."""

    engine: Probe[EngineStats]
    nvml: Probe[tuple[GpuMemory, ...]] | None
    host: Probe[HostStats] | None

    @classmethod
    def from_config(cls, config: Config) -> Probes:
        """Probes for the engine, the selected GPUs and the host/engine process."""
        engine = config.engine
        token = engine.token.reveal() if engine.token is not None else None
        # The engine's PID picks its GPUs only when [gpu] selects none (as documented).
        explicit = bool(config.gpu.indices or config.gpu.uuids)
        pids = (engine.pid,) if engine.pid is not None and not explicit else ()
        return cls(
            engine=EngineProbe(
                engine.url,
                kind=engine.kind,
                metrics_path=engine.metrics_path,
                token=token,
                timeout_s=config.poll.timeout_s,
            ),
            nvml=NvmlProbe(
                GpuSelector(config.gpu.indices, config.gpu.uuids, pids),
                timeout_s=config.poll.timeout_s,
            ),
            host=HostProbe(pid=engine.pid, process_name=engine.process_name),
        )

    def all(self) -> dict[str, Probe[Any]]:
        """Every configured probe by name."""
        probes: dict[str, Probe[Any]] = {"engine": self.engine}
        if self.nvml is not None:
            probes["nvml"] = self.nvml
        if self.host is not None:
            probes["host"] = self.host
        return probes


@dataclass
class DaemonState:
    """What the exporter and /status read: the latest of everything."""

    snapshot: Snapshot | None = None
    budget: BudgetReport | None = None
    budget_error: str | None = None
    reconciliation: Reconciliation | None = None
    ticks_total: int = 0
    tick_duration_s: float = 0.0
    last_tick_at: float | None = None
    started_at: float = 0.0
    trackers: dict[str, ProbeTracker[Any]] = field(default_factory=dict)
    tick_overruns_total: int = 0
    loop_lag_s: float = 0.0  # how late the loop watchdog's latest wake-up was
    loop_lag_max_s: float = 0.0
    loop_stalls_total: int = 0


class LoopWatchdog:
    """Measures how late the event loop runs a timer, and reports stalls.

    Everything kvguard serves (ticks, the proxy, /metrics) shares one loop: a probe or
    a collector that blocks it stops them all, and ``asyncio.wait_for`` cannot time
    out a call that never yields. The watchdog cannot stop such a call either; it
    makes it visible: ``kvguard_event_loop_lag_seconds``,
    ``kvguard_event_loop_stalls_total`` and one ``event_loop_stalled`` log event per
    stall. It uses the loop's own clock (what is measured is the loop, not the
    daemon's injected clock).
    """

    def __init__(
        self, state: DaemonState, *, stall_s: float, period_s: float = LOOP_WATCH_PERIOD_S
    ) -> None:
        self.state = state
        self.stall_s = stall_s
        self.period_s = period_s

    async def run(self) -> None:
        """Watch until cancelled."""
        loop = asyncio.get_running_loop()
        state = self.state
        while True:
            due = loop.time() + self.period_s
            await asyncio.sleep(self.period_s)
            lag = max(0.0, loop.time() - due)
            state.loop_lag_s = lag
            state.loop_lag_max_s = max(state.loop_lag_max_s, lag)
            if lag >= self.stall_s:
                state.loop_stalls_total += 1
                log.warning(
                    "event_loop_stalled",
                    stalled_s=round(lag, 3),
                    threshold_s=self.stall_s,
                    hint="a probe, collector or handler blocked the loop; see"
                    " kvguard_probe_duration_seconds and kvguard_tick_duration_seconds",
                )


class Daemon:
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
        self.brain = Brain(config, dry_run=dry_run)
        self.mitigations = self.brain.mitigations
        self.proxy: AdmissionProxy | None = None  # set by the server when [proxy] is enabled
        # Set by `kvguard run` (kvguard.runtime.wiring): engine admin, the fp8 switch,
        # the supervised engine and the webhooks.
        self.actuators: Actuators | None = None
        self.supervisor: Supervisor | None = None
        self.webhooks: Webhooks | None = None
        self.brain.on_event = self.notify
        self.probes = probes or Probes.from_config(config)
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
        self.refresh_budget()

    # ------------------------------------------------------------------ budget
    def refresh_budget(self, nvml_total: int | None = None) -> None:
        """(Re)compute the budget from the config, with NVML's total when no override."""
        model, gpu = self.config.model, self.config.gpu
        if model.config is None:
            self.state.budget = None
            return
        memory = gpu.memory_bytes or nvml_total
        if self.state.budget is not None and memory == self._budget_memory:
            return
        self.state.budget = budget_for(self.config, memory, self._engine_kv_dtype)
        self._budget_memory = memory
        assert self.state.budget is not None  # noqa: S101 - model.config is set
        log.info(
            "budget_computed",
            model=model.config,
            gpu_memory_bytes=self.state.budget.budget.gpu_memory_bytes,
            kv_capacity_tokens=self.state.budget.budget.kv_capacity_tokens,
            kv_cache_dtype=self.state.budget.budget.kv_cache_dtype,
            fits=self.state.budget.budget.fits,
        )

    def _follow_engine_kv_dtype(self, engine: EngineStats) -> None:
        """Budget with the engine's 8-bit KV dtype while ``[model]`` names a wider one.

        After an fp8 switch (kvguard's, or an operator's restart with
        ``--kv-cache-dtype fp8``) the engine holds twice the tokens the configured
        dtype gives: without this, the budget and its reconciliation report a 2x
        mismatch for as long as the switch lasts. Back to a wider dtype, back to the
        configured one. An engine that does not say its dtype changes nothing.
        """
        reported = (engine.cache_dtype or "").strip().lower()
        if not reported:
            return
        configured = self.config.model.kv_cache_dtype.strip().lower()
        # "auto" (the model's dtype: what a revert restarts with) or any wider one: back
        # to the configured dtype.
        eight_bit = DTYPE_BYTES.get(reported) == 1
        follow = reported if eight_bit and DTYPE_BYTES.get(configured) != 1 else None
        if follow == self._engine_kv_dtype:
            return
        if self.config.model.config is None:
            self._engine_kv_dtype = follow
            return
        try:  # computed first: a failure keeps the budget there is
            budget = budget_for(self.config, self._budget_memory, follow)
        except KvguardError as exc:
            self._budget_failed(exc)
            return
        self._engine_kv_dtype = follow
        self.state.budget = budget
        self._reported_mismatch = None
        log.info(
            "budget_follows_engine_kv_dtype",
            engine_kv_cache_dtype=reported,
            configured_kv_cache_dtype=configured,
            budget_kv_cache_dtype=follow or configured,
        )

    # ------------------------------------------------------------------ one tick
    async def tick(self) -> Snapshot:
        """Run every probe once (concurrently, each with its timeout) and publish a snapshot."""
        started = self.clock()
        host = self.probes.host
        if self.supervisor is not None and isinstance(host, HostProbe):
            host.follow(self.supervisor.pid)  # the engine kvguard started (it may restart)
        nvml = self.probes.nvml
        # Opt-in ([gpu] follow_engine): NVML reports PIDs of the host's namespace, which
        # in a container match nothing, so following by PID there would watch no GPU.
        follow = self.supervisor is not None and self.config.gpu.follow_engine
        if follow and self.supervisor is not None and isinstance(nvml, NvmlProbe):
            nvml.follow(self.supervisor.pid)
        trackers = self.state.trackers
        await asyncio.gather(*(self._sample(name, t) for name, t in trackers.items()))
        now = self.clock()
        snapshot = Snapshot(
            taken_at=now,
            gpus=trackers["nvml"].value if "nvml" in trackers else None,
            host=trackers["host"].value if "host" in trackers else None,
            engine=self._engine_view(trackers["engine"]),
            sources={name: t.reading(now) for name, t in trackers.items()},
        )
        gpus = snapshot.gpus
        if gpus:
            self._nvml_total = min(g.total_bytes for g in gpus)
            if self.config.gpu.memory_bytes is None:
                self._refresh_budget_safely(self._nvml_total)
        fresh = trackers["engine"].ok if "engine" in trackers else False
        self._reconcile(snapshot.engine if fresh else None)
        actuators = self.actuators
        if actuators is not None:
            actuators.set_kind(getattr(self.probes.engine, "kind", None))
            self.brain.unavailable = actuators.unavailable()
        self.brain.step(snapshot, self.wall_clock())
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
                probes={n: round(t.duration_s, 3) for n, t in trackers.items()},
            )
        self._overrunning = overran
        return snapshot

    async def _sample(self, name: str, tracker: ProbeTracker[Any]) -> None:
        started = self.clock()
        try:
            value = await asyncio.wait_for(tracker.probe.sample(), self.config.poll.timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            self._failed(name, tracker, f"timed out after {self.config.poll.timeout_s:g} s")
        except Exception as exc:  # noqa: BLE001 - any probe bug must not stop the loop
            if not isinstance(exc, ProbeError):
                self._failed(name, tracker, f"unexpected {type(exc).__name__}: {exc}")
            elif getattr(tracker.probe, "available", True) is False:
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

    def _refresh_budget_safely(self, nvml_total: int | None) -> None:
        try:
            self.refresh_budget(nvml_total)
        except KvguardError as exc:  # keep the previous budget; say why once
            self._budget_failed(exc)

    def _budget_failed(self, exc: KvguardError) -> None:
        """Log a budget that could not be computed, once per distinct reason."""
        if self.state.budget_error != str(exc):
            log.warning("budget_failed", error=str(exc))
        self.state.budget_error = str(exc)

    def _reconcile(self, engine: EngineStats | None) -> None:
        if engine is not None:
            self._notice_cache_change(engine)
            self._follow_engine_kv_dtype(engine)
        budget = self.state.budget
        if budget is None or engine is None or engine.kv_capacity_tokens is None:
            return
        rec = Reconciliation(budget.budget.kv_capacity_tokens, engine.kv_capacity_tokens)
        self.state.reconciliation = rec
        ratio = rec.difference_ratio
        mismatch = ratio is not None and abs(ratio) > RECONCILIATION_TOLERANCE
        if mismatch and self._reported_mismatch != rec.reported_tokens:
            log.warning(
                "budget_reconciliation_mismatch",
                predicted_kv_capacity_tokens=rec.predicted_tokens,
                reported_kv_capacity_tokens=rec.reported_tokens,
                difference_ratio=round(ratio or 0.0, 4),
            )
            self._reported_mismatch = rec.reported_tokens

    def _notice_cache_change(self, engine: EngineStats) -> None:
        """Log when the engine's KV cache changes shape: it restarted with other settings."""
        cache: dict[str, object] = {
            "kv_capacity_tokens": engine.kv_capacity_tokens,
            "block_size": engine.block_size,
            "cache_dtype": engine.cache_dtype,
        }
        if all(value is None for value in cache.values()):
            return  # this engine does not say; nothing to compare
        before = self._engine_cache
        self._engine_cache = cache
        if before is not None and before != cache:
            # Before the reconciliation line: an operator reads why the numbers moved.
            log.warning("engine_cache_changed", before=before, after=cache)
            self.notify("engine_cache_changed", {"before": before, "after": cache})

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
        return poll.interval_s

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
        probes = Probes.from_config(config) if probes_changed else None
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
            )
            if before != after
        ]
        if kept:
            log.warning("reload_needs_restart", sections=kept, hint="restart kvguard to apply them")
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

    async def close(self) -> None:
        """Release every probe's resources (and wait for probes replaced by reloads)."""
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
