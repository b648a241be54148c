"""GPU check: kvguard's NVML probe and GPU exhaustion forecast against a GPU running out.

One bounded run (docs/gpu-check.md; start it with ``bash scripts/gpu-check.sh``):

1. ``kvguard probe --json`` (real NVML) against ``nvidia-smi --query-gpu=...``:
   total and used memory per GPU within 1%.
2. A dynamic-KV load (``bench/gpu_load.py``: Llama-3.1-8B's KV shape, bf16, grown
   token by token at a controlled rate) until the allocator's out-of-memory error,
   with ``kvguard run --dry-run`` beside it (NVML probe, selected by the load's PID,
   the model's budget, 0.5 s ticks). Its ``/metrics`` is read after every tick.
3. The report: kvguard's GPU used bytes against the allocator's reserved bytes over
   time; the first tick whose ``kvguard_time_to_exhaustion_seconds{resource="gpu_memory"}``
   fell under 30 s and under 10 s; the OOM; the lead times; kvguard's KV bytes per
   token against what the load allocated per token. JSON and CSV go to ``--out DIR``
   (or ``$KVGUARD_GPU_CHECK_OUT``); a short table is printed last. Exit 0 when every
   check passed, 1 when one failed, 2 when the check could not run.
4. Teardown: kvguard and the load are stopped (and killed if they do not stop);
   ``nvidia-smi`` afterwards must show the memory as it was before. Nothing changes
   clocks, power limits, compute mode or MIG, and nothing resets a GPU.

``--fake`` runs the same steps without a GPU, in this process: the fake NVML of
:mod:`kvguard.testing` with a :class:`~kvguard.testing.SimulatedAllocator` under the
load, kvguard's daemon on an injected clock (so a minute of filling takes about a
second), its real HTTP API on 127.0.0.1 for ``/metrics``, and a fake ``nvidia-smi``.
CI runs this mode (tests/test_gpu_check.py).

    python -m bench.gpu_check [--fake] [--out DIR] [--fill-s 90] [--device 0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import structlog

from bench.gpu_load import KvLoad, KvShape, LoadError
from bench.gpu_report import (
    NVIDIA_SMI_QUERY,
    CheckError,
    KvguardReading,
    build_report,
    compare_probe,
    left_as_found,
    parse_metrics,
    parse_nvidia_smi,
    render_table,
    write_results,
)
from kvguard.api.logs import configure_logging
from kvguard.config.model_files import BUNDLED_MODELS_DIR
from kvguard.http_client import client_session
from kvguard.testing import (
    FakeGpu,
    FakeNvml,
    FakeOutOfMemoryError,
    SimulatedAllocator,
    nvidia_smi_csv,
)

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30
MiB = 2**20
EXIT_PASSED, EXIT_FAILED, EXIT_CANNOT_RUN = 0, 1, 2
BASELINE_TICKS = 6  # kvguard's ticks before the load grows: its idle level and first trend
FAKE_STEP_S = 0.05  # the fake load catches up with its rate this often (fake seconds)
SCRAPE_INTERVAL_S = 0.05  # real mode: /metrics read this often, so no 0.1 s tick is missed
FAKE_LOAD_PID = 4_194_000  # above any default pid_max: no real process has it


@dataclass(frozen=True)
class Settings:
    """One run's settings (all in the report)."""

    fake: bool = False
    model: str = "llama-3.1-8b"  # kvguard's [model] config (bundled name or path)
    load_model: str | None = None  # the load's KV shape source; None: the same model
    fill_s: float = 90.0  # the load fills the GPU's free memory in about this long
    poll_interval_s: float = 0.5
    block_tokens: int = 16
    concurrency: int = 32
    max_seq_tokens: int = 8192
    max_load_s: float = 180.0  # the load stops here if no OOM came
    deadline_s: float = 420.0  # the whole run, teardown included, ends by then
    device: int = 0
    fake_gpu_bytes: int = 24 * GiB
    fake_other_bytes: int = 1 * GiB  # another process already on the fake GPU
    fake_reserved_bytes: int = 300 * MiB  # the fake driver's reservation
    out: str | None = None

    def model_config_path(self, name: str) -> Path:
        """A bundled model's config.json, or the path given."""
        bundled = BUNDLED_MODELS_DIR / name / "config.json"
        return bundled if bundled.is_file() else Path(name)


