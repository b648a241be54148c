"""The floor under kvguard's proxy: a bare aiohttp pass-through, for the overhead benchmark.

kvguard's proxy is an aiohttp server relaying to an aiohttp client session. This is
the same two halves with nothing of kvguard between them: no screen, no body
parse, no admission, no accounting, no header rules beyond dropping hop-by-hop ones
— every request is forwarded as it came and every answer relayed chunk by chunk,
on the same event loop kvguard would run on (uvloop when installed) and with
kvguard's own client session (:func:`kvguard.http_client.client_session`). It is not
a proxy anyone should run; it answers one question: how much of what kvguard's proxy
costs per request is the HTTP stack, and how much is kvguard.

    .venv/bin/python -m bench.overhead_floor --upstream http://127.0.0.1:PORT [--port 0]

It listens on 127.0.0.1 only and prints ``overhead-floor: listening on URL`` once ready.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import aiohttp
from aiohttp import web

from bench.overhead_stub import serve_until_stopped
from kvguard.actuators.proxy.forward import HOP_BY_HOP
from kvguard.http_client import client_session
from kvguard.runtime.event_loop import choose_loop
from kvguard.runtime.event_loop import run as run_loop


def build_app(upstream: str) -> web.Application:
    """A catch-all handler forwarding every request to ``upstream``."""
    sessions: list[aiohttp.ClientSession] = []

    async def forward(request: web.Request) -> web.StreamResponse:
        if not sessions:
            sessions.append(client_session(auto_decompress=False))
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        async with sessions[0].request(
            request.method,
            upstream + request.rel_url.raw_path_qs,
            headers=headers,
            data=body or None,
            allow_redirects=False,
        ) as answer:
            response = web.StreamResponse(status=answer.status, reason=answer.reason)
            for name, value in answer.headers.items():
                if name.lower() not in HOP_BY_HOP:
                    response.headers.add(name, value)
            if answer.content_length is not None:
                response.content_length = answer.content_length
            await response.prepare(request)
            async for chunk in answer.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def close(_: web.Application) -> None:
        for session in sessions:
            await session.close()

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    app.on_cleanup.append(close)
    return app


async def serve(port: int, upstream: str) -> None:
    """Serve on 127.0.0.1 until SIGTERM or SIGINT."""
    await serve_until_stopped(build_app(upstream.rstrip("/")), port, "overhead-floor")


def main() -> None:
    """Parse the arguments and serve."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        run_loop(serve(args.port, args.upstream), choose_loop())
    sys.exit(0)


if __name__ == "__main__":
    main()
