"""NVML faults seen from the running daemon: a hung call, a missing library, NotSupported.

The probe-level cases (each driver situation, a hung call's own timeout, a lost GPU)
are in tests/probes/test_nvml.py and tests/test_run.py; here the whole loop runs
(``Daemon.run``, with its loop watchdog) against a simulated engine on 127.0.0.1,
and the fakes of kvguard.testing stand in for the driver.
"""

from __future__ import annotations

import asyncio
import re
import threading

from structlog.testing import capture_logs

from kvguard.api.telemetry import daemon_registry
from kvguard.config.settings import parse_config
from kvguard.core.units import GiB
from kvguard.probes.engine import EngineProbe
from kvguard.probes.nvml import GpuSelector, NvmlProbe
from kvguard.runtime.daemon import Daemon
from kvguard.runtime.probing import Probes
from kvguard.testing import FakeGpu, FakeNvml


def h100() -> FakeGpu:
    """One fake 80 GiB GPU with 10 GiB in use."""
    return FakeGpu("NVIDIA H100 80GB HBM3 (fake)", "GPU-fake-0", 80 * GiB, 10 * GiB, 512 * 2**20)


async def run_ticks(daemon: Daemon, ticks: int, timeout: float = 20) -> None:
    """Run the daemon's real loop until it has ticked ``ticks`` more times."""
    stop = asyncio.Event()
    target = daemon.state.ticks_total + ticks

    async def after_tick(_snapshot) -> None:
        if daemon.state.ticks_total >= target:
            stop.set()

    async with asyncio.timeout(timeout):
        await daemon.run(stop, after_tick=after_tick)


async def test_a_hung_nvml_call_costs_its_probe_never_the_loop(sim_engine):
    """The driver stops answering.

    Ticks stay bounded by poll.timeout_s, the engine is still read and exported, NVML is
    down and counted, the loop never stalls, and it all comes back when the call
    returns.
    """
    url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048)
    nvml = FakeNvml([h100()])
    config = parse_config(
        {
            "engine": {"url": url},
            "poll": {"interval_s": 0.05, "min_interval_s": 0.05, "timeout_s": 0.3},
        },
        env={},
    )
    probes = Probes(
        engine=EngineProbe(url, timeout_s=0.3),
        nvml=NvmlProbe(GpuSelector(), nvml=nvml, timeout_s=0.3),
        host=None,
    )
    # A hung call on the loop would block it until the hang ends (30 s at most, the
    # safety timer): 1 s catches that, and a loaded CI machine's GC pause does not.
    daemon = Daemon(config, probes=probes, loop_stall_s=1.0)
    registry = daemon_registry(daemon)
    hang = threading.Event()
    safety = threading.Timer(30, hang.set)  # a broken test must not leave a thread blocked
    safety.start()
    try:
        await run_ticks(daemon, 2)
        assert registry.get_sample_value("kvguard_probe_up", {"probe": "nvml"}) == 1
        nvml.hang = hang
        with capture_logs() as logs:
            await run_ticks(daemon, 5)
        assert registry.get_sample_value("kvguard_probe_up", {"probe": "nvml"}) == 0
        assert registry.get_sample_value("kvguard_probe_errors_total", {"probe": "nvml"}) == 5
        assert registry.get_sample_value("kvguard_gpu_memory_used_bytes", {"gpu": "0"}) is None
        assert registry.get_sample_value("kvguard_engine_up") == 1  # the engine is still read
        assert registry.get_sample_value("kvguard_kv_cache_usage_ratio") == 0
        assert registry.get_sample_value("kvguard_tick_duration_seconds") < 0.3 + 0.5
        assert daemon.state.tick_overruns_total == 0
        assert daemon.state.loop_stalls_total == 0
        assert nvml.blocked_calls == 1  # one thread held, no pile-up behind it
        failures = [e for e in logs if e["event"] == "probe_failed" and e["probe"] == "nvml"]
        assert len(failures) == 2  # timed out, then "still running": once per change
        # The daemon's timeout and the probe's own are both 0.3 s: either may say it first.
        assert re.search(r"(timed out after|did not answer within) 0\.3 s", failures[0]["error"])
        assert "still running" in failures[1]["error"]

        hang.set()
        nvml.hang = None
        async with asyncio.timeout(10):
            while registry.get_sample_value("kvguard_probe_up", {"probe": "nvml"}) != 1:
                await run_ticks(daemon, 1)
        assert registry.get_sample_value("kvguard_gpu_memory_used_bytes", {"gpu": "0"}) == (
            10 * GiB
        )
    finally:
        hang.set()
        safety.cancel()
        await daemon.close()


async def test_no_driver_and_unsupported_fields_leave_the_daemon_working(sim_engine):
    """No NVML library.

    Down but not an error, nothing paged. A GPU that does not report its processes:
    memory still exported, no process series, no error.
    """
    url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048)
    config = parse_config(
        {"engine": {"url": url}, "poll": {"interval_s": 0.05, "min_interval_s": 0.05}}, env={}
    )
    missing = Daemon(
        config,
        probes=Probes(
            engine=EngineProbe(url),
            nvml=NvmlProbe(GpuSelector(), nvml=FakeNvml([h100()], library_missing=True)),
            host=None,
        ),
    )
    unsupported = Daemon(
        config,
        probes=Probes(
            engine=EngineProbe(url),
            nvml=NvmlProbe(
                GpuSelector(), nvml=FakeNvml([h100()], not_supported={"processes", "name"})
            ),
            host=None,
        ),
    )
    try:
        await run_ticks(missing, 3)
        values = daemon_registry(missing)
        assert values.get_sample_value("kvguard_probe_up", {"probe": "nvml"}) == 0
        assert values.get_sample_value("kvguard_probe_errors_total", {"probe": "nvml"}) == 0
        assert values.get_sample_value("kvguard_engine_up") == 1
        assert missing.state.snapshot is not None
        assert missing.state.snapshot.sources["nvml"].available is False

        await run_ticks(unsupported, 3)
        values = daemon_registry(unsupported)
        assert values.get_sample_value("kvguard_probe_up", {"probe": "nvml"}) == 1
        assert values.get_sample_value("kvguard_gpu_memory_used_bytes", {"gpu": "0"}) == 10 * GiB
        assert values.get_sample_value("kvguard_probe_errors_total", {"probe": "nvml"}) == 0
        assert unsupported.state.snapshot is not None
        (gpu,) = unsupported.state.snapshot.gpus or ()
        assert gpu.processes == ()
    finally:
        await missing.close()
        await unsupported.close()
