"""Engines spanning several GPUs: watch them all, budget per GPU, decide on the tightest.

Tensor-parallel engines hold one shard on each of N GPUs; the GPU that runs out first
takes the engine down (a CUDA OOM in one worker kills the whole TP group), so kvguard
must decide on the fullest GPU, never on an average. The fake NVML stands in for 4 and 8
GPUs; the engine is the simulated vLLM on 127.0.0.1 (or, for data parallelism, a
loopback server replaying a captured two-engine exposition).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiohttp import web

from kvguard.config.settings import parse_config
from kvguard.core.series import tick_sample
from kvguard.core.units import GiB, MiB
from kvguard.probes.engine import EngineProbe
from kvguard.probes.nvml import GpuSelector, NvmlProbe
from kvguard.runtime.daemon import Daemon
from kvguard.runtime.probing import Probes
from kvguard.testing import FakeGpu, FakeNvml

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "engines"
TOTAL = 80 * GiB


def gpus(count: int, *, fuller: int, fuller_free: int, free: int = 40 * GiB) -> list[FakeGpu]:
    """``count`` H100-like GPUs with ``free`` bytes free, except GPU ``fuller``."""
    return [
        FakeGpu(
            "NVIDIA H100 80GB HBM3",
            f"GPU-{index:08d}-0000-0000-0000-000000000000",
            TOTAL,
            used_bytes=TOTAL - (fuller_free if index == fuller else free),
        )
        for index in range(count)
    ]


class Clock:
    """A monotonic clock the test moves by hand (no sleeping between ticks)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def child_process() -> Iterator[subprocess.Popen[bytes]]:
    """A child of this test process (a TP worker of 'the engine'), stopped in teardown."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait(timeout=10)


@pytest.fixture
async def guard() -> AsyncIterator[Callable[..., Awaitable[tuple[Daemon, Clock]]]]:
    """Factory of daemons over a real engine probe and fake GPUs; closed in teardown."""
    daemons: list[Daemon] = []

    async def start(engine_url: str, nvml: FakeNvml, **config: object) -> tuple[Daemon, Clock]:
        data = {"engine": {"url": engine_url, "kind": "vllm"}} | config
        clock = Clock()
        probes = Probes(
            engine=EngineProbe(engine_url, kind="vllm", timeout_s=2.0),
            nvml=NvmlProbe(nvml=nvml, clock=clock),
            host=None,
        )
        daemon = Daemon(parse_config(data, env={}), probes=probes, clock=clock)
        daemons.append(daemon)
        return daemon, clock

    yield start
    for daemon in daemons:
        await daemon.close()


async def tick(daemon: Daemon, clock: Clock, times: int) -> None:
    """``times`` ticks, half a second apart on the daemon's clock."""
    for _ in range(times):
        clock.now += 0.5
        await daemon.tick()


# ------------------------------------------------------------------ watching every GPU
@pytest.mark.parametrize(("count", "fuller"), [(4, 2), (8, 5)])
async def test_every_gpu_of_the_engine_is_watched_in_index_order(count, fuller):
    """With no selection, each of the 4 / 8 GPUs is read, the fuller one included."""
    nvml = FakeNvml(gpus(count, fuller=fuller, fuller_free=1 * GiB))
    readings = await NvmlProbe(nvml=nvml).sample()
    assert [g.index for g in readings] == list(range(count))
    assert [g.free_bytes for g in readings].count(1 * GiB) == 1
    assert readings[fuller].free_bytes == 1 * GiB


async def test_the_engine_s_gpus_are_selected_by_its_pid_and_its_workers(child_process):
    """8 GPUs, two TP-4 engines: this PID's engine (its child holds two shards) gets four."""
    nvml = FakeNvml(gpus(8, fuller=3, fuller_free=1 * GiB))
    ours, worker, other = os.getpid(), child_process.pid, 987_654
    for index in range(8):
        holder = (ours if index < 2 else worker) if index < 4 else other
        nvml.set_processes(index, {holder: 30 * GiB})
    probe = NvmlProbe(GpuSelector(pids=(ours,)), nvml=nvml)
    readings = await probe.sample()
    assert [g.index for g in readings] == [0, 1, 2, 3]
    assert min(readings, key=lambda g: g.free_bytes).index == 3


async def test_following_a_restarted_engine_moves_the_selection(child_process):
    """follow(pid) (supervisor mode) selects the new engine's GPUs from the next sample on."""
    nvml = FakeNvml(gpus(4, fuller=0, fuller_free=1 * GiB))
    nvml.set_processes(0, {111: GiB})
    nvml.set_processes(2, {child_process.pid: GiB})
    nvml.set_processes(3, {child_process.pid: GiB})
    probe = NvmlProbe(nvml=nvml)
    assert len(await probe.sample()) == 4  # nothing followed yet: every GPU
    probe.follow(child_process.pid)
    assert [g.index for g in await probe.sample()] == [2, 3]
    probe.follow(None)  # no engine running right now: keep the last selection
    assert [g.index for g in await probe.sample()] == [2, 3]


async def test_following_never_overrides_indices_or_uuids():
    """GPUs the operator named stay selected whatever the engine's PID."""
    nvml = FakeNvml(gpus(4, fuller=0, fuller_free=1 * GiB))
    probe = NvmlProbe(GpuSelector(indices=(1, 3)), nvml=nvml)
    probe.follow(os.getpid())
    assert probe.selector == GpuSelector(indices=(1, 3))
    assert [g.index for g in await probe.sample()] == [1, 3]


