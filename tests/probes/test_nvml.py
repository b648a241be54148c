"""NvmlProbe against FakeNvml (every driver situation) and against the real pynvml."""

from __future__ import annotations

import asyncio
import ctypes
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
from structlog.testing import capture_logs

from kvguard.core.snapshot import GpuProcess
from kvguard.core.units import GiB, MiB
from kvguard.errors import InvalidInputError, ProbeError
from kvguard.probes.nvml import INIT_RETRY_INTERVAL_S, GpuSelector, NvmlProbe
from kvguard.testing import FakeGpu, FakeNvml


def gpu(index: int, **fields) -> FakeGpu:
    """An H100-like fake GPU with an index-derived UUID."""
    values = {
        "name": "NVIDIA H100 80GB HBM3",
        "uuid": f"GPU-{index:08d}-0000-0000-0000-000000000000",
        "total_bytes": 80 * GiB,
        "used_bytes": 10 * GiB,
        "reserved_bytes": 512 * MiB,
    }
    values.update(fields)
    return FakeGpu(**values)


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def events(logs: list[dict], name: str) -> list[dict]:
    """The captured log entries with this event name."""
    return [entry for entry in logs if entry["event"] == name]


def nvml_library_present() -> bool:
    """Whether this machine has the NVIDIA driver's NVML library."""
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


