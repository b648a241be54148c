"""Reading request bodies within limits: their size, how fast they arrive, their memory.

The proxy must hold a generation request's whole body before it can decide on it,
and parsing multiplies what the body weighs: a body of small JSON values takes 20
to 30 times its size once parsed. :class:`BodyGate` bounds what the bodies being
read and parsed hold at once (``[proxy] max_body_memory``), counted from the bytes
that have arrived; :func:`read_body` reads one body under it, refusing one over
``max_body_bytes`` (413) or one that does not keep up ``client_body_min_rate``
after ``client_body_timeout_s`` (408).
Kept apart from the application because it is the part that waits on the client.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

from aiohttp import web

from kvguard.actuators.proxy.settings import ProxySettings

# What a body is estimated to hold in memory, from its bytes and its JSON values: the
# bytes read, the text they decode to and the parsed strings (3 bytes a byte), plus
# ~100 bytes a value parsed (a dict, a list slot, a key, a number: 50 to 100 bytes in
# CPython). Values are counted as ``{``, ``[`` and ``,``, as screen.count_values does.
MEMORY_PER_BYTE = 3
MEMORY_PER_VALUE = 100
# How long a body waits for room under max_body_memory before its request gets 503,
# and the Retry-After it is given: bodies are read in milliseconds to seconds.
ROOM_WAIT_S = 2.0
ROOM_RETRY_AFTER_S = 1


class BodyRefused(Exception):  # noqa: N818 - a refusal, answered, not an error of kvguard's
    """A body not read to its end: the status, the error code and message to answer."""

    def __init__(
        self, status: int, code: str, message: str, *, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers


class BodyGate:
    """The memory the request bodies being read and parsed may hold at once.

    Each request takes a :class:`BodyShare` before its body is read and gives it back
    once its body is parsed and admission waits for room, or once it is refused. A
    share grows with the bytes that have arrived, chunk by chunk, whether the body
    has a ``Content-Length`` or not: a connection that declares a length and sends
    nothing holds nothing. A growth that does not fit waits up to ``wait_s`` for
    others to shrink, then the request is answered 503 with ``Retry-After``. The
    oldest share holding anything may always grow: without it, bodies each holding
    part of the budget while waiting for more could wait on one another until all
    are refused; with it, one of them always finishes, and the bodies being read hold
    at most the budget plus what one body may hold (``body_memory`` of
    ``max_body_bytes``). A share alone may pass ``budget`` the same way: a body the
    other limits let through is never refused for its size alone.
    """

    def __init__(self, budget: int, *, wait_s: float = ROOM_WAIT_S) -> None:
        self.budget = budget
        self.wait_s = wait_s
        self.held = 0  # bytes all shares hold now
        self.waiting = 0  # shares waiting for room now
        # The shares holding anything, oldest first (a dict keeps its insertion order).
        self._holders: dict[BodyShare, None] = {}
        # Set (and replaced) whenever a share shrinks: waiters check again.
        self._freed = asyncio.Event()

    def share(self) -> BodyShare:
        """A new, empty share (an async context manager that gives it back)."""
        return BodyShare(self)

    async def _grow(self, share: BodyShare, amount: int) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        self.waiting += 1
        try:
            while not self._fits(share, amount):
                left = deadline - loop.time()
                if left <= 0:
                    raise BodyRefused(
                        503,
                        "body_memory_full",
                        "kvguard is reading and admitting other request bodies up to its"
                        f" memory limit ([proxy] max_body_memory); retry after"
                        f" {ROOM_RETRY_AFTER_S} s",
                        headers={"Retry-After": str(ROOM_RETRY_AFTER_S)},
                    )
                try:
                    await asyncio.wait_for(self._freed.wait(), left)
                except asyncio.TimeoutError:
                    continue  # the deadline decides, above
        finally:
            self.waiting -= 1
        self.held += amount
        share.amount += amount
        self._holders.setdefault(share)

    def _fits(self, share: BodyShare, amount: int) -> bool:
        """Whether ``share`` may grow by ``amount`` now: room, or it is the oldest holder."""
        if self.held + amount <= self.budget:
            return True
        oldest = next(iter(self._holders), None)
        return oldest is None or oldest is share  # nothing held, or it goes first

    def _shrink(self, share: BodyShare, amount: int) -> None:
        amount = min(amount, share.amount)
        if amount > 0:
            self.held -= amount
            share.amount -= amount
            if share.amount == 0:
                self._holders.pop(share, None)
            self._freed.set()
            self._freed = asyncio.Event()


class BodyShare:
    """One request's part of a :class:`BodyGate`; given back on exit or :meth:`release`."""

    def __init__(self, gate: BodyGate) -> None:
        self._gate = gate
        self.amount = 0

    async def grow(self, amount: int) -> None:
        """Hold ``amount`` more bytes; raises :class:`BodyRefused` (503) when no room comes."""
        if amount > 0:
            await self._gate._grow(self, amount)

    def shrink_to(self, amount: int) -> None:
        """Give back what is held over ``amount`` (a body counted, smaller than reserved)."""
        self._gate._shrink(self, self.amount - amount)

    def release(self) -> None:
        """Give the whole share back (the body is admitted or refused; idempotent)."""
        self._gate._shrink(self, self.amount)

    async def __aenter__(self) -> BodyShare:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()


