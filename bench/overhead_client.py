"""The overhead benchmark's load client: its own process, so it gets its own core share.

For one URL and each kind of completion (``json``: whole answers, ``stream``: SSE), it
runs a short warm-up, then

* **open loop**: requests sent on a fixed schedule (``--rate`` per second for
  ``--open-s`` seconds) whatever the answers do, so a stalled server cannot hide its
  stall by slowing the sender (no coordinated omission); each latency runs from the
  moment the request is sent to the end of its answer's body, and how late the sender
  ran behind its schedule is reported beside it;
* **closed loop**: ``--concurrency`` workers, each sending its next request as soon as
  the previous one is answered, for ``--closed-s`` seconds: the maximum throughput.

Every prompt is new (a per-process tag and a counter), as in real traffic, so a proxy
that tokenizes prompts cannot answer from its cache; ``--repeat-prompt`` sends one
prompt over and over instead, to tell that cost apart. It prints one JSON object on
stdout. Bounded: at most ``rate x open_s`` open-loop requests, every request times out.

    .venv/bin/python -m bench.overhead_client --url http://127.0.0.1:PORT [--rate 200]
        [--open-s 5] [--closed-s 3] [--concurrency 32] [--warmup-s 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
from collections import Counter
from typing import Any

import aiohttp

KINDS = ("json", "stream")
REQUEST_TIMEOUT_S = 10.0
PATH = "/v1/completions"
WARMUP_CONCURRENCY = 4


class Bodies:
    """Request bodies with prompts never seen before (tag + counter), or one repeated prompt."""

    def __init__(self, stream: bool, *, repeat: bool = False) -> None:
        self.stream = stream
        self.repeat = repeat
        self.tag = f"{os.getpid()}-{'s' if stream else 'j'}"
        self.counter = itertools.count()

    def next(self) -> bytes:
        """The next body: a ~30-word prompt, 5 tokens asked for."""
        serial = "same" if self.repeat else next(self.counter)
        prompt = f"request {self.tag}-{serial} " + "lorem ipsum " * 14
        body = {"model": "overhead-stub", "prompt": prompt, "max_tokens": 5, "stream": self.stream}
        return json.dumps(body).encode()


async def _send(http: aiohttp.ClientSession, url: str, body: bytes) -> int:
    """POST ``body``, read the whole answer; the status, or -1 for a failure."""
    try:
        async with http.post(
            url, data=body, headers={"Content-Type": "application/json"}
        ) as response:
            await response.read()
            return response.status
    except (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError):
        return -1


async def open_loop(
    http: aiohttp.ClientSession, url: str, bodies: Bodies, rate: float, seconds: float
) -> dict[str, Any]:
    """Send ``rate`` requests per second on schedule; latencies from each send, in ms."""
    loop = asyncio.get_running_loop()
    count = max(1, int(rate * seconds))
    start = loop.time() + 0.02

    async def one() -> tuple[int, float]:
        sent = loop.time()
        status = await _send(http, url, bodies.next())
        return status, (loop.time() - sent) * 1000.0

    tasks = []
    late_ms = 0.0
    for i in range(count):
        at = start + i / rate
        delay = at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            late_ms = max(late_ms, -delay * 1000.0)
        tasks.append(asyncio.ensure_future(one()))
    results = await asyncio.gather(*tasks)
    statuses = Counter(status for status, _ in results)
    return {
        "rate_per_s": rate,
        "sent": count,
        "ok": statuses.get(200, 0),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "sender_late_ms_max": round(late_ms, 3),
        "latencies_ms": [round(ms, 4) for status, ms in results if status == 200],
    }


async def closed_loop(
    http: aiohttp.ClientSession, url: str, bodies: Bodies, concurrency: int, seconds: float
) -> dict[str, Any]:
    """``concurrency`` workers back to back for ``seconds``: completed requests per second."""
    loop = asyncio.get_running_loop()
    statuses: Counter[int] = Counter()
    start = loop.time()
    deadline = start + seconds

    async def worker() -> None:
        while loop.time() < deadline:
            statuses[await _send(http, url, bodies.next())] += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = loop.time() - start
    ok = statuses.get(200, 0)
    return {
        "concurrency": concurrency,
        "elapsed_s": round(elapsed, 4),
        "ok": ok,
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "requests_per_s": round(ok / elapsed, 2) if elapsed > 0 else None,
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Warm-up, open loop and closed loop, for each kind, one after another."""
    url = args.url.rstrip("/") + PATH
    connector = aiohttp.TCPConnector(limit=max(64, args.concurrency))
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as http:
        for kind in args.kinds:
            bodies = Bodies(stream=kind == "stream", repeat=args.repeat_prompt)
            # Warm-up: connections open, caches and code paths hot; not measured.
            await closed_loop(http, url, bodies, WARMUP_CONCURRENCY, args.warmup_s)
            out[kind] = {
                "open": await open_loop(http, url, bodies, args.rate, args.open_s),
                "closed": await closed_loop(http, url, bodies, args.concurrency, args.closed_s),
            }
    return out


def main() -> None:
    """Parse the arguments, measure, print the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--open-s", type=float, default=5.0)
    parser.add_argument("--closed-s", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--warmup-s", type=float, default=0.5)
    parser.add_argument(
        "--repeat-prompt",
        action="store_true",
        help="send one prompt over and over (a tokenizing proxy answers it from its cache)",
    )
    args = parser.parse_args()
    if not args.url.startswith("http://127.0.0.1:"):
        parser.error("--url must be on http://127.0.0.1 (the benchmark stays on this machine)")
    json.dump(asyncio.run(measure(args)), sys.stdout)


if __name__ == "__main__":
    main()
