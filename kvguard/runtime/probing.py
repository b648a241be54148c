"""What the loop keeps per source: the probes it runs, their last readings, the loop's health.

:class:`Probes` is the set of probes one daemon runs; :class:`ProbeTracker` keeps
one probe's last good value, staleness and errors; :class:`DaemonState` is what
the exporter and ``/status`` read; :class:`LoopWatchdog` measures how late the event
loop runs.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import structlog

from kvguard.actuators.engine_flags import llamacpp_kv_unified
from kvguard.config.settings import Config
from kvguard.core.snapshot import HostStats, Snapshot, SourceReading
from kvguard.probes.base import EngineSource, FollowingProbe, GpuSource, Probe
from kvguard.probes.engine import EngineProbe
from kvguard.probes.host import HostProbe
from kvguard.probes.nvml import GpuSelector, NvmlProbe

if TYPE_CHECKING:
    from kvguard.core.budget import BudgetReport
    from kvguard.runtime.budget_keeping import Reconciliation

T = TypeVar("T")
log = structlog.get_logger("kvguard.daemon")

# The loop watchdog wakes this often and reports the loop stalled when a wake-up is
# this late: a stalled loop also stalls the proxy and the HTTP API, not only the ticks.
LOOP_WATCH_PERIOD_S = 0.1
DEFAULT_LOOP_STALL_S = 1.0


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
        return SourceReading(self.ok, age, self.error, self.probe.available)


@dataclass
class Probes:
    """The probes one daemon runs; built from the config, or injected by tests."""

    engine: EngineSource
    nvml: GpuSource | None
    host: FollowingProbe[HostStats] | None

    @classmethod
    def from_config(
        cls,
        config: Config,
        engine_command: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Probes:
        """Probes for the engine, the selected GPUs and the host/engine process.

        ``engine_command``: the engine kvguard supervises (with ``env``, default the
        process environment), where llama.cpp's cache layout is read from when
        ``[engine] kv_unified`` does not declare it.
        """
        engine = config.engine
        kv_unified = engine.kv_unified
        if kv_unified is None and engine_command:
            kv_unified = llamacpp_kv_unified(engine_command, os.environ if env is None else env)
        token = engine.token.reveal() if engine.token is not None else None
        # The engine's PID picks its GPUs only when [gpu] selects none (as documented).
        explicit = bool(config.gpu.indices or config.gpu.uuids)
        pids = (engine.pid,) if engine.pid is not None and not explicit else ()
        return cls(
            engine=EngineProbe(
                engine.url,
                kind=engine.kind,
                metrics_path=engine.metrics_path,
                metrics_url=engine.metrics_url,
                health_url=engine.health_url,
                token=token,
                timeout_s=config.poll.timeout_s,
                kv_unified=kv_unified,
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
