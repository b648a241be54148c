"""The loop: one snapshot per tick, staleness and errors, budget and reconciliation."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from structlog.testing import capture_logs

from kvguard.actuators.proxy import AdmissionProxy, ProxySettings
from kvguard.api.status import status_document
from kvguard.api.telemetry import (
    PROXY_ERROR_CODES,
    REJECT_REASONS,
    SHED_SERIES,
    daemon_registry,
)
from kvguard.config.settings import parse_config
from kvguard.core.forecast import Forecast, ResourceForecast
from kvguard.core.snapshot import EngineShare, EngineStats, GpuMemory, HostStats
from kvguard.core.units import GiB
from kvguard.errors import KvguardError, ProbeError
from kvguard.runtime.daemon import Daemon
from kvguard.runtime.probing import Probes


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class ScriptedProbe:
    """A probe that returns its current value, raises its current error, or hangs."""

    name: str
    value: object = None
    error: str | None = None
    hang: bool = False
    available: bool = True
    closed: bool = False
    calls: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)
    # What the engine's and the process-watching probes also offer (kvguard.probes.base).
    kind: str | None = None
    actions: frozenset[str] = frozenset()
    followed: int | None = None

    def follow(self, pid: int | None) -> None:
        self.followed = pid

    async def sample(self) -> object:
        self.calls += 1
        if self.hang:
            await self.release.wait()
        if self.error is not None:
            raise ProbeError(self.name, self.error)
        return self.value

    async def close(self) -> None:
        self.closed = True


def engine_stats(**fields: object) -> EngineStats:
    """A vLLM engine reading with sensible defaults."""
    base = {"kind": "vllm", "up": True, "kv_cache_usage_ratio": 0.5, "requests_running": 3.0}
    return EngineStats(**(base | fields))  # type: ignore[arg-type]


GPU = GpuMemory(0, "GPU-0", "Fake H100", 80 * GiB, 60 * GiB, 20 * GiB, 1 * GiB)


def make(config: dict | None = None, **probe_values: object) -> tuple[Daemon, Probes, Clock]:
    """A daemon over scripted probes and a hand-moved clock."""
    data = {"engine": {"url": "http://127.0.0.1:1"}, "poll": {"timeout_s": 0.2}} | (config or {})
    probes = Probes(
        engine=ScriptedProbe("engine", probe_values.get("engine", engine_stats())),  # type: ignore[arg-type]
        nvml=ScriptedProbe("nvml", probe_values.get("nvml", (GPU,))),  # type: ignore[arg-type]
        host=ScriptedProbe("host", probe_values.get("host", HostStats(64 * GiB, 32 * GiB))),  # type: ignore[arg-type]
    )
    clock = Clock()
    return Daemon(parse_config(data, env={}), probes=probes, clock=clock), probes, clock


async def test_a_tick_bundles_every_probe_into_one_snapshot():
    """Engine, GPUs and host land in one snapshot, every source fresh."""
    daemon, _, clock = make()
    snapshot = await daemon.tick()
    assert snapshot.taken_at == clock.now
    assert snapshot.engine == engine_stats()
    assert snapshot.gpus == (GPU,)
    assert snapshot.host == HostStats(64 * GiB, 32 * GiB)
    assert all(r.ok and r.age_s == 0 for r in snapshot.sources.values())
    assert daemon.state.ticks_total == 1


async def test_a_failing_probe_goes_stale_and_counts_errors():
    """A probe that fails keeps its last value, ages, counts errors, and is logged once."""
    daemon, probes, clock = make()
    await daemon.tick()
    probes.nvml.error = "GPU is lost"  # type: ignore[union-attr]
    with capture_logs() as logs:
        for _ in range(3):
            clock.now += 0.5
            snapshot = await daemon.tick()
    reading = snapshot.sources["nvml"]
    assert (reading.ok, reading.error, reading.age_s) == (False, "nvml: GPU is lost", 1.5)
    assert snapshot.gpus == (GPU,)  # the last good value, marked stale by its source
    assert daemon.state.trackers["nvml"].errors_total == 3
    assert [e["event"] for e in logs] == ["probe_failed"]
    probes.nvml.error = None  # type: ignore[union-attr]
    with capture_logs() as logs:
        snapshot = await daemon.tick()
    assert snapshot.sources["nvml"].ok
    assert [e["event"] for e in logs] == ["probe_recovered"]


async def test_an_unreachable_engine_is_down_but_its_last_figures_remain():
    """While the engine probe fails, the engine is reported down."""
    daemon, probes, _ = make()
    await daemon.tick()
    probes.engine.error = "connection refused"  # type: ignore[union-attr]
    snapshot = await daemon.tick()
    assert snapshot.engine is not None
    assert snapshot.engine.up is False
    assert snapshot.engine.kv_cache_usage_ratio == 0.5


async def test_a_failed_engine_read_keeps_the_pool_projected_admission_uses():
    """A scrape that times out (the engine at its busiest) must not open the admission gate."""
    daemon, probes, clock = make(engine=engine_stats(kv_capacity_blocks=121, block_size=16))
    await daemon.tick()
    assert daemon.mitigations.pool_tokens == 120 * 16  # one null block holds no KV
    probes.engine.error = "no answer within 2 s"  # type: ignore[union-attr]
    clock.now += 0.5
    await daemon.tick()
    assert daemon.mitigations.pool_tokens == 120 * 16
    probes.engine.error = None  # type: ignore[union-attr]
    probes.engine.value = engine_stats(kv_capacity_blocks=241, block_size=16)  # type: ignore[union-attr]
    clock.now += 0.5
    await daemon.tick()
    assert daemon.mitigations.pool_tokens == 240 * 16  # restarted with more: the new pool


async def test_only_vllm_pools_lose_a_null_block():
    """SGLang's and TensorRT-LLM's capacities are what requests can hold, as reported."""
    sglang = engine_stats(
        kind="sglang", kv_capacity_tokens=121 * 16, kv_capacity_blocks=121, block_size=16
    )
    daemon, _, _ = make(engine=sglang)
    await daemon.tick()
    assert daemon.mitigations.pool_tokens == 121 * 16
    trtllm = engine_stats(kind="trtllm", kv_capacity_blocks=100, block_size=32)
    daemon, _, _ = make(engine=trtllm)
    await daemon.tick()
    assert daemon.mitigations.pool_tokens == 100 * 32


async def test_each_data_parallel_vllm_engine_has_its_own_null_block():
    """Two vLLM engines of 121 blocks each: 2 x 120 usable blocks, not 241."""
    shares = tuple(EngineShare(index=i, kv_capacity_blocks=121) for i in range(2))
    dp2 = engine_stats(kv_capacity_blocks=242, block_size=16, engines=shares)
    daemon, _, _ = make(engine=dp2)
    await daemon.tick()
    assert daemon.mitigations.pool_tokens == 240 * 16


async def test_a_hung_probe_does_not_stall_the_tick():
    """A probe that never answers times out; the tick completes with the others fresh."""
    daemon, probes, _ = make()
    probes.host.hang = True  # type: ignore[union-attr]
    snapshot = await asyncio.wait_for(daemon.tick(), 2.0)
    assert snapshot.sources["host"].ok is False
    assert snapshot.sources["host"].error == "timed out after 0.2 s"
    assert snapshot.sources["engine"].ok
    probes.host.release.set()  # type: ignore[union-attr]


async def test_budget_uses_nvml_total_and_reconciles_with_the_engine():
    """Without [gpu] memory the budget is computed on NVML's total and compared with the engine."""
    config = {"model": {"config": "llama-3.1-8b", "max_model_len": 8192}}
    daemon, probes, _ = make(config)
    assert daemon.state.budget is not None
    assert daemon.state.budget.budget.gpu_memory_bytes == 80 * GiB  # the default until NVML answers
    predicted = None
    probes.nvml.value = (GpuMemory(0, "GPU-0", "L4", 24 * GiB, 1 * GiB, 23 * GiB, 0),)  # type: ignore[union-attr]
    probes.engine.value = engine_stats(kv_capacity_tokens=100_000)  # type: ignore[union-attr]
    with capture_logs() as logs:
        await daemon.tick()
        await daemon.tick()
    budget = daemon.state.budget.budget
    assert budget.gpu_memory_bytes == 24 * GiB
    predicted = budget.kv_capacity_tokens
    rec = daemon.state.reconciliation
    assert rec is not None
    assert (rec.predicted_tokens, rec.reported_tokens) == (predicted, 100_000)
    assert rec.difference_tokens == 100_000 - predicted
    mismatches = [e for e in logs if e["event"] == "budget_reconciliation_mismatch"]
    assert len(mismatches) == 1  # once per reported value, not every tick


