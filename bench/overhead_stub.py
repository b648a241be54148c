"""A fast stub upstream for the overhead benchmark: an OpenAI-shaped server that never thinks.

It answers at once, so whatever sits between a client and it (kvguard's proxy, nginx)
is the bottleneck being measured:

* ``POST /v1/completions``: a small JSON completion, or with ``"stream": true`` an SSE
  stream of ``STREAM_CHUNKS`` chunks and ``data: [DONE]``, each chunk flushed on its own;
* ``POST /tokenize``: ``{"count": n, "tokens": [...]}`` as vLLM's, one token per word
  (kvguard's proxy asks it for every new prompt);
* ``GET /v1/models``, ``GET /health``, and ``GET /metrics`` (the exposition file given
  with ``--metrics``, so ``kvguard run`` watching the stub sees an idle vLLM; with
  several files, each scrape answers the next one, round robin: a page whose figures
  change from one scrape to the next, as a busy engine's do).

    .venv/bin/python -m bench.overhead_stub [--port 0] [--metrics FILE [FILE ...]]

It listens on 127.0.0.1 only and prints ``overhead-stub: listening on URL`` once ready.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import signal
import sys
from pathlib import Path

from aiohttp import web

STREAM_CHUNKS = 5
MODEL = "overhead-stub"
# A vLLM exposition with nothing running: kvguard sees an engine that is up and idle.
IDLE_METRICS = Path(__file__).resolve().parent.parent / ("tests/fixtures/engines/vllm-cpu-idle.txt")


def _completion(prompt_tokens: int) -> bytes:
    return json.dumps(
        {
            "id": "cmpl-stub",
            "object": "text_completion",
            "model": MODEL,
            "choices": [{"index": 0, "text": " ok ok ok ok ok", "finish_reason": "length"}],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": STREAM_CHUNKS,
                "total_tokens": prompt_tokens + STREAM_CHUNKS,
            },
        }
    ).encode()


def _chunk(index: int) -> bytes:
    event = {
        "id": "cmpl-stub",
        "object": "text_completion",
        "model": MODEL,
        "choices": [{"index": 0, "text": " ok", "finish_reason": None}],
    }
    if index == STREAM_CHUNKS - 1:
        event["choices"][0]["finish_reason"] = "length"
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def _words(payload: object) -> int:
    prompt = payload.get("prompt") if isinstance(payload, dict) else None
    return len(prompt.split()) if isinstance(prompt, str) else 1


async def completions(request: web.Request) -> web.StreamResponse:
    """A completion, whole or streamed, without any delay."""
    try:
        payload = await request.json()
    except ValueError:
        payload = {}
    tokens = _words(payload)
    if not (isinstance(payload, dict) and payload.get("stream")):
        return web.Response(body=_completion(tokens), content_type="application/json")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for index in range(STREAM_CHUNKS):
        await response.write(_chunk(index))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def tokenize(request: web.Request) -> web.Response:
    """The answer of vLLM's /tokenize for a prompt: one token per word."""
    try:
        payload = await request.json()
    except ValueError:
        payload = {}
    count = _words(payload)
    return web.json_response({"count": count, "max_model_len": 4096, "tokens": list(range(count))})


async def models(_: web.Request) -> web.Response:
    """The one model the stub serves."""
    return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


async def health(_: web.Request) -> web.Response:
    """Always healthy."""
    return web.Response()


def build_app(*pages: str) -> web.Application:
    """The stub's application; ``/metrics`` answers ``pages`` in turn, round robin."""
    turn = itertools.cycle(pages)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=next(turn), content_type="text/plain", charset="utf-8")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def serve(port: int, pages: list[str]) -> None:
    """Serve on 127.0.0.1 until SIGTERM or SIGINT."""
    await serve_until_stopped(build_app(*pages), port, "overhead-stub")


async def serve_until_stopped(app: web.Application, port: int, name: str) -> None:
    """Serve ``app`` on 127.0.0.1 until SIGTERM or SIGINT; print ``NAME: listening on URL``."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    bound = runner.addresses[0][1]
    print(f"{name}: listening on http://127.0.0.1:{bound}", flush=True)  # noqa: T201
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main() -> None:
    """Parse the arguments and serve."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--metrics", type=Path, nargs="+", default=[IDLE_METRICS])
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.port, [path.read_text() for path in args.metrics]))
    sys.exit(0)


if __name__ == "__main__":
    main()
