"""The answers kvguard gives in the engine's stead: OpenAI-shaped errors, whole or streamed.

The screen, the admission and the forwarding all answer for the engine at times; the
shape of those answers (what SDK clients parse) is defined once, here, so it cannot
drift between them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from aiohttp import web

from kvguard.actuators.accounting import InflightRequest

CANCEL_MESSAGE = (
    "kvguard cancelled this request to free KV cache for others (the cache is full); retry later"
)
DRAIN_MESSAGE = (
    "kvguard cancelled this request: the engine is restarting to change its KV cache"
    " and the request did not finish within the drain timeout; retry later"
)


def _error(
    status: int,
    message: str,
    kind: str,
    *,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    """An OpenAI-style error answer."""
    body = {"error": {"message": message, "type": kind, "code": code or kind}}
    return web.json_response(body, status=status, headers=headers)


async def _stream_error(
    response: web.StreamResponse, message: str, code: str = "upstream_error"
) -> None:
    """End a stream already begun with an error event (its status is sent: it stays)."""
    payload = {"error": {"message": message, "type": "server_overloaded", "code": code}}
    try:
        await response.write(f"data: {json.dumps(payload)}\n\n".encode())
        await response.write_eof()
    except ConnectionResetError:
        return


def _cancel_message(tracked: InflightRequest) -> str:
    return DRAIN_MESSAGE if tracked.cancel_reason == "drain" else CANCEL_MESSAGE


def _cancel_code(tracked: InflightRequest) -> str:
    return "kv_cache_reconfigure" if tracked.cancel_reason == "drain" else "kv_cache_pressure"