async def test_the_budget_follows_the_engine_to_an_fp8_kv_cache_and_back():
    """After an fp8 switch the budget holds twice the tokens; back to bf16, as configured."""
    daemon, probes, clock = make({"model": {"config": "llama-3.1-8b", "max_model_len": 8192}})
    await daemon.tick()
    assert daemon.state.budget is not None
    configured = daemon.state.budget.budget
    assert configured.kv_cache_dtype == "bf16"
    probes.engine.value = engine_stats(cache_dtype="fp8")  # type: ignore[union-attr]
    clock.now += 0.5
    with capture_logs() as logs:
        await daemon.tick()
        clock.now += 0.5
        await daemon.tick()
    switched = daemon.state.budget.budget
    assert switched.kv_cache_dtype == "fp8"
    assert switched.kv_bytes_per_token * 2 == configured.kv_bytes_per_token
    assert switched.kv_capacity_tokens > 1.9 * configured.kv_capacity_tokens
    assert [e["event"] for e in logs].count("budget_follows_engine_kv_dtype") == 1
    # A revert restarts the engine with its own flags: vLLM then says "auto".
    for back in ("auto", "fp8", "bfloat16"):
        probes.engine.value = engine_stats(cache_dtype=back)  # type: ignore[union-attr]
        clock.now += 0.5
        await daemon.tick()
        expected = switched if back == "fp8" else configured
        assert daemon.state.budget.budget.kv_capacity_tokens == expected.kv_capacity_tokens
    assert daemon.state.budget.budget.kv_cache_dtype == "bf16"