def guard_config(
    settings: Settings, *, engine_url: str, pid: int, listen: str, gpu_index: int | None = None
) -> dict[str, Any]:
    """The config kvguard runs with: no engine, the load's PID (or a GPU index), 0.5 s ticks."""
    config: dict[str, Any] = {
        # Nothing listens there: the load is no engine, and kvguard must forecast
        # from NVML alone (the engine probe fails, and says so once).
        "engine": {"url": engine_url, "pid": pid},
        "model": {"config": settings.model},
        "poll": {"interval_s": settings.poll_interval_s, "timeout_s": 1.0},
        "server": {"listen": listen},
        "policy": {"dry_run": True},
    }
    if gpu_index is not None:
        config["gpu"] = {"indices": [gpu_index]}
    return config


def to_toml(config: dict[str, Any]) -> str:
    """The small config above as TOML (strings, numbers, booleans and lists of ints)."""
    lines = []
    for section, table in config.items():
        lines.append(f"[{section}]")
        for key, value in table.items():
            lines.append(f"{key} = {json.dumps(value)}")  # JSON scalars are TOML scalars here
        lines.append("")
    return "\n".join(lines)


def free_port() -> int:
    """A port free on 127.0.0.1 now."""
    from kvguard.runtime.inprocess import free_port as pick  # noqa: PLC0415 - one helper, shared

    return pick()


async def scrape(
    session: aiohttp.ClientSession, url: str, now: Callable[[], float]
) -> KvguardReading:
    """One read of kvguard's /metrics, timed on ``now``'s clock."""
    async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
        resp.raise_for_status()
        text = await resp.text()
    return parse_metrics(text, now())


# ------------------------------------------------------------------ fake mode
class FakeClock:
    """A monotonic clock the fake run moves by hand."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        """The current fake time."""
        return self.t

    def advance(self, seconds: float) -> None:
        """Move time forward."""
        self.t += seconds


class SimulatedBackend:
    """The load's memory from a :class:`~kvguard.testing.SimulatedAllocator`."""

    def __init__(self, allocator: SimulatedAllocator) -> None:
        self.allocator = allocator

    def allocate_block(self, shape: KvShape, block_tokens: int) -> object:
        """One block: ``bytes_per_token x block_tokens`` bytes."""
        return self.allocator.allocate(shape.bytes_per_token * block_tokens)

    def allocated_bytes(self) -> int:
        """The allocator's live bytes."""
        return int(self.allocator.memory_allocated())

    def reserved_bytes(self) -> int:
        """The allocator's cached segments."""
        return int(self.allocator.memory_reserved())

    def is_oom(self, exc: BaseException) -> bool:
        """The fake OOM."""
        return isinstance(exc, FakeOutOfMemoryError)

    def release(self, blocks: list[object]) -> None:
        """Free every block and empty the cache."""
        for handle in blocks:
            assert isinstance(handle, int)  # noqa: S101 - allocate_block returned it
            self.allocator.free(handle)
        self.allocator.empty_cache()


