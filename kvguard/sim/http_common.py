"""What the simulated engine's HTTP handlers share: app keys, settings, errors, limits."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvguard.sim.engine import SimEngine
from kvguard.sim.metrics import CacheInfo, Flavor

DEFAULT_CACHE = CacheInfo("auto", 0.9, 131_072)


@dataclass(frozen=True)
class SimServerSettings:
    """What the server says about itself; the engine holds the behaviour."""

    flavor: Flavor = "vllm"
    model_name: str = "kvguard-sim"
    dev_endpoints: bool = True
    cache: CacheInfo = DEFAULT_CACHE


ENGINE_KEY = web.AppKey("engine", SimEngine)
SETTINGS_KEY = web.AppKey("settings", SimServerSettings)


def error(status: int, message: str, kind: str = "BadRequestError") -> web.Response:
    """An OpenAI-style error body, as vLLM returns it."""
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return web.json_response(body, status=status)


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 that says what is wrong."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise web.HTTPBadRequest(
            text=json.dumps(
                {"object": "error", "message": f"invalid JSON body: {exc}", "code": 400}
            ),
            content_type="application/json",
        ) from exc
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(
            text=json.dumps(
                {"object": "error", "message": "body must be a JSON object", "code": 400}
            ),
            content_type="application/json",
        )
    return body


def context_limit(request: web.Request) -> int:
    """Tokens one request may hold: max_model_len, or a llama.cpp slot's n_ctx."""
    engine, settings = request.app[ENGINE_KEY], request.app[SETTINGS_KEY]
    if settings.flavor == "llamacpp":
        return slot_context(engine)
    return engine.config.max_model_len


def slot_context(engine: SimEngine) -> int:
    """llama.cpp splits its context evenly across its slots."""
    return engine.config.capacity_tokens // engine.config.max_num_seqs