async def test_configured_gpu_memory_wins_over_nvml():
    """[gpu] memory fixes the budget's GPU size."""
    daemon, _, _ = make({"model": {"config": "llama-3.1-8b"}, "gpu": {"memory": "40GiB"}})
    await daemon.tick()
    assert daemon.state.budget is not None
    assert daemon.state.budget.budget.gpu_memory_bytes == 40 * GiB


@pytest.mark.parametrize(
    ("usage", "free", "expected"),
    [(0.5, 20 * GiB, 0.5), (0.95, 20 * GiB, 0.1), (0.5, 2 * GiB, 0.1)],
)
async def test_polls_faster_when_headroom_is_small(usage, free, expected):
    """KV usage >= 90% or GPU free <= 5% switches to the minimum interval."""
    gpu = GpuMemory(0, "GPU-0", "x", 80 * GiB, 80 * GiB - free, free, 0)
    daemon, _, _ = make(engine=engine_stats(kv_cache_usage_ratio=usage), nvml=(gpu,))
    await daemon.tick()
    assert daemon.next_interval() == expected


async def test_polls_fast_while_an_escalation_waits_for_confirmation():
    """A pending escalation ticks at min_interval: confirm_ticks take 3 x 0.1 s, not 3 x 0.5 s."""
    stats = engine_stats(
        kv_cache_usage_ratio=0.85, kv_capacity_tokens=4000, kv_used_tokens=3400
    )  # 0.85: elevated, < 0.9
    daemon, _, clock = make(engine=stats)
    intervals, levels = [], []
    for _ in range(4):
        await daemon.tick()
        levels.append(daemon.brain.decision.level)
        intervals.append(daemon.next_interval())
        clock.now += intervals[-1]
    assert levels == ["ok", "ok", "elevated", "elevated"]
    assert intervals == [0.1, 0.1, 0.5, 0.5]  # fast while pending, back to normal once entered


