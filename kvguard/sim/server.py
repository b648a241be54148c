"""The simulated engine's HTTP application: routes for the chosen flavor.

Matches the real engine of that flavor where it has the endpoint (paths, methods,
status codes, body shapes), so kvguard's adapters and actuators can be tested
against it. Only what an engine of that flavor offers is routed.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvguard.sim import admin, openai_api
from kvguard.sim.engine import SimEngine
from kvguard.sim.http_common import ENGINE_KEY, SETTINGS_KEY, SimServerSettings
from kvguard.sim.metrics import metrics_registry


def build_app(engine: SimEngine, settings: SimServerSettings) -> web.Application:
    """The aiohttp application serving ``engine`` as ``settings.flavor``."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[ENGINE_KEY] = engine
    app[SETTINGS_KEY] = settings
    registry = metrics_registry(engine, settings.flavor, settings.model_name, settings.cache)

    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_post("/v1/completions", openai_api.completions)
    app.router.add_post("/v1/chat/completions", openai_api.chat_completions)
    app.router.add_get("/v1/models", openai_api.models)
    app.router.add_post("/tokenize", openai_api.tokenize_handler)
    app.router.add_get("/health", admin.health)
    app.router.add_get("/metrics", metrics)
    if settings.flavor == "vllm":
        app.router.add_get("/ping", admin.health)
        app.router.add_get("/version", admin.version)
        app.router.add_get("/load", admin.load)
        if settings.dev_endpoints:  # vLLM serves these only with VLLM_SERVER_DEV_MODE=1
            app.router.add_post("/pause", admin.vllm_pause)
            app.router.add_post("/resume", admin.vllm_resume)
            app.router.add_get("/is_paused", admin.vllm_is_paused)
            app.router.add_post("/abort_requests", admin.vllm_abort_requests)
            app.router.add_post("/reset_prefix_cache", admin.vllm_reset_prefix_cache)
            app.router.add_get("/server_info", admin.server_info)
    elif settings.flavor == "sglang":
        app.router.add_post("/flush_cache", admin.sglang_flush_cache)
        app.router.add_get("/server_info", admin.server_info)
        app.router.add_get("/get_server_info", admin.server_info)
        app.router.add_get("/v1/loads", admin.sglang_loads)
        app.router.add_post("/pause_generation", admin.sglang_pause)
        app.router.add_post("/continue_generation", admin.vllm_resume)
        app.router.add_post("/abort_request", admin.sglang_abort)
    else:
        app.router.add_get("/slots", admin.llamacpp_slots)
        app.router.add_post("/slots/{slot_id}", admin.llamacpp_slot_action)
        app.router.add_get("/props", admin.llamacpp_props)
    return app
