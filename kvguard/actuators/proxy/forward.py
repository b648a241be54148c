"""Forwarding to the engine and relaying its answer: headers, bodies, streams, cancellation.

Every request that passes the screen and the admission is sent to the one configured
upstream (same method, path, query and body; hop-by-hop headers dropped and the
client's ``X-Forwarded-*``/``Forwarded`` replaced by the connection's own address and
scheme) and the answer comes back unchanged, streams chunk by chunk, while the
tokens generated are counted for the accounting. Kept apart from the admission
because it is the I/O half of the proxy: what can break here is the engine's
connection, never a decision.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from kvguard.actuators.accounting import Inflight, InflightRequest
from kvguard.actuators.mitigations import Mitigations
from kvguard.actuators.proxy.answers import _cancel_code, _cancel_message, _error, _stream_error
from kvguard.actuators.proxy.counting import PromptCounter, _count_events, _count_usage
from kvguard.actuators.proxy.settings import ProxyCounters
from kvguard.core.lengths import ObservedLengths

# Set by the proxy itself from the connection: a client's own would let it pose as
# another address to an engine that trusts X-Forwarded-* from 127.0.0.1 (uvicorn).
FORWARDING_HEADERS = frozenset(
    {"forwarded", "x-forwarded-for", "x-forwarded-proto", "x-forwarded-host", "x-real-ip"}
)
# RFC 9110 section 7.6.1: these describe one connection and must not be forwarded.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
USAGE_SCAN_BYTES = 1024 * 1024  # whole answers are read for `usage` up to this size
# Headers aiohttp's client adds on its own when the request lacks them: the engine
# must see the client's request, not one with a Content-Type, Accept, Accept-Encoding
# or User-Agent the client never sent (a body without Content-Type would arrive as
# application/octet-stream). The client's own pass through.
NOT_ADDED = ("Accept", "Accept-Encoding", "Content-Type", "User-Agent")


class Forwarder:
    """Sends requests to ``upstream`` and relays the answers, accounting tracked ones.

    A tracked request is in ``inflight`` from the moment it is sent until its answer
    ends; then ``counter`` remembers the prompt count its ``usage`` gave and
    ``finished`` is called (requests waiting for room re-check).
    """

    def __init__(
        self,
        upstream: str,
        session: Callable[[], aiohttp.ClientSession],
        *,
        mitigations: Mitigations,
        inflight: Inflight,
        counters: ProxyCounters,
        counter: PromptCounter,
        finished: Callable[[], None],
        lengths: ObservedLengths,
    ) -> None:
        self._upstream = upstream
        self._lengths = lengths
        self._session = session
        self._mitigations = mitigations
        self._inflight = inflight
        self._counters = counters
        self._counter = counter
        self._finished = finished

    async def forward(
        self,
        request: web.Request,
        headers: CIMultiDict[str],
        body: bytes,
        tracked: InflightRequest | None,
    ) -> web.StreamResponse:
        """Send ``request`` (with ``headers`` and ``body``) to the engine; relay its answer."""
        url = self._upstream + request.rel_url.raw_path_qs  # only ever the upstream host
        upstream: aiohttp.ClientResponse | None = None
        task = asyncio.current_task()
        if tracked is not None:
            self._inflight.add(tracked)
            # Until the engine's headers arrive (for a whole answer: when it is done),
            # cancelling means cancelling this handler, which drops the connection.
            tracked.cancel = _canceller(task)
        try:
            try:
                upstream = await self._session().request(
                    request.method,
                    url,
                    headers=headers,
                    data=body or None,
                    allow_redirects=False,
                    skip_auto_headers=NOT_ADDED,
                )
            except asyncio.CancelledError:
                if tracked is None or not tracked.cancelled or task is None:
                    raise  # our client left (or kvguard stops): not ours to answer
                uncancel = getattr(task, "uncancel", None)  # 3.11+: this cancel is handled
                if uncancel is not None:
                    uncancel()
                return self._cancelled(tracked)
            except (asyncio.TimeoutError, TimeoutError):
                self._counters.upstream_errors["504"] += 1
                return _error(
                    504,
                    "the engine did not answer in time",
                    "upstream_timeout",
                    headers=self._while_restarting(),
                )
            except aiohttp.ClientError as exc:
                self._counters.upstream_errors["502"] += 1
                return _error(
                    502,
                    f"the engine is unreachable: {type(exc).__name__}",
                    "upstream_unreachable",
                    headers=self._while_restarting(),
                )
            if tracked is not None:
                tracked.cancel = upstream.close
            return await self._relay(request, upstream, tracked)
        finally:
            if upstream is not None:
                # A body not read to its end means our client left or we cancelled:
                # closing the connection is what makes the engine abort the request.
                if upstream.content.at_eof():
                    upstream.release()
                else:
                    upstream.close()
            if tracked is not None:
                self._counter.remember_usage(tracked)
                self._inflight.done(tracked)
                self._learn(tracked)
                # A waiting request may fit now: wake them all.
                self._finished()

    async def _relay(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        tracked: InflightRequest | None,
    ) -> web.StreamResponse:
        streaming = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
        first = b""
        if not streaming:
            # A whole answer arrives at once: wait for it before sending the status, so a
            # cancellation can still answer 503 instead of a truncated 200.
            try:
                first = await upstream.content.readany()
            except (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError):
                if tracked is not None and tracked.cancelled:
                    return self._cancelled(tracked)
                self._counters.upstream_errors["502"] += 1
                return _error(
                    502,
                    "the engine closed the connection",
                    "upstream_error",
                    headers=self._while_restarting(),
                )
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        response.headers.extend(_forward_headers(upstream.headers))
        if "Content-Length" in upstream.headers:
            response.content_length = int(upstream.headers["Content-Length"])
        kept = bytearray(first[:USAGE_SCAN_BYTES])
        tail = b""
        try:
            await response.prepare(request)
            if first:
                await response.write(first)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
                if tracked is not None and streaming:
                    tail = _count_events(tracked, tail + chunk)
                elif len(kept) < USAGE_SCAN_BYTES:
                    kept += chunk[: USAGE_SCAN_BYTES - len(kept)]
        except ConnectionResetError:
            # Our client went away (aiohttp's ClientConnectionResetError is one too, so
            # this comes first): nobody to tell; closing upstream aborts the request.
            return response
        except (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError) as exc:
            with contextlib.suppress(ConnectionResetError):
                if streaming and tracked is not None and tracked.cancelled:
                    message, code = _cancel_message(tracked), _cancel_code(tracked)
                    await _stream_error(response, message, code=code)
                elif streaming:
                    await _stream_error(response, f"the engine stream broke: {type(exc).__name__}")
            if not streaming:
                # The status and Content-Length are sent and the body cannot be finished:
                # cut the connection, or the client waits for bytes that never come. A
                # cut kvguard made itself (cancel_largest) is counted as that, not as 502.
                if tracked is None or not tracked.cancelled:
                    self._counters.upstream_errors["502"] += 1
                if request.transport is not None:
                    request.transport.abort()
            return response
        if tracked is not None and not streaming:
            _count_usage(tracked, bytes(kept))
        if tracked is not None:
            tracked.completed = upstream.status == 200 and not tracked.cancelled
        with contextlib.suppress(ConnectionResetError):
            await response.write_eof()
        return response

    def _learn(self, tracked: InflightRequest) -> None:
        """Remember how long a whole answer was, for the reservations of its kind.

        Only answers that ended with a 200 and a count (the answer's ``usage``, or the
        stream's tokens), and whose length the client chose: one kvguard's window cap
        clamped says nothing about how long one is. A cut or failed answer that wrote
        something says how long it was at least, which is remembered as such; so is
        one that stopped at its client's ``max_tokens`` (it would have run on).
        """
        if tracked.kind is not None and tracked.prompt_exact and tracked.prompt_estimate:
            self._lengths.observe_prompt(
                tracked.kind[0], tracked.prompt_tokens, tracked.prompt_estimate
            )
        if (
            tracked.completed
            and not tracked.clamped
            and tracked.kind is not None
            and tracked.generated > 0
        ):
            per_sequence = tracked.output_per_sequence
            limit = tracked.answer_limit
            self._lengths.observe(
                tracked.kind,
                per_sequence,
                tracked.prompt_tokens // max(tracked.sequences, 1) + per_sequence,
                at_limit=limit is not None and per_sequence >= limit,
            )
        elif not tracked.completed and not tracked.clamped and tracked.kind is not None:
            self._lengths.observe_cut(tracked.kind, tracked.output_per_sequence)

    def _while_restarting(self) -> dict[str, str] | None:
        """``Retry-After`` while kvguard knows the engine is restarting, else nothing.

        Then the error is known to end soon: without it, SDK clients retry at once
        (or give up) and spend their retries inside the restart.
        """
        seconds = self._mitigations.restart_retry_after_s
        return None if seconds is None else {"Retry-After": str(seconds)}

    def _cancelled(self, tracked: InflightRequest) -> web.StreamResponse:
        """The 503 for a request kvguard cancelled before its answer began."""
        return _error(
            503,
            _cancel_message(tracked),
            "server_overloaded",
            code=_cancel_code(tracked),
            # Without it, SDK clients resubmit the same large request at once.
            headers={"Retry-After": str(self._retry_after(tracked))},
        )

    def _retry_after(self, tracked: InflightRequest) -> int:
        """Seconds a cancelled client should wait: until the restart, or the shed estimate."""
        if tracked.cancel_reason == "drain":
            return self._mitigations.drain_retry_after_s
        return self._mitigations.retry_after_s


def _canceller(task: asyncio.Task[Any] | None) -> Callable[[], None] | None:
    if task is None:
        return None

    def cancel() -> None:
        task.cancel()

    return cancel


def _forward_headers(incoming: CIMultiDictProxy[str] | CIMultiDict[str]) -> CIMultiDict[str]:
    """``incoming`` without hop-by-hop headers.

    RFC 9110's, ``Proxy-*`` and those every ``Connection`` header names, both ways:
    requests to the engine and answers to the client.
    """
    named = {
        h.strip().lower()
        for value in incoming.getall("Connection", [])
        for h in value.split(",")
        if h.strip()
    }
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in incoming.items():
        lower = name.lower()
        if lower not in HOP_BY_HOP and lower not in named and not lower.startswith("proxy-"):
            out.add(name, value)
    return out


def _upstream_headers(request: web.Request) -> CIMultiDict[str]:
    """The headers sent to the engine: the client's, less hop-by-hop and forwarding ones.

    ``X-Forwarded-For`` and ``X-Forwarded-Proto`` are set from the connection itself.
    """
    headers = _forward_headers(request.headers)
    for name in FORWARDING_HEADERS:
        headers.popall(name, None)
    if request.remote:
        headers["X-Forwarded-For"] = request.remote
    headers["X-Forwarded-Proto"] = request.scheme
    return headers
