"""Prompt token counts: the count cache, the engine's ``/tokenize``, and answers' ``usage``.

A request's KV footprint starts with its prompt, and only the engine knows that count
exactly. :class:`PromptCounter` gives the best count available without a round trip
(token ids, a cached count, else an estimate that errs high), asks ``/tokenize``
when the count decides something now, and otherwise lets the answer's ``usage`` or
a background ``/tokenize`` correct the estimate while the request runs. The
functions below read ``usage`` from relayed answers. Kept apart because it is the
one part of the proxy that talks to the engine for itself, with its own timeout,
bound and cache.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog

from kvguard.actuators.accounting import (
    InflightRequest,
    TokenCache,
    estimate_chat_tokens,
    estimate_tokens,
)
from kvguard.actuators.proxy.screen import MAX_TOKENS_LIMIT

log = structlog.get_logger("kvguard.proxy")
TOKENIZE_TIMEOUT_S = 0.25
# Request fields besides the prompt that change the engine's count of it (templates,
# tools, truncation, special tokens, the model): part of the count cache's key.
PROMPT_SHAPING_FIELDS = (
    "model",
    "tools",
    "functions",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "add_special_tokens",
    "truncate_prompt_tokens",
    "suffix",
)
# Prompt counts asked of the engine in the background at once, at most; past it (the
# engine tokenizes slowly) a request keeps its estimate, which errs high.
MAX_BACKGROUND_COUNTS = 16  # each is one more request on the engine's API server


@dataclass(frozen=True)
class PromptCount:
    """A prompt's token count as known without asking the engine."""

    count: int
    exact: bool  # token ids, or the engine's count from the cache; else an estimate
    key: int  # the cache key (a hash of the prompt and PROMPT_SHAPING_FIELDS)


class PromptCounter:
    """Counts prompts: from the request, the cache, or the engine (``/tokenize``).

    ``session`` gives the proxy's pooled session to ``upstream`` (the engine's base
    URL): counting shares its connections with forwarding.
    """

    def __init__(self, session: Callable[[], aiohttp.ClientSession], upstream: str) -> None:
        self._session = session
        self._upstream = upstream
        self.cache = TokenCache()  # prompt key -> the engine's count (or a kept estimate)
        self._tokenize_ok = True
        self.pending: set[asyncio.Future[None]] = set()  # counts asked in the background

    async def close(self) -> None:
        """Stop the counts still asked in the background (the proxy stops)."""
        for task in list(self.pending):
            task.cancel()
        await asyncio.gather(*self.pending, return_exceptions=True)

    def known(self, payload: dict[str, Any], *, chat: bool) -> PromptCount:
        """The prompt's tokens without asking the engine: ids, the cache, else an estimate."""
        subject: object = payload.get("messages") if chat else payload.get("prompt")
        if (
            isinstance(subject, list)
            and not chat
            and subject
            and all(isinstance(t, int) for t in subject)
        ):
            return PromptCount(len(subject), exact=True, key=0)  # already token ids
        text = json.dumps(subject, sort_keys=True)
        # The fields that change what the engine counts for the same prompt are part of
        # the key, so a count remembered for one request is never another's.
        shaping = {f: payload[f] for f in PROMPT_SHAPING_FIELDS if f in payload}
        key = hash((text, json.dumps(shaping, sort_keys=True))) if shaping else hash(text)
        cached = self.cache.get(key)
        if cached is not None:
            return PromptCount(cached, exact=True, key=key)
        if chat and isinstance(subject, list):
            estimate = estimate_chat_tokens(subject)
        else:
            estimate = estimate_tokens(subject if isinstance(subject, str) else text)
        return PromptCount(estimate, exact=False, key=key)

    async def exact(self, payload: dict[str, Any], known: PromptCount, *, chat: bool) -> int:
        """``known`` when exact, else the engine's /tokenize count (bounded, cached).

        When the engine has no count to give, the estimate (cached too, so the engine
        is not asked again).
        """
        if known.exact:
            return known.count
        count = await self._tokenize(payload, chat=chat)
        if count is None:
            count = known.count  # the estimate, remembered so the engine is not asked again
        self.cache.put(known.key, count)
        return count

    def count_later(
        self, tracked: InflightRequest, payload: dict[str, Any], key: int, *, chat: bool
    ) -> None:
        """Ask the engine for the prompt's count while the request goes on; correct it then."""
        if len(self.pending) >= MAX_BACKGROUND_COUNTS:
            return  # the engine is slow to tokenize: the (high) estimate stands
        task = asyncio.ensure_future(self._count_in_background(tracked, payload, key, chat=chat))
        self.pending.add(task)
        task.add_done_callback(self._count_ended)

    def _count_ended(self, task: asyncio.Future[None]) -> None:
        self.pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("prompt_count_failed", error=repr(task.exception())[:200])

    async def _count_in_background(
        self, tracked: InflightRequest, payload: dict[str, Any], key: int, *, chat: bool
    ) -> None:
        count = await self._tokenize(payload, chat=chat)
        if count is None:
            return  # the estimate stands; not cached, so a later cap asks the engine again
        self.cache.put(key, count)
        if tracked.prompt_key is not None and not tracked.prompt_counted:
            tracked.prompt_tokens = count  # the answer's usage, when it came first, stands
            tracked.prompt_key = None

    def remember_usage(self, tracked: InflightRequest) -> None:
        """Cache the prompt's count its answer's ``usage`` gave (see :func:`_count_usage`)."""
        if tracked.prompt_key is not None and tracked.prompt_counted:
            self.cache.put(tracked.prompt_key, tracked.prompt_tokens)
            tracked.prompt_key = None

    async def _tokenize(self, payload: dict[str, Any], *, chat: bool) -> int | None:
        if not self._tokenize_ok:
            return None
        query: dict[str, Any] = (
            {"messages": payload.get("messages")} if chat else {"prompt": payload.get("prompt")}
        )
        if "model" in payload:
            query["model"] = payload["model"]
        try:
            async with self._session().post(
                self._upstream + "/tokenize",
                json=query,
                timeout=aiohttp.ClientTimeout(total=TOKENIZE_TIMEOUT_S),
                allow_redirects=False,
            ) as resp:
                if resp.status == 404:
                    self._tokenize_ok = False  # this engine has none: estimate from now on
                    return None
                if resp.status != 200:
                    return None
                data = await resp.json()
        except (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError, ValueError):
            return None
        count = data.get("count") if isinstance(data, dict) else None
        if isinstance(count, int):
            return count
        tokens = data.get("tokens") if isinstance(data, dict) else None
        return len(tokens) if isinstance(tokens, list) else None


