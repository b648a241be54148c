"""The simulated engine's OpenAI-compatible API: completions, chat, models, tokenize.

Prompt tokens are counted by :mod:`kvguard.sim.tokenizer`; generation is
``max_tokens`` tokens (``finish_reason`` "length") unless the sim-only body field
``kvguard_sim_output_tokens`` gives a shorter true length (``finish_reason`` "stop")
or the request is aborted. ``priority`` is vLLM's request field: non-zero only under
the ``priority`` scheduling policy.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from aiohttp import web

from kvguard.sim.engine import EngineUnavailableError, RequestHandle
from kvguard.sim.http_common import (
    ENGINE_KEY,
    SETTINGS_KEY,
    context_limit,
    error,
    read_json,
)
from kvguard.sim.tokenizer import count_chat_tokens, count_tokens, tokenize

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
# The load generator's way to give a request its true output length; real engines
# ignore unknown body fields, so the same traffic runs against them unchanged.
SIM_OUTPUT_TOKENS_FIELD = "kvguard_sim_output_tokens"


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    body = await read_json(request)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        prompt_tokens = count_tokens(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        prompt_tokens = len(prompt)  # token ids
    else:
        return error(400, "prompt must be a string, a list of one string, or a list of token ids")
    return await generate(request, body, prompt_tokens, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    body = await read_json(request)
    messages = body.get("messages")
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) for m in messages)
    ):
        return error(400, "messages must be a non-empty list of message objects")
    return await generate(request, body, count_chat_tokens(messages), chat=True)


async def generate(
    request: web.Request, body: dict[str, Any], prompt_tokens: int, *, chat: bool
) -> web.StreamResponse:
    """Validate sizes, submit to the engine, and answer streamed or whole."""
    engine, settings = request.app[ENGINE_KEY], request.app[SETTINGS_KEY]
    limit = context_limit(request)
    requested = body.get("max_completion_tokens") if chat else None
    requested = requested if requested is not None else body.get("max_tokens")
    if requested is None:
        requested = limit - prompt_tokens if chat else DEFAULT_COMPLETION_MAX_TOKENS
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        return error(400, f"max_tokens must be an integer >= 1, got {requested!r}")
    if body.get("n", 1) != 1:
        return error(400, "the simulated engine supports n=1 only")
    output_tokens = body.get(SIM_OUTPUT_TOKENS_FIELD)
    if output_tokens is not None and (
        isinstance(output_tokens, bool) or not isinstance(output_tokens, int) or output_tokens < 1
    ):
        return error(
            400, f"{SIM_OUTPUT_TOKENS_FIELD} must be an integer >= 1, got {output_tokens!r}"
        )
    priority = body.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        return error(400, f"priority must be an integer, got {priority!r}")
    if priority != 0 and engine.config.scheduling_policy != "priority":
        # vLLM's own refusal, word for word.
        return error(400, f"Got priority {priority} but Priority scheduling is not enabled.")
    if prompt_tokens + requested > limit:
        return error(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested"
            f" {prompt_tokens + requested} tokens ({prompt_tokens} in the messages,"
            f" {requested} in the completion)."
            " Please reduce the length of the messages or completion.",
        )
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    try:
        handle = engine.submit(
            prompt_tokens, requested, request_id=rid, output_tokens=output_tokens, priority=priority
        )
    except EngineUnavailableError as exc:
        return error(503, str(exc), "ServiceUnavailableError")
    try:
        if body.get("stream"):
            options = body.get("stream_options") or {}
            usage = isinstance(options, dict) and bool(options.get("include_usage"))
            return await stream_answer(request, handle, settings.model_name, chat=chat, usage=usage)
        return await whole_answer(handle, settings.model_name, chat=chat)
    finally:
        # A client that went away (cancelled handler or broken stream) aborts its
        # request, as vLLM does, so its blocks are freed.
        engine.abort(rid)


def usage_of(handle: RequestHandle) -> dict[str, int]:
    """The OpenAI usage object of a request so far."""
    prompt, completion = handle.seq.prompt_tokens, handle.seq.generated
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


async def whole_answer(handle: RequestHandle, model: str, *, chat: bool) -> web.Response:
    """Wait for every token, then answer with one JSON body."""
    parts: list[str] = []
    while (token := await handle.tokens.get()) is not None:
        parts.append(token)
    if handle.error is not None:
        return error(500, handle.error, "InternalServerError")
    text = "".join(parts)
    reason = handle.finish_reason or "abort"
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return web.json_response(
        {
            "id": handle.seq.request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": usage_of(handle),
        }
    )


async def stream_answer(
    request: web.Request, handle: RequestHandle, model: str, *, chat: bool, usage: bool
) -> web.StreamResponse:
    """Server-sent events, one chunk per token, flushed as each token is made."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"

    async def send(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> None:
        chunk: dict[str, Any] = {
            "id": handle.seq.request_id,
            "object": kind,
            "created": created,
            "model": model,
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

    try:
        if chat:
            await send(
                [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
            )
        while (token := await handle.tokens.get()) is not None:
            finished = handle.seq.state == "finished" and handle.tokens.qsize() <= 1
            reason = handle.finish_reason if finished else None
            delta = {"delta": {"content": token}} if chat else {"text": token}
            await send([{"index": 0, **delta, "logprobs": None, "finish_reason": reason}])
        if handle.error is not None:
            payload = {
                "error": {
                    "object": "error",
                    "message": handle.error,
                    "type": "InternalServerError",
                    "code": 500,
                }
            }
            await response.write(f"data: {json.dumps(payload)}\n\n".encode())
        elif usage:
            await send([], usage=usage_of(handle))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:
        # The client went away mid-stream: generate() aborts the request; nothing to
        # tell a closed socket, and no error to log for an ordinary disconnect.
        pass
    return response


async def models(request: web.Request) -> web.Response:
    """GET /v1/models."""
    engine, settings = request.app[ENGINE_KEY], request.app[SETTINGS_KEY]
    card = {
        "id": settings.model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "kvguard-sim",
        "max_model_len": context_limit(request)
        if settings.flavor == "llamacpp"
        else engine.config.max_model_len,
    }
    return web.json_response({"object": "list", "data": [card]})


async def tokenize_handler(request: web.Request) -> web.Response:
    """POST /tokenize (vLLM: ``prompt`` or ``messages``; llama.cpp: ``content``)."""
    body = await read_json(request)
    if isinstance(body.get("messages"), list):
        count = count_chat_tokens(body["messages"])
        return web.json_response(
            {"count": count, "max_model_len": context_limit(request), "tokens": []}
        )
    text = body.get("prompt", body.get("content"))
    if not isinstance(text, str):
        return error(400, "give the text as 'prompt' (or 'content'), or chat 'messages'")
    tokens = tokenize(text)
    if request.app[SETTINGS_KEY].flavor == "llamacpp":
        return web.json_response({"tokens": tokens})
    return web.json_response(
        {"count": len(tokens), "max_model_len": context_limit(request), "tokens": tokens}
    )
