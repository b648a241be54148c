"""``kvguard sim-engine``: serve a simulated engine on 127.0.0.1."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from kvguard.core.gpus import gpu_preset
from kvguard.core.units import KV_DTYPES, parse_bytes
from kvguard.sim.engine import TimeModel
from kvguard.sim.metrics import FLAVORS
from kvguard.sim.runner import (
    DEFAULT_KV_CAPACITY_TOKENS,
    PoolSpec,
    serve_forever,
    size_pool,
    start_sim_server,
)
from kvguard.sim.scheduler import SCHEDULING_POLICIES


def register(commands: argparse._SubParsersAction[Any]) -> None:
    """Add the ``sim-engine`` subcommand."""
    p = commands.add_parser(
        "sim-engine",
        help="serve a simulated vLLM/SGLang/llama.cpp engine with a paged KV cache (no GPU)",
        description=(
            "Serve a simulated inference engine: OpenAI API, /metrics and admin endpoints"
            " of the chosen flavor, driven by a paged KV-cache scheduler in real time."
        ),
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument(
        "--flavor",
        choices=FLAVORS,
        default="vllm",
        help="whose metric names and endpoints (default vllm)",
    )
    p.add_argument("--served-model-name", default="kvguard-sim", help="model id in /v1/models")
    pool = p.add_argument_group("KV pool (tokens, or the budget of --model on --gpu-memory)")
    pool.add_argument(
        "--kv-capacity-tokens",
        type=int,
        help="pool size in tokens at the model dtype"
        f" (default {DEFAULT_KV_CAPACITY_TOKENS} unless --model with --gpu-memory/--gpu)",
    )
    pool.add_argument(
        "--model", metavar="CONFIG", help="model config (path or bundled name) for the budget"
    )
    mem = pool.add_mutually_exclusive_group()
    mem.add_argument("--gpu-memory", metavar="SIZE", help="GPU memory for the budget, e.g. 24GiB")
    mem.add_argument("--gpu", metavar="NAME", help="GPU preset for the budget, e.g. L4")
    pool.add_argument(
        "--gpu-memory-utilization",
        type=float,
        metavar="F",
        help="as vLLM's flag (default: current vLLM's, 0.92)",
    )
    pool.add_argument(
        "--kv-cache-dtype", default="auto", metavar="DTYPE", help=f"one of {', '.join(KV_DTYPES)}"
    )
    pool.add_argument("--block-size", type=int, default=16)
    pool.add_argument("--max-model-len", type=int, default=4096)
    pool.add_argument("--max-num-seqs", type=int, default=64)
    pool.add_argument("--max-num-batched-tokens", type=int, default=2048)
    pool.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default="fcfs",
        help="as vLLM's: fcfs (arrival order, default) or priority (the request's"
        " 'priority' field, lower first; the lowest is preempted first)",
    )
    timing = p.add_argument_group("time model: step = fixed + per-token x tokens")
    timing.add_argument(
        "--step-time",
        type=float,
        default=TimeModel.step_fixed_s,
        metavar="S",
        help="fixed seconds per step",
    )
    timing.add_argument(
        "--token-time",
        type=float,
        default=TimeModel.per_token_s,
        metavar="S",
        help="seconds per token in a step",
    )
    timing.add_argument(
        "--seed", type=int, default=0, help="seed for generated text and timing jitter"
    )
    faults = p.add_argument_group("failure modes (off by default)")
    faults.add_argument(
        "--oom-on-exhaust",
        action="store_true",
        help="crash instead of preempting when the pool runs out",
    )
    faults.add_argument(
        "--activation-limit-tokens",
        type=int,
        metavar="N",
        help="crash on a step with more than N prefill tokens",
    )
    faults.add_argument(
        "--on-crash",
        choices=("exit", "stay"),
        default="exit",
        help="after a simulated OOM: exit with code 1 (default) or keep serving /health 503",
    )
    p.add_argument(
        "--no-dev-endpoints",
        action="store_true",
        help="hide vLLM's dev-mode admin endpoints (as without VLLM_SERVER_DEV_MODE=1)",
    )
    p.set_defaults(handler=run_sim_engine)


def run_sim_engine(args: argparse.Namespace) -> int:
    """Size the pool, start the server, serve until a signal or a crash."""
    memory = None
    if args.gpu is not None:
        memory = gpu_preset(args.gpu).memory_bytes
    elif args.gpu_memory is not None:
        memory = parse_bytes(args.gpu_memory, "--gpu-memory")
    spec = PoolSpec(
        kv_capacity_tokens=args.kv_capacity_tokens,
        model=args.model,
        gpu_memory_bytes=memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        oom_on_exhaust=args.oom_on_exhaust,
        activation_limit_tokens=args.activation_limit_tokens,
        scheduling_policy=args.scheduling_policy,
    )
    pool = size_pool(spec)
    time_model = TimeModel(step_fixed_s=args.step_time, per_token_s=args.token_time)

    def announce(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    async def main() -> int:
        server = await start_sim_server(
            pool,
            host=args.host,
            port=args.port,
            flavor=args.flavor,
            model_name=args.served_model_name,
            dev_endpoints=not args.no_dev_endpoints,
            time_model=time_model,
            seed=args.seed,
        )
        config = pool.scheduler
        announce(
            f"sim-engine: {args.flavor} flavor of {args.served_model_name!r} on {server.url};"
            f" KV pool {config.num_gpu_blocks:,} blocks x {config.block_size} ="
            f" {config.capacity_tokens:,} usable tokens ({pool.origin}), max_model_len"
            f" {config.max_model_len:,}, max_num_seqs {config.max_num_seqs},"
            f" scheduling policy {config.scheduling_policy}"
        )
        return await serve_forever(server, exit_on_crash=args.on_crash == "exit", announce=announce)

    return asyncio.run(main())