@pytest.mark.parametrize(("follow", "watched"), [(True, [2, 3]), (False, [0, 1, 2, 3])])
async def test_supervisor_mode_follows_the_engine_s_gpus_only_when_asked(
    sim_engine, guard, child_process, follow, watched
):
    """[gpu] follow_engine: the daemon hands the supervised engine's PID to the NVML probe."""
    nvml = FakeNvml(gpus(4, fuller=0, fuller_free=1 * GiB))
    nvml.set_processes(2, {child_process.pid: GiB})
    nvml.set_processes(3, {child_process.pid: GiB})
    daemon, clock = await guard(await sim_engine(), nvml, gpu={"follow_engine": follow})
    daemon.supervisor = SimpleNamespace(pid=child_process.pid)  # what Supervisor exposes
    await tick(daemon, clock, 1)
    assert [g.index for g in daemon.state.snapshot.gpus] == watched


# ------------------------------------------------------------------ deciding on the tightest
@pytest.mark.parametrize(("count", "fuller"), [(4, 1), (8, 7)])
async def test_one_nearly_full_gpu_drives_the_level_though_the_average_is_fine(
    sim_engine, guard, count, fuller
):
    """1.5% free on one GPU, 50% on the rest: critical (the mean, ~44-38%, would say ok)."""
    url = await sim_engine()
    fuller_free = round(TOTAL * 0.015)
    nvml = FakeNvml(gpus(count, fuller=fuller, fuller_free=fuller_free))
    daemon, clock = await guard(url, nvml)
    await tick(daemon, clock, 6)
    snapshot = daemon.state.snapshot
    assert snapshot is not None
    assert len(snapshot.gpus or ()) == count
    mean_free = sum(g.free_bytes for g in snapshot.gpus or ()) / (count * TOTAL)
    assert mean_free > 0.3  # an average would see plenty of room
    sample = tick_sample(snapshot)
    assert sample.gpu_used_bytes == TOTAL - fuller_free  # the fullest GPU speaks for all
    decision = daemon.brain.decision
    assert decision is not None
    assert decision.signals.gpu_free_ratio == pytest.approx(0.015, abs=1e-6)
    assert decision.level == "critical"
    assert any("gpu_free_ratio" in c for c in decision.crossed)


async def test_the_same_gpus_with_room_everywhere_stay_ok(sim_engine, guard):
    """The control: 8 GPUs all half free, an idle engine: level ok, nothing crossed."""
    url = await sim_engine()
    nvml = FakeNvml(gpus(8, fuller=0, fuller_free=40 * GiB))
    daemon, clock = await guard(url, nvml)
    await tick(daemon, clock, 6)
    decision = daemon.brain.decision
    assert decision is not None
    assert decision.signals.gpu_free_ratio == pytest.approx(0.5)
    assert (decision.level, decision.crossed) == ("ok", ())


async def test_the_fuller_gpu_filling_up_is_forecast(sim_engine, guard):
    """A GPU losing 1 GiB/s among 7 steady ones: GPU memory exhaustion is forecast on it."""
    url = await sim_engine()
    nvml = FakeNvml(gpus(8, fuller=6, fuller_free=20 * GiB))
    daemon, clock = await guard(url, nvml)
    for step in range(12):
        nvml.set_used(6, TOTAL - 20 * GiB + step * GiB // 2)  # 1 GiB/s at 2 ticks/s
        await tick(daemon, clock, 1)
    forecast = daemon.brain.forecast
    assert forecast is not None
    # About 14.5 GiB left (less the 512 MiB reserve) at 1 GiB/s: roughly 14 s.
    assert 8 < forecast.gpu.time_to_exhaustion_s < 20


# ------------------------------------------------------------------ budget per GPU (TP split)
@pytest.mark.parametrize(("tp", "per_gpu"), [(4, 81_920), (8, 40_960)])
async def test_budget_is_per_gpu_with_the_tp_split_on_the_smallest_gpu(
    sim_engine, guard, tp, per_gpu
):
    """Llama-3.1-70B at tp 4 / 8: KV per token per GPU split by TP; memory of the smallest GPU."""
    url = await sim_engine()
    boards = gpus(tp, fuller=0, fuller_free=40 * GiB)
    boards[tp - 1].total_bytes = TOTAL - 512 * MiB  # one board reports a little less
    boards[tp - 1].used_bytes = 0
    daemon, clock = await guard(
        url, FakeNvml(boards), model={"config": "llama-3.1-70b", "tp": tp, "max_model_len": 8192}
    )
    await tick(daemon, clock, 1)
    report = daemon.state.budget
    assert report is not None
    assert report.budget.kv_bytes_per_token == 327_680  # the whole model
    assert report.budget.kv_bytes_per_token_per_gpu == per_gpu
    assert report.budget.gpu_memory_bytes == TOTAL - 512 * MiB


# ------------------------------------------------------------------ data-parallel vLLM
@pytest.fixture
async def dp_engine() -> AsyncIterator[str]:
    """A loopback server replaying vLLM's exposition of two data-parallel engines."""
    text = (FIXTURES / "vllm_sim_dp2.txt").read_text()

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=text, content_type="text/plain")

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


async def test_data_parallel_engines_add_up_and_the_fuller_one_decides(dp_engine, guard):
    """engine="0" at 93% and engine="1" at 21%: the usage decided on is engine 0's."""
    nvml = FakeNvml(gpus(2, fuller=0, fuller_free=10 * GiB))
    daemon, clock = await guard(dp_engine, nvml)
    await tick(daemon, clock, 4)
    engine = daemon.state.snapshot.engine if daemon.state.snapshot else None
    assert engine is not None
    assert engine.kv_cache_usage_ratio == pytest.approx(0.9333333333333333)
    assert engine.kv_capacity_blocks == 256 + 256
    assert engine.requests_running == 11 + 3
    decision = daemon.brain.decision
    assert decision is not None
    assert decision.signals.kv_usage == pytest.approx(engine.kv_used_tokens / 8192, rel=0.01)