@pytest.mark.parametrize(
    ("slope", "prompts", "expected"),
    [
        (0.0, 0.0, 0.5),  # nothing filling: the full interval
        (100_000.0, 0.0, 0.4),  # 40,000 tokens of headroom under high, at 100,000/s
        (0.0, 200_000.0, 0.2),  # the token rates, when worse than the slope
        (10_000_000.0, 0.0, 0.1),  # a pool filling in milliseconds: clamped at min_interval
    ],
)
async def test_the_interval_is_the_time_the_headroom_lasts_at_the_worst_fill(
    slope, prompts, expected
):
    """The headroom under `high` / the worst fill rate, within [min, interval] (earlyoom)."""
    stats = engine_stats(
        kv_cache_usage_ratio=0.5, kv_capacity_tokens=100_000, kv_used_tokens=50_000
    )
    daemon, _, _ = make(engine=stats)
    await daemon.tick()
    gpu = ResourceForecast(None, None, None, None)
    kv = ResourceForecast(50_000.0, 100_000.0, 98_000.0, slope)
    daemon.brain.forecast = Forecast(
        kv=kv, gpu=gpu, kv_used_tokens=50_000.0, prompt_fill_per_s=prompts
    )
    assert daemon.next_interval() == pytest.approx(expected)


@pytest.mark.parametrize(("tick_s", "waits"), [(0.03, [0.02, 0.02, 0.02]), (0.08, [0.0, 0.0, 0.0])])
async def test_run_waits_the_interval_less_the_tick(tick_s, waits):
    """Ticks start interval_s apart: the wait is what the tick left of it, never negative."""
    daemon, _, clock = make(
        {"poll": {"interval_s": 0.05, "min_interval_s": 0.05, "timeout_s": 0.2}}
    )
    stop = asyncio.Event()
    real_tick, real_wait = daemon.tick, daemon._wait
    seen: list[float] = []

    async def slow_tick():
        snapshot = await real_tick()
        clock.now += tick_s
        return snapshot

    async def wait(stop_event, seconds):
        seen.append(round(seconds, 9))
        if len(seen) == len(waits):
            stop_event.set()
        await real_wait(stop_event, seconds)

    daemon.tick = slow_tick  # type: ignore[method-assign]
    daemon._wait = wait  # type: ignore[method-assign]
    await asyncio.wait_for(daemon.run(stop), 5)
    assert seen == waits
    assert daemon.state.ticks_total == len(waits)


async def test_run_ticks_until_stopped_and_finishes_the_tick():
    """run() ticks, calls after_tick each time, and returns once stop is set."""
    daemon, _, _ = make({"poll": {"interval_s": 0.01, "min_interval_s": 0.01, "timeout_s": 0.2}})
    stop = asyncio.Event()
    seen = []

    def after_tick(snapshot):
        seen.append(snapshot)
        if len(seen) == 3:
            stop.set()

    await asyncio.wait_for(daemon.run(stop, after_tick=after_tick), 5)
    assert len(seen) == 3
    assert daemon.state.ticks_total == 3


async def test_close_closes_every_probe():
    """close() releases every probe even if one fails to close."""
    daemon, probes, _ = make()
    await daemon.close()
    assert all(p.closed for p in probes.all().values())  # type: ignore[attr-defined]


async def test_an_unavailable_source_is_down_but_not_an_error():
    """A probe that reports itself unavailable (no driver) is down, without error counts or logs."""
    daemon, probes, _ = make()
    probes.nvml.error = "unavailable: NVML Shared Library Not Found"  # type: ignore[union-attr]
    probes.nvml.available = False  # type: ignore[union-attr]
    with capture_logs() as logs:
        for _ in range(3):
            snapshot = await daemon.tick()
    assert snapshot.sources["nvml"].ok is False
    assert snapshot.sources["nvml"].available is False
    assert daemon.state.trackers["nvml"].errors_total == 0
    # Only what the engine does when its pool runs out, once (an info, not a problem).
    assert [e["event"] for e in logs] == ["kv_exhaustion_mode"]


async def test_a_rejected_reload_changes_nothing():
    """A reload whose budget cannot be built raises and leaves config, probes and budget alone."""
    daemon, probes, _ = make({"model": {"config": "llama-3.1-8b"}})
    budget = daemon.state.budget
    bad = parse_config(
        {"engine": {"url": "http://127.0.0.1:2"}, "model": {"config": "no-such-model"}}, env={}
    )
    with pytest.raises(KvguardError):
        daemon.reload(bad)
    assert daemon.config.engine.url == "http://127.0.0.1:1"
    assert daemon.probes is probes
    assert daemon.state.budget is budget


