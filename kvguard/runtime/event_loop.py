"""Which event loop ``kvguard run`` runs on: uvloop when installed, else asyncio's own.

The admission proxy is kvguard's hot path; uvloop (libuv, in C) runs the same aiohttp
code on a faster loop. Measured, it buys little (a few percent of the proxy's CPU per
request: docs/benchmarks.md, "Proxy cost" and "Where the time goes"), so it is
optional (``pip install 'kvguard[fast]'``): without it, or with
``KVGUARD_EVENT_LOOP=asyncio``, the standard loop runs, which is what every test of
kvguard's logic runs on.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

from kvguard.errors import InvalidInputError

T = TypeVar("T")

# The environment variable that picks the loop, and what it may say.
EVENT_LOOP_ENV = "KVGUARD_EVENT_LOOP"
CHOICES = ("auto", "uvloop", "asyncio")


def choose_loop(env: Mapping[str, str] | None = None) -> str:
    """The loop to run, "uvloop" or "asyncio", as ``env`` asks.

    ``auto`` (unset): uvloop if it imports, else asyncio. ``uvloop``: uvloop, or an
    error saying how to install it. ``asyncio``: the standard loop.
    """
    env = os.environ if env is None else env
    wanted = env.get(EVENT_LOOP_ENV, "auto").strip().lower() or "auto"
    if wanted not in CHOICES:
        raise InvalidInputError(EVENT_LOOP_ENV, wanted, f"must be one of {', '.join(CHOICES)}")
    if wanted == "asyncio":
        return "asyncio"
    if importlib.util.find_spec("uvloop") is None:
        if wanted == "uvloop":
            raise InvalidInputError(
                EVENT_LOOP_ENV, wanted, "uvloop is not installed: pip install 'kvguard[fast]'"
            )
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T], loop: str) -> T:
    """``asyncio.run(main)``, on uvloop when ``loop`` says so (its own runner)."""
    if loop == "uvloop":
        import uvloop  # noqa: PLC0415 - optional

        result: T = uvloop.run(main)
        return result
    return asyncio.run(main)
