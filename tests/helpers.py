"""Helpers the tests share: a free loopback port, a polling wait, strict JSON.

Import them as ``from tests.helpers import free_port, strict_json, until`` (the editable install
puts the repository root on ``sys.path``, so ``tests`` imports as a package).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def free_port() -> int:
    """A port free on 127.0.0.1 right now: bound to port 0, the OS's pick, then released.

    Something else can take it before the test binds it. Where the server under test
    can bind port 0 itself and say which port it got, let it instead.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def until(
    condition: Callable[[], T | Awaitable[T]],
    *,
    timeout_s: float = 10.0,
    interval_s: float = 0.01,
    what: str | Callable[[], str] | None = None,
) -> T:
    """Poll ``condition()`` every ``interval_s`` until it is truthy; that value.

    ``condition`` returns a value, or an awaitable of one (an ``async def``, or a
    lambda calling one). After ``timeout_s`` (a check that hangs is cut off too) it
    fails with an :class:`AssertionError` naming ``what`` it waited for: a string, a
    function called then (to report the state at the deadline), or by default the
    condition's name or a lambda's source line.
    """

    async def poll() -> T:
        while True:
            value = condition()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value
            await asyncio.sleep(interval_s)

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    try:
        return await asyncio.wait_for(poll(), timeout_s)
    except asyncio.TimeoutError:
        if loop.time() < deadline:
            raise  # the check's own timeout, before the deadline
        said = what() if callable(what) else what or _describe(condition)
        raise AssertionError(f"not within {timeout_s:g} s: {said}") from None


def _describe(condition: Callable[..., object]) -> str:
    """The condition's source line for a lambda, else its name."""
    name = getattr(condition, "__qualname__", repr(condition))
    if "<lambda>" not in name:
        return name
    try:
        lines, _ = inspect.getsourcelines(condition)
    except (OSError, TypeError):
        return name
    return " ".join(line.strip() for line in lines)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON: a strict parser (Loki, Vector) drops the line")


def strict_json(line: str | bytes) -> object:
    """One line parsed as strict JSON: ``NaN``/``Infinity`` refused, as log shippers do."""
    return json.loads(line, parse_constant=_no_constant)


def json_log_events(path: Path) -> list[dict[str, object]]:
    """The events of a kvguard JSON log file, every JSON line parsed strictly.

    Lines that are not JSON objects (a supervised engine's own output, sharing the
    stream) are skipped; a JSON line a strict parser refuses fails the test.
    """
    events = []
    for line in path.read_bytes().splitlines():
        if line.startswith(b"{"):
            event = strict_json(line)
            assert isinstance(event, dict), line
            events.append(event)
    return events