async def test_a_good_reload_keeps_error_counts():
    """Rebuilt probes keep their error counts (counters must not reset on reload)."""
    daemon, probes, _ = make()
    probes.host.error = "boom"  # type: ignore[union-attr]
    await daemon.tick()
    new = parse_config(
        {"engine": {"url": "http://127.0.0.1:3"}, "poll": {"timeout_s": 0.2}}, env={}
    )
    daemon.reload(new)
    assert daemon.state.trackers["host"].errors_total == 1
    assert daemon.config.engine.url == "http://127.0.0.1:3"
    await daemon.close()


async def test_a_reload_names_what_needs_a_restart_and_keeps_it_in_force():
    """A new [server] listen or [proxy] is named, and the config keeps what really runs."""
    daemon, _, _ = make()
    before = daemon.config
    new = parse_config(
        {
            "engine": {"url": "http://127.0.0.1:1"},
            "poll": {"timeout_s": 0.3},
            "server": {"listen": "127.0.0.1:19999"},
            "proxy": {"enabled": True, "listen": "127.0.0.1:19998"},
        },
        env={},
    )
    with capture_logs() as logs:
        daemon.reload(new)
    (said,) = [e for e in logs if e["event"] == "reload_needs_restart"]
    assert said["sections"] == ["proxy", "server.listen"]
    assert daemon.config.server.listen == before.server.listen  # what still listens
    assert daemon.config.proxy == before.proxy
    assert daemon.config.poll.timeout_s == 0.3  # what a reload does apply, applied
    await daemon.close()


async def test_a_probe_bug_is_a_failed_read_not_a_dead_loop():
    """An unexpected exception from a probe is counted as a failure; the tick completes."""
    daemon, probes, _ = make()

    async def broken() -> object:
        raise ValueError("Forbidden control character")

    probes.engine.sample = broken  # type: ignore[method-assign]
    snapshot = await daemon.tick()
    assert snapshot.sources["engine"].ok is False
    assert snapshot.sources["engine"].error == "unexpected ValueError: Forbidden control character"


def test_engine_pid_selects_gpus_only_without_an_explicit_selection():
    """[gpu] indices win over [engine] pid for choosing GPUs."""
    both = parse_config(
        {"engine": {"url": "http://h:1", "pid": 42}, "gpu": {"indices": [0]}}, env={}
    )
    pid_only = parse_config({"engine": {"url": "http://h:1", "pid": 42}}, env={})
    assert Probes.from_config(both).nvml.selector.pids == ()  # type: ignore[union-attr]
    assert Probes.from_config(pid_only).nvml.selector.pids == (42,)  # type: ignore[union-attr]


async def test_every_refusal_reason_is_exported_from_zero():
    """kvguard_requests_rejected_total has every reason at 0 before the first refusal."""
    daemon, _, _ = make()
    daemon.proxy = AdmissionProxy(ProxySettings(upstream="http://127.0.0.1:1"), daemon.mitigations)
    daemon.proxy.counters.rejected["bad_path"] += 2
    registry = daemon_registry(daemon)
    for reason in REJECT_REASONS:
        value = registry.get_sample_value("kvguard_requests_rejected_total", {"reason": reason})
        assert value == (2.0 if reason == "bad_path" else 0.0), reason
    help_text = next(
        m.documentation for m in registry.collect() if m.name == "kvguard_requests_rejected"
    )
    assert "malformed" in help_text


def test_shed_and_error_counters_start_at_zero_and_the_process_is_described():
    """A fresh start: every shed series and proxy error code at 0; process_* and the new name."""
    daemon, _, _ = make()
    daemon.proxy = AdmissionProxy(ProxySettings(upstream="http://127.0.0.1:1"), daemon.mitigations)
    daemon.proxy.counters.shed[("sheddable", "kv_cache_pressure")] += 3
    registry = daemon_registry(daemon)
    for priority, reason in SHED_SERIES:
        value = registry.get_sample_value(
            "kvguard_requests_shed_total", {"priority": priority, "reason": reason}
        )
        assert value == (3.0 if (priority, reason) == ("sheddable", "kv_cache_pressure") else 0.0)
    for code in PROXY_ERROR_CODES:
        assert registry.get_sample_value("kvguard_proxy_errors_total", {"code": code}) == 0.0
    assert registry.get_sample_value("kvguard_proxy_held_requests") == 0.0
    assert registry.get_sample_value("kvguard_waiting_requests") == 0.0  # deprecated twin
    resident = registry.get_sample_value("process_resident_memory_bytes")
    assert resident is not None
    assert resident > 0