async def run_fake(settings: Settings) -> tuple[dict[str, Any], dict[str, str]]:
    """The whole check against the fake NVML; (report, extra files)."""
    from kvguard.api.app import build_app  # noqa: PLC0415
    from kvguard.config.settings import parse_config  # noqa: PLC0415
    from kvguard.probes.engine import EngineProbe  # noqa: PLC0415
    from kvguard.probes.nvml import GpuSelector, NvmlProbe  # noqa: PLC0415
    from kvguard.runtime.assembly import listen  # noqa: PLC0415
    from kvguard.runtime.daemon import Daemon  # noqa: PLC0415
    from kvguard.runtime.probing import Probes  # noqa: PLC0415

    clock = FakeClock()
    nvml = FakeNvml(
        [
            FakeGpu(
                "NVIDIA H200 (fake)",
                "GPU-fake-0",
                settings.fake_gpu_bytes,
                used_bytes=settings.fake_other_bytes,
                reserved_bytes=settings.fake_reserved_bytes,
                processes={4_194_001: settings.fake_other_bytes},
            )
        ]
    )
    engine_url = f"http://127.0.0.1:{free_port()}"

    # 1. What `kvguard probe --json` prints, against the fake nvidia-smi.
    probe_doc = await _fake_probe(nvml, engine_url)
    smi_before = nvidia_smi_csv(nvml)
    probe = compare_probe(probe_doc, parse_nvidia_smi(smi_before))

    # 2. The load's process appears (its CUDA context), then kvguard starts beside it.
    allocator = SimulatedAllocator(nvml, 0, pid=FAKE_LOAD_PID)
    allocator.start()
    backend = SimulatedBackend(allocator)
    shape = KvShape.from_config(settings.model_config_path(settings.load_model or settings.model))
    address = f"127.0.0.1:{free_port()}"
    config = parse_config(
        guard_config(settings, engine_url=engine_url, pid=FAKE_LOAD_PID, listen=address), env={}
    )
    daemon = Daemon(
        config,
        probes=Probes(
            engine=EngineProbe(engine_url, timeout_s=1.0),
            nvml=NvmlProbe(GpuSelector(pids=(FAKE_LOAD_PID,)), nvml=nvml, timeout_s=1.0),
            host=None,
        ),
        clock=clock,
        dry_run=True,
    )
    runner = await listen(build_app(daemon), address)
    url = f"http://{address}"
    readings: list[KvguardReading] = []
    samples: list[dict[str, Any]] = []
    free_at_go = allocator.gpu.free_bytes
    load = KvLoad(
        backend,
        shape,
        tokens_per_s=free_at_go / shape.bytes_per_token / settings.fill_s,
        block_tokens=settings.block_tokens,
        concurrency=settings.concurrency,
        max_seq_tokens=settings.max_seq_tokens,
    )
    try:
        async with client_session() as session:

            async def tick() -> None:
                await daemon.tick()
                readings.append(await scrape(session, url, clock))

            for _ in range(BASELINE_TICKS):
                await tick()
                clock.advance(settings.poll_interval_s)
            start = {
                "event": "go",
                "t": clock(),
                "tokens_per_s": load.tokens_per_s,
                "bytes_per_token": shape.bytes_per_token,
                "allocated_bytes": backend.allocated_bytes(),
                "reserved_bytes": backend.reserved_bytes(),
                "free_bytes": free_at_go,
            }
            end = await _fake_ramp(
                load,
                clock,
                tick,
                next_interval=daemon.next_interval,
                samples=samples,
                max_s=settings.max_load_s,
            )
            load.release()
            allocator.shutdown()
            samples.append({**load.sample(clock()), "event": "released"})
            clock.advance(settings.poll_interval_s)
            await tick()  # kvguard after the load has gone
    finally:
        await runner.cleanup()
        await daemon.close()
    smi_after = nvidia_smi_csv(nvml)
    after = left_as_found(parse_nvidia_smi(smi_before), parse_nvidia_smi(smi_after))
    report = build_report(
        mode="fake",
        settings=_settings_dict(settings, shape),
        probe=probe,
        readings=readings,
        load_samples=samples,
        load_start=start,
        load_end=end,
        after=after,
    )
    extra = {
        "probe.json": json.dumps(probe_doc, indent=2) + "\n",
        "nvidia-smi-before.csv": smi_before,
        "nvidia-smi-after.csv": smi_after,
    }
    return report, extra


