"""`kvguard sim-engine` as a process: start-up line, signals, crash exit code, bad input."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from kvguard.cli.main import build_parser
from kvguard.errors import InvalidInputError
from kvguard.sim.runner import PoolSpec, size_pool

KVGUARD = str(Path(sys.executable).parent / "kvguard")


async def start(*args: str) -> tuple[asyncio.subprocess.Process, str]:
    """Start the CLI on a free port and return it with the URL from its start-up line."""
    proc, url, _ = await start_with_line(*args)
    return proc, url


async def start_with_line(*args: str) -> tuple[asyncio.subprocess.Process, str, str]:
    """Like :func:`start`, with the start-up line itself."""
    proc = await asyncio.create_subprocess_exec(
        KVGUARD, "sim-engine", "--port", "0", *args, stderr=asyncio.subprocess.PIPE
    )
    assert proc.stderr is not None
    line = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode()
    match = re.search(r"on (http://127\.0\.0\.1:\d+);", line)
    assert match, line
    return proc, match.group(1), line


async def test_sigterm_stops_cleanly():
    """SIGTERM ends the server with exit code 0."""
    proc, url = await start()
    async with aiohttp.ClientSession() as http, http.get(f"{url}/health") as resp:
        assert resp.status == 200
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), 30) == 0


async def test_simulated_oom_exits_with_code_1_and_says_why():
    """--oom-on-exhaust: a burst past the pool kills the process with a clear message."""
    proc, url = await start(
        "--kv-capacity-tokens", "2048", "--max-model-len", "1024", "--oom-on-exhaust"
    )
    body = {"prompt": "word " * 500, "max_tokens": 400}
    async with aiohttp.ClientSession() as http:
        statuses = await asyncio.gather(
            *(_post_status(http, f"{url}/v1/completions", body) for _ in range(6))
        )
    assert set(statuses) <= {500, -1}  # -1: the connection closed as the process exited
    assert await asyncio.wait_for(proc.wait(), 30) == 1
    assert proc.stderr is not None
    rest = (await proc.stderr.read()).decode()
    assert "simulated CUDA out of memory" in rest
    assert "in-flight requests lost" in rest


async def test_pool_too_small_for_max_model_len_is_one_line():
    """A max_model_len the pool cannot hold is refused at start, as vLLM refuses it."""
    proc = await asyncio.create_subprocess_exec(
        KVGUARD,
        "sim-engine",
        "--kv-capacity-tokens",
        "1024",
        "--max-model-len",
        "4096",
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await proc.communicate()
    assert proc.returncode == 2
    assert err.decode().strip() == (
        "kvguard sim-engine: error: --max-model-len: must fit in the KV pool of 1008 tokens"
        " (64 blocks, one reserved), got 4096"
    )


def test_scheduling_policy_flag_parses():
    """--scheduling-policy takes fcfs or priority and defaults to fcfs."""
    parser = build_parser()
    assert parser.parse_args(["sim-engine"]).scheduling_policy == "fcfs"
    args = parser.parse_args(["sim-engine", "--scheduling-policy", "priority"])
    assert args.scheduling_policy == "priority"


async def test_scheduling_policy_reaches_the_scheduler():
    """--scheduling-policy priority: said at start-up, in /server_info, and priorities accepted."""
    proc, url, line = await start_with_line("--scheduling-policy", "priority")
    try:
        assert "scheduling policy priority" in line
        body = {"prompt": "hello", "max_tokens": 2, "priority": 7}
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/server_info") as resp:
                assert (await resp.json())["scheduling_policy"] == "priority"
            async with http.post(f"{url}/v1/completions", json=body) as resp:
                assert resp.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0


def test_pool_spec_refuses_an_unknown_policy():
    """A PoolSpec built in code gets the same refusal as the flag, naming the field."""
    with pytest.raises(InvalidInputError) as caught:
        size_pool(PoolSpec(scheduling_policy="lifo"))  # type: ignore[arg-type]
    assert str(caught.value) == "scheduling_policy: must be one of fcfs, priority, got 'lifo'"


async def test_unknown_scheduling_policy_is_refused():
    """A policy that is not fcfs or priority is refused before anything starts."""
    proc = await asyncio.create_subprocess_exec(
        KVGUARD, "sim-engine", "--scheduling-policy", "lifo", stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate()
    assert proc.returncode == 2
    assert "--scheduling-policy" in err.decode()
    assert "lifo" in err.decode()


async def _post_status(http: aiohttp.ClientSession, url: str, body: dict) -> int:
    try:
        async with http.post(url, json=body) as resp:
            return resp.status
    except aiohttp.ClientError:
        return -1