async def read_body(request: web.Request, settings: ProxySettings, share: BodyShare) -> bytes:
    """The request's whole body, read under ``share``; raises :class:`BodyRefused`.

    413: over ``max_body_bytes`` (declared or read). 408: the body fell
    ``client_body_timeout_s`` behind ``client_body_min_rate`` (a client that sends
    nothing, trickles or stalls; time spent waiting for memory does not count).
    503: no room under ``max_body_memory`` (:class:`BodyGate`) for the bytes that
    have arrived: ``share`` grows chunk by chunk, a declared length reserves
    nothing. Read by hand, not with ``request.read()``, which would also keep a copy
    on the request.
    """
    limit = settings.max_body_bytes
    declared = request.content_length
    if declared is not None and declared > limit:
        raise _too_large(limit)
    if not request.body_exists:
        return b""
    loop = asyncio.get_running_loop()
    started = loop.time()
    waited = 0.0  # waiting for memory is kvguard's time, not the client's
    chunks: list[bytes] = []
    size = values = 0
    content = request.content
    while True:
        # What has arrived already is taken without a timer (a small body comes whole
        # with its head): only a wait for more runs against the deadline.
        chunk = content.read_nowait()
        if not chunk and not content.at_eof():
            due = started + waited + settings.client_body_timeout_s
            due += size / settings.client_body_min_rate
            try:
                chunk = await asyncio.wait_for(content.readany(), max(due - loop.time(), 0))
            except asyncio.TimeoutError:
                raise BodyRefused(
                    408,
                    "body_timeout",
                    f"the request body did not arrive in time: {size} bytes after"
                    f" {loop.time() - started - waited:.0f} s (kvguard waits"
                    f" {settings.client_body_timeout_s:g} s, then wants"
                    f" {settings.client_body_min_rate} bytes a second: [proxy]"
                    " client_body_timeout_s, client_body_min_rate)",
                ) from None
        if not chunk:
            break
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        values += chunk.count(b"{") + chunk.count(b"[") + chunk.count(b",")
        # The share grows with what has arrived, never with what a header declares: a
        # client that declares 4 MiB and sends nothing holds nothing.
        began = loop.time()
        await share.grow(body_memory(size, values, settings) - share.amount)
        waited += loop.time() - began
        chunks.append(chunk)
    return b"".join(chunks)


def body_memory(size: int, values: int, settings: ProxySettings) -> int:
    """What a body of ``size`` bytes and ``values`` JSON values holds once parsed, about.

    Values past ``max_body_values`` are never parsed (the body is refused first).
    """
    return MEMORY_PER_BYTE * size + MEMORY_PER_VALUE * min(values, settings.max_body_values)


def _too_large(limit: int) -> BodyRefused:
    return BodyRefused(
        413, "request_too_large", f"request body over {limit} bytes ([proxy] max_body_bytes)"
    )