async def _fake_probe(nvml: FakeNvml, engine_url: str) -> dict[str, Any]:
    """What ``kvguard probe --json`` prints, with the fake NVML (and no engine)."""
    from kvguard.cli.probe import probe_document  # noqa: PLC0415
    from kvguard.config.settings import config_for_engine  # noqa: PLC0415
    from kvguard.probes.engine import EngineProbe  # noqa: PLC0415
    from kvguard.probes.nvml import GpuSelector, NvmlProbe  # noqa: PLC0415
    from kvguard.runtime.daemon import Daemon  # noqa: PLC0415
    from kvguard.runtime.probing import Probes  # noqa: PLC0415

    daemon = Daemon(
        config_for_engine(engine_url),
        probes=Probes(
            engine=EngineProbe(engine_url, timeout_s=1.0),
            nvml=NvmlProbe(GpuSelector(), nvml=nvml, timeout_s=1.0),
            host=None,
        ),
    )
    try:
        await daemon.tick()
        return probe_document(daemon)
    finally:
        await daemon.close()


async def _fake_ramp(
    load: KvLoad,
    clock: FakeClock,
    tick: Callable[[], Awaitable[None]],
    *,
    next_interval: Callable[[], float],
    samples: list[dict[str, Any]],
    max_s: float,
) -> dict[str, Any]:
    """Grow the load between kvguard's ticks on the fake clock until OOM or ``max_s``."""
    go = clock()
    steps_per_sample = max(1, round(0.25 / FAKE_STEP_S))
    step = 0
    while clock() - go < max_s:
        tick_at = clock() + next_interval()  # kvguard's own pace (faster when nearly full)
        while clock() < tick_at - 1e-9:
            clock.advance(min(FAKE_STEP_S, tick_at - clock()))
            try:
                load.advance(clock() - go)
            except Exception as exc:
                if not load.backend.is_oom(exc):
                    raise
                samples.append(load.sample(clock()))
                return {
                    "event": "oom",
                    "t": clock(),
                    "error": str(exc),
                    "tokens": load.tokens,
                    "blocks": load.blocks,
                    "token_capacity": load.token_capacity,
                    "allocated_bytes": load.backend.allocated_bytes(),
                    "reserved_bytes": load.backend.reserved_bytes(),
                }
            step += 1
            if step % steps_per_sample == 0:
                samples.append(load.sample(clock()))
        samples.append(load.sample(clock()))
        await tick()
    return {"event": "deadline", "t": clock(), "tokens": load.tokens, "blocks": load.blocks}


def _settings_dict(settings: Settings, shape: KvShape) -> dict[str, Any]:
    out = asdict(settings)
    out["load_shape"] = {
        "source": shape.source,
        "layers": shape.layers,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "dtype": shape.dtype,
        "bytes_per_token": shape.bytes_per_token,
    }
    return out


# ------------------------------------------------------------------ real GPU
async def _run_command(argv: list[str], timeout_s: float) -> tuple[int, str, str]:
    """Run ``argv`` (no shell) and collect its output; killed after ``timeout_s``."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except (asyncio.TimeoutError, TimeoutError):
        proc.kill()
        await proc.wait()
        raise CheckError(f"{' '.join(argv[:3])}… did not finish within {timeout_s:g} s") from None
    return int(proc.returncode or 0), out.decode(), err.decode()


async def _stop(proc: asyncio.subprocess.Process | None, grace_s: float) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``: a process we started never outlives the run."""
    if proc is None or proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), grace_s)
    except (asyncio.TimeoutError, TimeoutError):
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