@pytest.fixture
def child_process() -> Iterator[subprocess.Popen[bytes]]:
    """A child of this test process, stopped in teardown."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


async def test_v2_driver_reports_reserved_apart_from_used():
    """With memory info v2, reserved bytes are separate and processes are listed."""
    hidden = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE, passed through by older pynvml
    nvml = FakeNvml([gpu(0, processes={1234: 9 * GiB, 5678: None, 91: hidden})])
    probe = NvmlProbe(nvml=nvml)

    (reading,) = await probe.sample()

    assert reading.index == 0
    assert reading.uuid == "GPU-00000000-0000-0000-0000-000000000000"
    assert reading.name == "NVIDIA H100 80GB HBM3"
    assert reading.total_bytes == 80 * GiB
    assert reading.used_bytes == 10 * GiB
    assert reading.reserved_bytes == 512 * MiB
    assert reading.free_bytes == 80 * GiB - 10 * GiB - 512 * MiB
    assert reading.processes == (
        GpuProcess(1234, 9 * GiB),
        GpuProcess(5678, None),
        GpuProcess(91, None),
    )
    assert probe.available


async def test_v1_only_driver_has_no_reserved_and_counts_it_as_used():
    """An old driver: reserved None and counted as used; older queries used from then on."""
    nvml = FakeNvml([gpu(0, processes={77: GiB})], v1_only=True)
    probe = NvmlProbe(nvml=nvml)

    (first,) = await probe.sample()
    (second,) = await probe.sample()

    assert first.reserved_bytes is None
    assert first.used_bytes == 10 * GiB + 512 * MiB
    assert first.free_bytes == 80 * GiB - 10 * GiB - 512 * MiB
    assert second == first
    assert first.processes == (GpuProcess(77, GiB),)
    # One refused v2 call and one v1 call, then v1 only; likewise for processes.
    assert nvml.calls["nvmlDeviceGetMemoryInfo"] == 3
    assert nvml.calls["nvmlDeviceGetComputeRunningProcesses"] == 1


async def test_bytes_names_from_older_pynvml_are_decoded():
    """Older pynvml returns names and UUIDs as bytes; the probe reports text."""

    class BytesNvml(FakeNvml):
        def nvmlDeviceGetName(self, handle):  # noqa: N802 - pynvml's name
            return super().nvmlDeviceGetName(handle).encode()

        def nvmlDeviceGetUUID(self, handle):  # noqa: N802 - pynvml's name
            return super().nvmlDeviceGetUUID(handle).encode()

    (reading,) = await NvmlProbe(nvml=BytesNvml([gpu(0)])).sample()

    assert reading.name == "NVIDIA H100 80GB HBM3"
    assert reading.uuid.startswith("GPU-00000000")


async def test_all_gpus_by_default_in_index_order():
    """An empty selector reads every GPU."""
    probe = NvmlProbe(nvml=FakeNvml([gpu(0), gpu(1), gpu(2)]))

    assert [g.index for g in await probe.sample()] == [0, 1, 2]


async def test_select_by_index():
    """Indices pick those GPUs only, and the others are not touched."""
    nvml = FakeNvml([gpu(0), gpu(1), gpu(2)])
    nvml.lose_gpu(0)  # unselected, so it must not fail the sample
    probe = NvmlProbe(GpuSelector(indices=(2, 1)), nvml=nvml)

    assert [g.index for g in await probe.sample()] == [1, 2]


async def test_select_by_uuid():
    """A UUID picks that GPU."""
    probe = NvmlProbe(
        GpuSelector(uuids=("GPU-00000001-0000-0000-0000-000000000000",)),
        nvml=FakeNvml([gpu(0), gpu(1), gpu(2)]),
    )

    assert [g.index for g in await probe.sample()] == [1]


async def test_select_by_pid():
    """A PID picks the GPUs where that process runs."""
    nvml = FakeNvml([gpu(0, processes={11: GiB}), gpu(1, processes={987654: GiB}), gpu(2)])
    probe = NvmlProbe(GpuSelector(pids=(987654,)), nvml=nvml)

    assert [g.index for g in await probe.sample()] == [1]


async def test_select_by_pid_includes_child_processes(child_process):
    """Selecting this process also selects a GPU held only by its child (vLLM's engine core)."""
    nvml = FakeNvml([gpu(0), gpu(1, processes={child_process.pid: GiB})])
    probe = NvmlProbe(GpuSelector(pids=(os.getpid(),)), nvml=nvml)

    assert [g.index for g in await probe.sample()] == [1]


async def test_pid_on_no_gpu_is_an_error_that_names_it():
    """Only a PID selects, and no GPU runs it: ProbeError saying so."""
    probe = NvmlProbe(GpuSelector(pids=(987654,)), nvml=FakeNvml([gpu(0)]))

    with pytest.raises(ProbeError, match="no GPU runs pid 987654"):
        await probe.sample()


async def test_unknown_index_is_an_error_that_names_it():
    """An index past the GPU count raises ProbeError naming the index."""
    probe = NvmlProbe(GpuSelector(indices=(0, 5)), nvml=FakeNvml([gpu(0), gpu(1)]))

    with pytest.raises(ProbeError, match=r"index 5 not found.*2 GPU"):
        await probe.sample()


async def test_unknown_uuid_is_an_error_that_names_it():
    """A UUID no GPU has raises ProbeError naming the UUID."""
    probe = NvmlProbe(GpuSelector(uuids=("GPU-nope",)), nvml=FakeNvml([gpu(0)]))

    with pytest.raises(ProbeError, match="uuid GPU-nope not found"):
        await probe.sample()


def test_selector_rejects_impossible_values():
    """Negative indices, blank UUIDs and non-positive PIDs are refused up front."""
    with pytest.raises(InvalidInputError, match=r"gpu\.indices"):
        GpuSelector(indices=(-1,))
    with pytest.raises(InvalidInputError, match=r"gpu\.uuids"):
        GpuSelector(uuids=(" ",))
    with pytest.raises(InvalidInputError, match=r"engine\.pid"):
        GpuSelector(pids=(0,))


async def test_missing_library_is_unavailable_logged_once_and_retried_each_minute():
    """No driver: every sample fails fast, one log event, nvmlInit at most once a minute."""
    nvml = FakeNvml([gpu(0)], library_missing=True)
    clock = FakeClock()
    probe = NvmlProbe(nvml=nvml, clock=clock)

    with capture_logs() as logs:
        for _ in range(3):
            with pytest.raises(ProbeError, match="unavailable: NVMLError_LibraryNotFound"):
                await probe.sample()
        clock.now += INIT_RETRY_INTERVAL_S - 0.1
        with pytest.raises(ProbeError, match="unavailable"):
            await probe.sample()
        assert nvml.calls["nvmlInit"] == 1

        clock.now += 0.1
        with pytest.raises(ProbeError, match="unavailable"):
            await probe.sample()
        assert nvml.calls["nvmlInit"] == 2

    assert probe.available is False
    assert "LibraryNotFound" in (probe.unavailable_reason or "")
    assert probe.driver_info()["driver_version"] is None
    (event,) = events(logs, "nvml_unavailable")
    assert event["log_level"] == "warning"
    assert "LibraryNotFound" in event["reason"]


async def test_a_probe_rebuilt_at_a_reload_does_not_report_nvml_again():
    """A reload that rebuilds the probes keeps what NVML was: one event per run, no early retry."""
    nvml = FakeNvml([gpu(0)], library_missing=True)
    clock = FakeClock()
    first = NvmlProbe(nvml=nvml, clock=clock)
    with capture_logs() as logs:
        with pytest.raises(ProbeError, match="unavailable"):
            await first.sample()
        again = NvmlProbe(nvml=nvml, clock=clock)
        again.continue_from(first)
        for _ in range(2):
            with pytest.raises(ProbeError, match="unavailable"):
                await again.sample()
    assert len(events(logs, "nvml_unavailable")) == 1
    assert nvml.calls["nvmlInit"] == 1  # the retry stays a minute after the last attempt
    assert again.available is False


async def test_unavailable_probe_recovers_when_the_driver_appears():
    """Once the library is there, the retry a minute later succeeds and says so."""
    nvml = FakeNvml([gpu(0)], library_missing=True)
    clock = FakeClock()
    probe = NvmlProbe(nvml=nvml, clock=clock)
    with pytest.raises(ProbeError):
        await probe.sample()

    nvml.library_missing = False
    clock.now += INIT_RETRY_INTERVAL_S
    with capture_logs() as logs:
        (reading,) = await probe.sample()

    assert reading.total_bytes == 80 * GiB
    assert probe.available
    assert probe.driver_info() == {
        "driver_version": "550.54.15",
        "nvml_version": "12.550.54.15",
        "unavailable_reason": None,
    }
    assert len(events(logs, "nvml_available")) == 1


async def test_driver_not_loaded_is_unavailable():
    """Library present but no kernel driver: unavailable, not a crash."""
    probe = NvmlProbe(nvml=FakeNvml([gpu(0)], driver_not_loaded=True))

    with pytest.raises(ProbeError, match="unavailable: NVMLError_DriverNotLoaded"):
        await probe.sample()
    assert probe.available is False


async def test_no_gpu_is_unavailable_and_releases_nvml():
    """NVML starts but sees no GPU: unavailable, and the init is undone."""
    nvml = FakeNvml([])
    probe = NvmlProbe(nvml=nvml)

    with pytest.raises(ProbeError, match="unavailable: NVML started but found no NVIDIA GPU"):
        await probe.sample()
    assert probe.available is False
    assert not nvml.initialized


async def test_lost_gpu_fails_the_sample_logs_once_and_recovers():
    """A lost GPU: ProbeError each sample, one gpu_lost event, readings again once back."""
    nvml = FakeNvml([gpu(0), gpu(1)])
    probe = NvmlProbe(nvml=nvml)
    await probe.sample()

    nvml.lose_gpu(1)
    with capture_logs() as logs:
        for _ in range(2):
            with pytest.raises(ProbeError, match=r"GPU 1 lost.*NVMLError_GpuIsLost"):
                await probe.sample()
        nvml.restore_gpu(1)
        gpus = await probe.sample()

    assert [g.index for g in gpus] == [0, 1]
    (lost,) = events(logs, "gpu_lost")
    assert lost["gpu"] == 1
    assert len(events(logs, "gpu_recovered")) == 1
    assert probe.available  # a lost GPU is a failed sample, not an unavailable NVML


async def test_unsupported_processes_report_empty_and_memory_still_comes():
    """Processes NotSupported: ``processes == ()`` (unknown), memory fields still read."""
    probe = NvmlProbe(nvml=FakeNvml([gpu(0, processes={1: GiB})], not_supported={"processes"}))

    (reading,) = await probe.sample()

    assert reading.processes == ()
    assert reading.used_bytes == 10 * GiB
    assert reading.reserved_bytes == 512 * MiB


async def test_unsupported_name_is_empty_text():
    """A GPU that will not give its name reports ``""`` and everything else."""
    probe = NvmlProbe(nvml=FakeNvml([gpu(0)], not_supported={"name"}))

    (reading,) = await probe.sample()

    assert reading.name == ""
    assert reading.total_bytes == 80 * GiB


async def test_unsupported_memory_is_a_probe_error_not_an_nvml_error():
    """No memory info at all (unified-memory parts): ProbeError, never NVMLError."""
    probe = NvmlProbe(nvml=FakeNvml([gpu(0)], not_supported={"memory"}))

    with pytest.raises(ProbeError, match="GPU 0 memory info: NVMLError_NotSupported"):
        await probe.sample()


async def test_hung_call_times_out_without_blocking_the_loop():
    """A hung NVML call costs one sample, never the event loop.

    ProbeError after timeout_s while another task keeps running; later samples fail
    fast while it stays hung (no second thread); normal samples once it returns.
    """
    nvml = FakeNvml([gpu(0)])
    probe = NvmlProbe(nvml=nvml, timeout_s=0.2)
    await probe.sample()

    hang = threading.Event()
    safety = threading.Timer(30, hang.set)  # a blocked loop fails the test, never hangs it
    safety.start()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    nvml.hang = hang
    other_task = asyncio.create_task(ticker())
    try:
        await asyncio.sleep(0)
        ticks_before = ticks
        with pytest.raises(ProbeError, match=r"did not answer within 0\.2 s"):
            await probe.sample()
        assert ticks > ticks_before  # the loop kept running while the call hung
        assert nvml.blocked_calls == 1

        with pytest.raises(ProbeError, match="still running"):
            await probe.sample()
        assert nvml.blocked_calls == 1  # nothing queued behind the hung call

        hang.set()
        assert await probe.wait_idle(timeout_s=10)
        nvml.hang = None
        (reading,) = await probe.sample()
        assert reading.used_bytes == 10 * GiB
    finally:
        hang.set()
        safety.cancel()
        other_task.cancel()


async def test_readings_track_used_bytes():
    """set_used on the fake shows up in the next sample."""
    nvml = FakeNvml([gpu(0, used_bytes=GiB)])
    probe = NvmlProbe(nvml=nvml)
    (before,) = await probe.sample()

    nvml.set_used(0, 70 * GiB)
    nvml.set_processes(0, {42: 70 * GiB})
    (after,) = await probe.sample()

    assert before.used_bytes == GiB
    assert after.used_bytes == 70 * GiB
    assert after.free_bytes == 10 * GiB - 512 * MiB
    assert after.processes == (GpuProcess(42, 70 * GiB),)


async def test_close_shuts_nvml_down_once():
    """close() undoes nvmlInit; closing a probe that never started does nothing."""
    nvml = FakeNvml([gpu(0)])
    probe = NvmlProbe(nvml=nvml)
    await probe.close()
    assert nvml.calls["nvmlShutdown"] == 0

    await probe.sample()
    assert nvml.initialized
    await probe.close()

    assert not nvml.initialized
    assert nvml.calls["nvmlShutdown"] == 1


def test_timeout_must_be_positive():
    """A zero timeout is refused with the config key it comes from."""
    with pytest.raises(InvalidInputError, match=r"poll\.timeout_s"):
        NvmlProbe(nvml=FakeNvml(), timeout_s=0)


@pytest.mark.skipif(nvml_library_present(), reason="this machine has an NVIDIA driver")
async def test_real_pynvml_without_driver_is_unavailable():
    """The real pynvml on a machine without the driver: unavailable, ProbeError, one event."""
    probe = NvmlProbe(clock=FakeClock())

    with capture_logs() as logs:
        for _ in range(2):
            with pytest.raises(ProbeError, match="unavailable: NVMLError_LibraryNotFound"):
                await probe.sample()
    await probe.close()

    assert probe.available is False
    assert len(events(logs, "nvml_unavailable")) == 1


@pytest.mark.skipif(not nvml_library_present(), reason="no NVIDIA driver on this machine")
async def test_real_pynvml_with_driver_reads_plausible_memory():
    """The real pynvml with a driver: every GPU's figures add up and versions are known."""
    probe = NvmlProbe()
    try:
        gpus = await probe.sample()
    finally:
        await probe.close()

    assert gpus
    for reading in gpus:
        assert reading.uuid.startswith(("GPU-", "MIG-"))
        assert 0 <= reading.used_bytes <= reading.total_bytes
        assert 0 <= reading.free_bytes <= reading.total_bytes
        if reading.reserved_bytes is not None:
            assert reading.used_bytes + reading.reserved_bytes + reading.free_bytes == (
                reading.total_bytes
            )
    assert probe.driver_info()["driver_version"]
