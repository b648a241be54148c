"""The simulated engine's health, info and admin endpoints, per flavor.

vLLM's dev-mode endpoints (pause, resume, abort, reset_prefix_cache), SGLang's
(flush_cache, pause_generation, abort_request) and llama.cpp's (slots, props),
with the semantics docs/engines.md records for the real engines.
"""

from __future__ import annotations

from aiohttp import web

from kvguard import __version__
from kvguard.sim.engine import PauseMode
from kvguard.sim.http_common import (
    ENGINE_KEY,
    SETTINGS_KEY,
    error,
    read_json,
    slot_context,
)


async def health(request: web.Request) -> web.Response:
    """GET /health: 200 while the engine lives, 503 after a crash."""
    engine, settings = request.app[ENGINE_KEY], request.app[SETTINGS_KEY]
    if not engine.alive:
        return error(503, f"engine is dead: {engine.dead_reason}", "ServiceUnavailableError")
    if settings.flavor == "llamacpp":
        return web.json_response({"status": "ok"})
    return web.Response(status=200)


async def version(_: web.Request) -> web.Response:
    """GET /version."""
    return web.json_response({"version": f"kvguard-sim-{__version__}"})


async def load(request: web.Request) -> web.Response:
    """GET /load: requests in flight."""
    engine = request.app[ENGINE_KEY]
    return web.json_response({"server_load": len(engine.request_ids())})


async def server_info(request: web.Request) -> web.Response:
    """GET /server_info: the engine's configuration."""
    engine, settings = request.app[ENGINE_KEY], request.app[SETTINGS_KEY]
    config = engine.config
    return web.json_response(
        {
            "flavor": settings.flavor,
            "model": settings.model_name,
            "block_size": config.block_size,
            "num_gpu_blocks": config.num_gpu_blocks,
            "max_total_num_tokens": config.capacity_tokens,
            "max_model_len": config.max_model_len,
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "scheduling_policy": config.scheduling_policy,
            "kv_cache_dtype": settings.cache.cache_dtype,
        }
    )


# ---------------------------------------------------------------- vLLM dev mode
async def vllm_pause(request: web.Request) -> web.Response:
    """POST /pause?mode=abort|wait|keep."""
    mode = request.query.get("mode", "abort")
    if mode not in ("abort", "wait", "keep"):
        return error(400, f"mode must be abort, wait or keep, got {mode!r}")
    pause_mode: PauseMode = mode  # type: ignore[assignment]
    request.app[ENGINE_KEY].pause(pause_mode)
    return web.json_response({"status": "paused", "mode": mode})


async def vllm_resume(request: web.Request) -> web.Response:
    """POST /resume (and SGLang's /continue_generation)."""
    request.app[ENGINE_KEY].resume()
    return web.json_response({"status": "resumed"})


async def vllm_is_paused(request: web.Request) -> web.Response:
    """GET /is_paused."""
    return web.json_response({"is_paused": request.app[ENGINE_KEY].pause_mode is not None})


async def vllm_abort_requests(request: web.Request) -> web.Response:
    """POST /abort_requests {"request_ids": [...]}."""
    body = await read_json(request)
    ids = body.get("request_ids")
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        return error(400, "request_ids must be a list of strings")
    engine = request.app[ENGINE_KEY]
    aborted = [rid for rid in ids if engine.abort(rid)]
    return web.json_response({"aborted": aborted})


async def vllm_reset_prefix_cache(request: web.Request) -> web.Response:
    """POST /reset_prefix_cache[?reset_running_requests=true]: fails while blocks are held."""
    force = request.query.get("reset_running_requests", "false").lower() == "true"
    return web.json_response({"success": request.app[ENGINE_KEY].reset_cache(reset_running=force)})


# ---------------------------------------------------------------- SGLang
async def sglang_flush_cache(request: web.Request) -> web.Response:
    """POST /flush_cache: refused while requests run or wait."""
    engine = request.app[ENGINE_KEY]
    if engine.scheduler.has_work:
        return web.Response(
            status=400, text="Cache not flushed because there are pending requests."
        )
    return web.Response(text="Cache flushed.")


async def sglang_loads(request: web.Request) -> web.Response:
    """GET /v1/loads."""
    sched = request.app[ENGINE_KEY].scheduler
    return web.json_response(
        {
            "num_running_reqs": len(sched.running),
            "num_waiting_reqs": len(sched.waiting),
            "token_usage": sched.usage,
        }
    )


async def sglang_pause(request: web.Request) -> web.Response:
    """POST /pause_generation {"mode": "abort|retract|in_place"}."""
    body = await read_json(request)
    mode = body.get("mode", "abort")
    engine = request.app[ENGINE_KEY]
    if mode == "abort":
        engine.pause("abort")
    elif mode == "retract":  # running requests go back to the queue, their cache freed
        engine.reset_cache(reset_running=True)
        engine.pause("keep")
    elif mode == "in_place":
        engine.pause("keep")
    else:
        return error(400, f"mode must be abort, retract or in_place, got {mode!r}")
    return web.json_response({"status": "paused", "mode": mode})


async def sglang_abort(request: web.Request) -> web.Response:
    """POST /abort_request {"rid": ...} or {"abort_all": true}."""
    body = await read_json(request)
    engine = request.app[ENGINE_KEY]
    ids = engine.request_ids() if body.get("abort_all") else [body.get("rid")]
    aborted = [rid for rid in ids if isinstance(rid, str) and engine.abort(rid)]
    return web.json_response({"aborted": aborted})


# ---------------------------------------------------------------- llama.cpp
async def llamacpp_slots(request: web.Request) -> web.Response:
    """GET /slots: one entry per slot, busy ones first."""
    engine = request.app[ENGINE_KEY]
    n_ctx = slot_context(engine)
    running = engine.scheduler.running
    slots = []
    for slot_id in range(engine.config.max_num_seqs):
        seq = running[slot_id] if slot_id < len(running) else None
        slots.append(
            {
                "id": slot_id,
                "n_ctx": n_ctx,
                "is_processing": seq is not None,
                "id_task": seq.request_id if seq else -1,
                "n_prompt_tokens": seq.prompt_tokens if seq else 0,
                "n_prompt_tokens_cache": min(seq.computed, seq.prompt_tokens) if seq else 0,
                "next_token": [
                    {
                        "has_next_token": seq is not None,
                        "n_remain": seq.max_tokens - seq.generated if seq else -1,
                        "n_decoded": seq.generated if seq else 0,
                    }
                ],
            }
        )
    return web.json_response(slots)


async def llamacpp_slot_action(request: web.Request) -> web.Response:
    """POST /slots/{id}?action=erase: clear an idle slot's cache."""
    engine = request.app[ENGINE_KEY]
    try:
        slot_id = int(request.match_info["slot_id"])
    except ValueError:
        return error(400, "slot id must be an integer")
    if request.query.get("action") != "erase":
        return error(400, "only action=erase is simulated")
    if not 0 <= slot_id < engine.config.max_num_seqs:
        return error(400, f"invalid slot id {slot_id}")
    if slot_id < len(engine.scheduler.running):
        return error(400, f"slot {slot_id} is processing a request")
    return web.json_response({"id_slot": slot_id, "n_erased": 0})


async def llamacpp_props(request: web.Request) -> web.Response:
    """GET /props."""
    engine, settings = request.app[ENGINE_KEY], request.app[SETTINGS_KEY]
    return web.json_response(
        {
            "total_slots": engine.config.max_num_seqs,
            "model_path": settings.model_name,
            "default_generation_settings": {"n_ctx": slot_context(engine)},
        }
    )