class LoadProcess:
    """``python -m bench.gpu_load`` as a child: its JSON-line events, as they come."""

    def __init__(self, proc: asyncio.subprocess.Process, log: Path) -> None:
        self.proc = proc
        self.events: list[dict[str, Any]] = []
        self._log = log.open("w")
        self._changed = asyncio.Event()
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None  # noqa: S101 - started with a pipe
        async for raw in self.proc.stdout:
            line = raw.decode().strip()
            self._log.write(line + "\n")
            with contextlib.suppress(ValueError):
                self.events.append(json.loads(line))
            self._changed.set()
        self._changed.set()

    async def wait_for(self, names: tuple[str, ...], timeout_s: float) -> dict[str, Any]:
        """The first event named one of ``names``; CheckError on timeout or exit."""
        deadline = time.monotonic() + timeout_s
        while True:
            for event in self.events:
                if event.get("event") in names:
                    return event
            if self._reader.done():
                raise CheckError(f"the load exited ({self.proc.returncode}) before {names[0]}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise CheckError(f"the load sent no {names[0]} within {timeout_s:g} s")
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 1.0))

    def go(self) -> None:
        """Tell the load to start growing."""
        assert self.proc.stdin is not None  # noqa: S101 - started with a pipe
        self.proc.stdin.write(b"go\n")

    async def close(self) -> None:
        """Stop the load (it frees its memory on exit) and the reader."""
        await _stop(self.proc, 30.0)  # emptying a full GPU's cache takes a moment
        with contextlib.suppress(asyncio.TimeoutError, TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(self._reader, 5.0)
        self._log.close()


async def _watch(
    session: aiohttp.ClientSession, url: str, readings: list[KvguardReading], stop: asyncio.Event
) -> None:
    """Read /metrics every 50 ms; keep one reading per kvguard tick."""
    while not stop.is_set():
        with contextlib.suppress(
            aiohttp.ClientError, asyncio.TimeoutError, TimeoutError, ValueError
        ):
            reading = await scrape(session, url, time.monotonic)
            if not readings or reading.ticks > readings[-1].ticks:
                readings.append(reading)
        with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
            await asyncio.wait_for(stop.wait(), SCRAPE_INTERVAL_S)


async def _until_ticking(readings: list[KvguardReading], count: int, timeout_s: float) -> bool:
    """True once ``count`` readings in a row have NVML up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len(readings) >= count and all(r.nvml_up for r in readings[-count:]):
            return True
        await asyncio.sleep(0.1)
    return False


async def _gpu_probe(engine_url: str) -> tuple[dict[str, Any], str]:
    """``kvguard probe --json`` (exit 1: no engine answers, as expected) and nvidia-smi."""
    rc, text, err = await _run_command(
        [sys.executable, "-m", "kvguard.cli.main", "probe", "--json", "--engine-url", engine_url],
        60,
    )
    try:
        probe_doc = json.loads(text)
    except ValueError:
        raise CheckError(
            f"kvguard probe --json printed no JSON (exit {rc}): {err.strip()[-500:]}"
        ) from None
    rc, smi, err = await _run_command(list(NVIDIA_SMI_QUERY), 30)
    if rc != 0:
        raise CheckError(f"nvidia-smi failed (exit {rc}): {err.strip()}")
    return probe_doc, smi


async def _start_load(settings: Settings, out: Path) -> LoadProcess:
    """``python -m bench.gpu_load`` on the chosen GPU, waiting for ``go``."""
    model_config = settings.model_config_path(settings.load_model or settings.model)
    flags = {
        "--model-config": str(model_config),
        "--device": str(settings.device),
        "--fill-s": str(settings.fill_s),
        "--block-tokens": str(settings.block_tokens),
        "--concurrency": str(settings.concurrency),
        "--max-seq-tokens": str(settings.max_seq_tokens),
        "--max-s": str(settings.max_load_s),
    }
    env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}  # CUDA indices = NVML indices
    with (out / "load-stderr.log").open("w") as stderr:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.gpu_load",
            *(part for pair in flags.items() for part in pair),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,  # the child holds its own copy
            cwd=ROOT,
            env=env,
        )
    return LoadProcess(proc, out / "load-events.jsonl")


class Guard:
    """``kvguard run --dry-run`` as a child, and its /metrics read after every tick."""

    def __init__(self, settings: Settings, out: Path, engine_url: str, pid: int) -> None:
        self.settings, self.out, self.engine_url, self.pid = settings, out, engine_url, pid
        self.readings: list[KvguardReading] = []
        self.selection = "pid"
        self._proc: asyncio.subprocess.Process | None = None
        self._stop = asyncio.Event()
        self._watcher: asyncio.Future[None] | None = None

    async def start(self, session: aiohttp.ClientSession) -> None:
        """Start kvguard; once it ticks with NVML up, return (CheckError if it never does)."""
        await self._launch(session, gpu_index=None)
        if await _until_ticking(self.readings, BASELINE_TICKS, 20):
            return
        # NVML reports host PIDs: in a container without the host's PID namespace the
        # load's PID matches no GPU. Select the GPU by index instead.
        self.selection = f"index {self.settings.device} (selection by pid matched no GPU)"
        await self.stop()
        self.readings.clear()
        await self._launch(session, gpu_index=self.settings.device)
        if not await _until_ticking(self.readings, BASELINE_TICKS, 20):
            raise CheckError("kvguard's NVML probe never came up (see kvguard.log)")

    async def _launch(self, session: aiohttp.ClientSession, gpu_index: int | None) -> None:
        address = f"127.0.0.1:{free_port()}"
        config = guard_config(
            self.settings,
            engine_url=self.engine_url,
            pid=self.pid,
            listen=address,
            gpu_index=gpu_index,
        )
        path = self.out / "kvguard.toml"
        path.write_text(to_toml(config))
        with (self.out / "kvguard.log").open("a") as log:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "kvguard.cli.main",
                "run",
                "--config",
                str(path),
                "--dry-run",
                stdout=log,
                stderr=log,
                cwd=ROOT,
            )
        self._stop.clear()
        self._watcher = asyncio.ensure_future(
            _watch(session, f"http://{address}", self.readings, self._stop)
        )

    async def stop(self) -> None:
        """Stop reading and stop kvguard (killed if it does not stop in 10 s)."""
        self._stop.set()
        if self._watcher is not None:
            await self._watcher
        await _stop(self._proc, 10)


async def _after(smi_before: str) -> tuple[dict[str, Any], str]:
    """nvidia-smi until the memory is back as it was (the driver takes a moment), ≤ 10 s."""
    deadline = time.monotonic() + 10.0
    while True:
        rc, smi_after, err = await _run_command(list(NVIDIA_SMI_QUERY), 30)
        if rc != 0:
            return {"ok": False, "why": f"nvidia-smi failed (exit {rc}): {err.strip()}"}, ""
        after = left_as_found(parse_nvidia_smi(smi_before), parse_nvidia_smi(smi_after))
        if after["ok"] or time.monotonic() > deadline:
            return after, smi_after
        await asyncio.sleep(0.5)


async def run_gpu(settings: Settings, out: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The whole check on this machine's NVIDIA GPU; (report, extra files)."""
    if shutil.which("nvidia-smi") is None:
        raise CheckError("nvidia-smi not found: run on a machine with the NVIDIA driver, or --fake")
    engine_url = f"http://127.0.0.1:{free_port()}"
    probe_doc, smi_before = await _gpu_probe(engine_url)
    probe = compare_probe(probe_doc, parse_nvidia_smi(smi_before))
    shape = KvShape.from_config(settings.model_config_path(settings.load_model or settings.model))
    load = await _start_load(settings, out)
    guard: Guard | None = None
    try:
        ready = await load.wait_for(("ready",), 120)
        guard = Guard(settings, out, engine_url, int(ready["pid"]))
        async with client_session() as session:
            try:
                await guard.start(session)
                load.go()
                start = {
                    **await load.wait_for(("go",), 10),
                    "bytes_per_token": ready["bytes_per_token"],
                    "reserved_bytes": ready["reserved_bytes"],
                }
                end = await load.wait_for(("oom", "deadline"), settings.max_load_s + 30)
                await asyncio.sleep(1.0)  # a few more ticks: kvguard sees the fall
            finally:
                await guard.stop()
    finally:
        await load.close()
    # Before growing, the load held only its context and a 512-byte anchor tensor.
    start["allocated_bytes"] = next(
        (e["allocated_bytes"] for e in load.events if e.get("event") == "sample"), 0
    )
    after, smi_after = await _after(smi_before)
    report = build_report(
        mode="gpu",
        settings={**_settings_dict(settings, shape), "gpu_selection": guard.selection},
        probe=probe,
        readings=guard.readings,
        load_samples=[e for e in load.events if e.get("event") in ("sample", "released")],
        load_start=start,
        load_end=end,
        after=after,
    )
    extra = {
        "probe.json": json.dumps(probe_doc, indent=2) + "\n",
        "nvidia-smi-before.csv": smi_before,
        "nvidia-smi-after.csv": smi_after,
    }
    return report, extra


# ------------------------------------------------------------------ entry point
def out_dir(settings: Settings) -> Path:
    """``--out``, else ``$KVGUARD_GPU_CHECK_OUT``, else a new temporary folder."""
    chosen = settings.out or os.environ.get("KVGUARD_GPU_CHECK_OUT")
    if chosen:
        return Path(chosen)
    return Path(tempfile.mkdtemp(prefix="kvguard-gpu-check-"))


async def check(settings: Settings) -> tuple[dict[str, Any], Path]:
    """Run the check, write its results; (report, the report's path)."""
    out = out_dir(settings)
    out.mkdir(parents=True, exist_ok=True)
    runner = run_fake(settings) if settings.fake else run_gpu(settings, out)
    try:
        report, extra = await asyncio.wait_for(runner, settings.deadline_s)
    except (asyncio.TimeoutError, TimeoutError):
        raise CheckError(f"the check did not finish within {settings.deadline_s:g} s") from None
    written = write_results(report, out, extra)
    return report, written[-1]


def parse_args(argv: list[str] | None = None) -> Settings:
    """Command-line flags into :class:`Settings` (bad values: exit 2 with the flag named)."""
    parser = argparse.ArgumentParser(prog="gpu-check", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fake", action="store_true", help="no GPU: fake NVML, simulated allocator"
    )
    parser.add_argument(
        "--out", metavar="DIR", help="results folder (default $KVGUARD_GPU_CHECK_OUT)"
    )
    parser.add_argument("--model", default=Settings.model, help="kvguard's [model] config")
    parser.add_argument("--load-model", help="the load's KV shape (default: --model)")
    parser.add_argument(
        "--fill-s", type=float, default=None, help="seconds to fill the free memory"
    )
    parser.add_argument("--device", type=int, default=0, help="CUDA/NVML index of the GPU to fill")
    parser.add_argument("--deadline-s", type=float, default=Settings.deadline_s)
    args = parser.parse_args(argv)
    fill = args.fill_s if args.fill_s is not None else (60.0 if args.fake else Settings.fill_s)
    if not 5.0 <= fill <= 150.0:
        parser.error(f"--fill-s: between 5 and 150 seconds (the run is bounded), got {fill:g}")
    if args.device < 0:
        parser.error(f"--device: a GPU index, 0 or more, got {args.device}")
    if not 30.0 <= args.deadline_s <= 450.0:
        parser.error(f"--deadline-s: between 30 and 450 seconds, got {args.deadline_s:g}")
    return Settings(
        fake=args.fake,
        model=args.model,
        load_model=args.load_model,
        fill_s=fill,
        device=args.device,
        deadline_s=args.deadline_s,
        out=args.out,
    )


def main(argv: list[str] | None = None) -> int:
    """Run the check; print the table last; exit 0 passed, 1 failed, 2 could not run."""
    settings = parse_args(argv)
    saved = structlog.get_config()
    if settings.fake:
        # kvguard runs in this process: its events go to stderr, the table to stdout.
        configure_logging("warning", "auto")
    try:
        report, path = asyncio.run(check(settings))
    except (CheckError, LoadError) as exc:
        print(f"gpu-check: error: {exc}", file=sys.stderr)  # noqa: T201 - the script's report
        return EXIT_CANNOT_RUN
    finally:
        structlog.configure(**saved)  # a caller's (or a test's) logging as it was
    print(render_table(report, str(path)))  # noqa: T201 - the script's report
    return EXIT_PASSED if report["passed"] else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