@pytest.mark.parametrize(
    ("usage", "waiting", "preemptions", "binds"),
    [
        (0.85, 2.0, 0.0, "kv_cache"),  # a queue in a nearly full cache
        (0.30, 40.0, 0.0, "compute"),  # a queue with room in the cache
        (0.95, 0.0, 0.0, "none"),  # a full pool nothing waits for
    ],
)
async def test_status_and_metrics_say_which_resource_binds(usage, waiting, preemptions, binds):
    """/status pressure.binding_resource, kvguard_binding_resource and the decision's signals."""
    stats = engine_stats(
        kv_cache_usage_ratio=usage,
        kv_capacity_tokens=10_000,
        kv_used_tokens=int(usage * 10_000),
        requests_waiting=waiting,
        preemptions_total=preemptions,
    )
    daemon, _, _ = make(engine=stats)
    await daemon.tick()
    assert daemon.brain.decision.binding == binds
    registry = daemon_registry(daemon)
    for resource in ("kv_cache", "compute", "none"):
        value = registry.get_sample_value("kvguard_binding_resource", {"resource": resource})
        assert value == (1.0 if resource == binds else 0.0), resource
    status = status_document(daemon)
    assert status["pressure"]["binding_resource"] == binds


def test_status_shows_what_admission_reserves_for_the_answers_in_flight_together():
    """/status proxy.reserved_kv_tokens: the p95 of the in-flight total, under each alone."""
    from kvguard.actuators.accounting import InflightRequest  # noqa: PLC0415 - one test

    daemon, _, _ = make()
    daemon.mitigations.block_size = 16
    daemon.proxy = AdmissionProxy(ProxySettings(upstream="http://127.0.0.1:1"), daemon.mitigations)
    for n in range(25):
        # Each reserved alone at p95 (1,000 output tokens), expected at 200 +- 300.
        tracked = InflightRequest(f"r{n}", "standard", prompt_tokens=96, max_tokens=2000)
        tracked.reserved_output, tracked.output_ceiling = 1000, 2000
        tracked.expected_output, tracked.output_variance = 200.0, 300.0**2
        daemon.proxy.inflight.add(tracked)
    proxy = status_document(daemon)["proxy"]
    # 25 x (96 + 200) = 7,400 expected, plus 1.645 x 300 x 5 = 2,468 for the p95 of the sum.
    assert proxy["reserved_kv_tokens"] == 25 * 304 + 2468 < 25 * 1104
    assert proxy["top_inflight"][0]["expected_output_tokens"] == 200
    assert proxy["top_inflight"][0]["reserved_output_tokens"] == 1000


@pytest.mark.parametrize(
    ("setting", "engine", "mode"),
    [
        ("auto", {"preemptions_total": 0.0}, "preempt"),  # vLLM with its preemption counter
        ("auto", {}, "fail"),  # vLLM's names, no preemption counter: it cannot preempt
        ("auto", {"kind": "llamacpp"}, "fail"),
        ("fail", {"preemptions_total": 0.0}, "fail"),
    ],
)
async def test_the_engine_says_whether_kvguard_cancels_before_its_pool_runs_out(
    setting, engine, mode
):
    """[engine] on_kv_exhaustion: in force after a tick, in /status, logged once per change."""
    config = {"engine": {"url": "http://127.0.0.1:1", "on_kv_exhaustion": setting}}
    daemon, _, _ = make(config, engine=engine_stats(**engine))
    daemon.proxy = AdmissionProxy(ProxySettings(upstream="http://127.0.0.1:1"), daemon.mitigations)
    with capture_logs() as logs:
        await daemon.tick()
        await daemon.tick()
    assert daemon.mitigations.kv_exhaustion == mode
    shown = status_document(daemon)["proxy"]["on_kv_exhaustion"]
    assert shown["mode"] == mode
    assert shown["overrun_cancel"] is (mode == "fail")
    assert shown["reason"] == daemon.mitigations.kv_exhaustion_reason
    # Before the first reading: "fail, the kind is not known yet". Each case changes
    # that once (the mode or its reason), and the second tick changes nothing.
    events = [e for e in logs if e["event"] == "kv_exhaustion_mode"]
    assert [(e["on_kv_exhaustion"], e["overrun_cancel"]) for e in events] == [
        (mode, mode == "fail")
    ]
