"""`kvguard sim-engine` as a process: start-up line, signals, crash exit code, bad input."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
from pathlib import Path

import aiohttp

KVGUARD = str(Path(sys.executable).parent / "kvguard")


async def start(*args: str) -> tuple[asyncio.subprocess.Process, str]:
    """Start the CLI on a free port and return it with the URL from its start-up line."""
    proc = await asyncio.create_subprocess_exec(
        KVGUARD, "sim-engine", "--port", "0", *args, stderr=asyncio.subprocess.PIPE
    )
    assert proc.stderr is not None
    line = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode()
    match = re.search(r"on (http://127\.0\.0\.1:\d+);", line)
    assert match, line
    return proc, match.group(1)


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


async def _post_status(http: aiohttp.ClientSession, url: str, body: dict) -> int:
    try:
        async with http.post(url, json=body) as resp:
            return resp.status
    except aiohttp.ClientError:
        return -1