def _count_events(tracked: InflightRequest, data: bytes) -> bytes:
    """Count generated tokens from whole SSE events; return the incomplete tail."""
    *events, tail = data.split(b"\n\n")
    for event in events:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            try:
                chunk = json.loads(line[5:])
            except (ValueError, RecursionError):
                continue
            usage = chunk.get("usage") if isinstance(chunk, dict) else None
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                tracked.generated = usage["completion_tokens"]
                _prompt_from_usage(tracked, usage)
            elif isinstance(chunk, dict) and chunk.get("choices"):
                tracked.generated += 1  # one token per content chunk, as engines stream
    return tail


def _count_usage(tracked: InflightRequest, body: bytes) -> None:
    """Completion tokens from a whole answer's ``usage`` (when the body parses)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # an engine's garbage must not fail the answer
        return
    usage = data.get("usage") if isinstance(data, dict) else None
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        tracked.generated = usage["completion_tokens"]
        _prompt_from_usage(tracked, usage)


def _prompt_from_usage(tracked: InflightRequest, usage: dict[str, Any]) -> None:
    """The engine's prompt count from ``usage``, for a prompt only estimated so far."""
    prompt = usage.get("prompt_tokens")
    if (
        tracked.prompt_key is not None
        and isinstance(prompt, int)
        and not isinstance(prompt, bool)
        and 1 <= prompt <= MAX_TOKENS_LIMIT  # an engine's garbage must not be remembered
    ):
        tracked.prompt_tokens = prompt
        tracked.prompt_counted = True


def _answer_has_usage(payload: dict[str, Any]) -> bool:
    """Whether the engine's answer will carry ``usage``: a whole answer, or a stream asked to.

    Truthiness as the engines read it (``"stream": 1`` streams too).
    """
    if not payload.get("stream"):
        return True
    options = payload.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))
