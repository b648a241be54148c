"""Start and stop a simulated engine server on a host and port.

Shared by ``kvguard sim-engine``, the tests and (later) ``kvguard demo``: builds
the pool from a token count or from the VRAM budget of a model, and serves it.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from kvguard.config.model_files import load_model_files
from kvguard.core.budget import budget_inputs_from, plan_budget
from kvguard.core.units import dtype_bytes
from kvguard.errors import InvalidInputError, KvguardError
from kvguard.sim.engine import SimEngine, TimeModel
from kvguard.sim.http_common import SimServerSettings
from kvguard.sim.metrics import CacheInfo, Flavor
from kvguard.sim.scheduler import SCHEDULING_POLICIES, SchedulerConfig, SchedulingPolicy
from kvguard.sim.server import build_app

DEFAULT_KV_CAPACITY_TOKENS = 16_384
DEFAULT_KV_BYTES_PER_TOKEN = 131_072  # Llama-3.1-8B in bf16, for the reported byte figures


@dataclass(frozen=True)
class PoolSpec:
    """How the simulated KV pool is sized: a token count, or a model's budget."""

    kv_capacity_tokens: int | None = None
    model: str | None = None
    gpu_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None  # None: vLLM's current default
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    max_model_len: int = 4096
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    oom_on_exhaust: bool = False
    activation_limit_tokens: int | None = None
    scheduling_policy: SchedulingPolicy = "fcfs"


@dataclass(frozen=True)
class SizedPool:
    """The scheduler's configuration and the cache facts the metrics report."""

    scheduler: SchedulerConfig
    cache: CacheInfo
    origin: str


def size_pool(spec: PoolSpec) -> SizedPool:
    """Turn a :class:`PoolSpec` into block counts.

    ``kv_capacity_tokens`` is the pool at the model dtype; ``fp8`` holds twice the
    tokens in the same memory. With ``model`` and GPU memory, the pool is exactly
    what ``kvguard budget`` predicts (``kv_capacity_blocks``).
    """
    for name in ("block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidInputError(name, value, "must be an integer >= 1")
    if spec.scheduling_policy not in SCHEDULING_POLICIES:
        raise InvalidInputError(
            "scheduling_policy",
            spec.scheduling_policy,
            f"must be one of {', '.join(SCHEDULING_POLICIES)}",
        )
    if spec.model is not None and spec.kv_capacity_tokens is None and spec.gpu_memory_bytes is None:
        raise InvalidInputError(
            "model",
            spec.model,
            "needs --gpu-memory or --gpu to size the pool (or --kv-capacity-tokens)",
        )
    fp8_factor = (
        2 if spec.kv_cache_dtype.lower() != "auto" and dtype_bytes(spec.kv_cache_dtype) == 1 else 1
    )
    bytes_per_token = DEFAULT_KV_BYTES_PER_TOKEN // fp8_factor
    origin = ""
    if spec.model is not None:
        files = load_model_files(spec.model)
        report = plan_budget(
            files.config,
            budget_inputs_from(spec),
            index_total_size=files.index_total_size,
            source=files.source,
        )
        bytes_per_token = report.budget.kv_bytes_per_token_per_gpu
        if spec.kv_capacity_tokens is None:
            blocks = report.budget.kv_capacity_blocks
            origin = f"budget of {files.source}"
    if spec.kv_capacity_tokens is not None or spec.model is None:
        tokens = spec.kv_capacity_tokens or DEFAULT_KV_CAPACITY_TOKENS
        if tokens < 1:
            raise InvalidInputError("kv_capacity_tokens", tokens, "must be an integer >= 1")
        blocks = tokens * fp8_factor // spec.block_size
        origin = f"{tokens:,} tokens" + (" x 2 (fp8)" if fp8_factor == 2 else "")
    config = SchedulerConfig(
        num_gpu_blocks=blocks,
        block_size=spec.block_size,
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        max_model_len=spec.max_model_len,
        oom_on_exhaust=spec.oom_on_exhaust,
        activation_limit_tokens=spec.activation_limit_tokens,
        scheduling_policy=spec.scheduling_policy,
    )
    if config.capacity_tokens < spec.max_model_len:
        # vLLM refuses to start when one max_model_len sequence does not fit.
        raise InvalidInputError(
            "max_model_len",
            spec.max_model_len,
            f"must fit in the KV pool of {config.capacity_tokens} tokens"
            f" ({blocks} blocks, one reserved)",
        )
    dtype = spec.kv_cache_dtype
    utilization = budget_inputs_from(spec).utilization  # vLLM's default where not given
    return SizedPool(config, CacheInfo(dtype, utilization, bytes_per_token), origin)


@dataclass
class SimServer:
    """A running simulated engine and its HTTP server."""

    engine: SimEngine
    runner: web.AppRunner
    url: str
    crashed: asyncio.Event = field(default_factory=asyncio.Event)
    crash_messages: list[str] = field(default_factory=list)

    async def stop(self) -> None:
        """Stop the engine (failing in-flight requests at once), then stop serving."""
        # Engine first: open streams end now instead of holding the shutdown for
        # as long as aiohttp waits for handlers.
        await self.engine.stop()
        await self.runner.cleanup()


async def start_sim_server(
    pool: SizedPool,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    flavor: Flavor = "vllm",
    model_name: str = "kvguard-sim",
    dev_endpoints: bool = True,
    time_model: TimeModel | None = None,
    seed: int = 0,
) -> SimServer:
    """Start the engine and serve it; port 0 picks a free port (see ``.url``)."""
    crashed = asyncio.Event()
    messages: list[str] = []

    def on_crash(reason: str) -> None:
        messages.append(reason)
        crashed.set()

    engine = SimEngine(pool.scheduler, time_model, seed=seed, on_crash=on_crash)
    settings = SimServerSettings(flavor, model_name, dev_endpoints, pool.cache)
    # handler_cancellation: a client that disconnects cancels its handler, which
    # aborts its request in the engine, as a real server does.
    runner = web.AppRunner(build_app(engine, settings), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise KvguardError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    bound = runner.addresses[0][1] if port == 0 else port
    engine.start()
    return SimServer(engine, runner, f"http://{host}:{bound}", crashed, messages)


async def serve_forever(
    server: SimServer, exit_on_crash: bool, announce: Callable[[str], None]
) -> int:
    """Serve until SIGINT/SIGTERM (exit 0) or a simulated crash (exit 1 when ``exit_on_crash``)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    waiters = [asyncio.ensure_future(stop.wait())]
    if exit_on_crash:
        waiters.append(asyncio.ensure_future(server.crashed.wait()))
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for waiter in waiters:
        waiter.cancel()
    crashed = server.crashed.is_set()
    await server.stop()
    if crashed:
        announce(f"sim-engine: {'; '.join(server.crash_messages)}; exiting (code 1)")
    else:
        announce("sim-engine: stopped")
    return 1 if crashed else 0
