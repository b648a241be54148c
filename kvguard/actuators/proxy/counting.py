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
    digest,
    estimate_chat_tokens,
    estimate_tokens,
    estimate_value_tokens,
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
# The default of ``subject``: the prompt is the body's ``messages`` or ``prompt``.
_FROM_PAYLOAD: Any = object()
# Prompt counts asked of the engine in the background at once, at most; past it (the
# engine tokenizes slowly) a request keeps its estimate, which errs high.
MAX_BACKGROUND_COUNTS = 16  # each is one more request on the engine's API server


@dataclass(frozen=True)
class PromptCount:
    """A prompt's token count as known without asking the engine."""

    count: int
    exact: bool  # token ids, or the engine's count from the cache; else an estimate
    key: int  # the cache key (a hash of the prompt and PROMPT_SHAPING_FIELDS)


def measure_prompt(
    payload: dict[str, Any], *, chat: bool, subject: object = _FROM_PAYLOAD
) -> PromptCount:
    """The prompt's token ids' count, else its cache key and an estimate (pure).

    No state is read, so a large body's prompt is measured in the parsing thread
    (hashing and estimating 10,000 messages takes ~15 ms, which would stall the
    loop); :meth:`PromptCounter.recall` then looks the key up on the loop.
    """
    if subject is _FROM_PAYLOAD:
        subject = payload.get("messages") if chat else payload.get("prompt")
    if (
        isinstance(subject, list)
        and not chat
        and subject
        and all(isinstance(t, int) for t in subject)
    ):
        return PromptCount(len(subject), exact=True, key=0)  # already token ids
    # Keyed and estimated from the parsed values: writing the prompt out again (it
    # may be megabytes, or a body of many small values) would cost another copy.
    # The fields that change what the engine counts for the same prompt are part of
    # the key, so a count remembered for one request is never another's.
    shaping = {f: payload[f] for f in PROMPT_SHAPING_FIELDS if f in payload}
    key = digest((subject, shaping)) if shaping else digest(subject)
    if chat and isinstance(subject, list):
        estimate = estimate_chat_tokens(subject)
    elif isinstance(subject, str):
        estimate = estimate_tokens(subject)
    else:
        estimate = estimate_value_tokens(subject)
    return PromptCount(estimate, exact=False, key=key)


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
        # Called when a background count corrected an in-flight request's estimate.
        self.corrected: Callable[[], None] | None = None

    async def close(self) -> None:
        """Stop the counts still asked in the background (the proxy stops)."""
        for task in list(self.pending):
            task.cancel()
        await asyncio.gather(*self.pending, return_exceptions=True)

    def known(
        self, payload: dict[str, Any], *, chat: bool, subject: object = _FROM_PAYLOAD
    ) -> PromptCount:
        """The prompt's tokens without asking the engine: ids, the cache, else an estimate.

        ``subject`` is the prompt (text, token ids, or messages when ``chat``) in a body
        of another shape than OpenAI's (:mod:`.shapes`); by default the body's
        ``messages`` or ``prompt``.
        """
        return self.recall(measure_prompt(payload, chat=chat, subject=subject))

    def recall(self, measured: PromptCount) -> PromptCount:
        """``measured`` (:func:`measure_prompt`), or the engine's count remembered for it."""
        if measured.exact:
            return measured
        cached = self.cache.get(measured.key)
        if cached is not None:
            return PromptCount(cached, exact=True, key=measured.key)
        return measured

    async def exact(
        self,
        payload: dict[str, Any],
        known: PromptCount,
        *,
        chat: bool,
        subject: object = _FROM_PAYLOAD,
    ) -> int:
        """``known`` when exact, else the engine's /tokenize count (bounded, cached).

        When the engine has no count to give, the estimate (cached too, so the engine
        is not asked again).
        """
        if known.exact:
            return known.count
        count = await self._tokenize(payload, chat=chat, subject=subject)
        if count is None:
            count = known.count  # the estimate, remembered so the engine is not asked again
        self.cache.put(known.key, count)
        return count

    def count_later(
        self,
        tracked: InflightRequest,
        payload: dict[str, Any],
        key: int,
        *,
        chat: bool,
        subject: object = _FROM_PAYLOAD,
    ) -> None:
        """Ask the engine for the prompt's count while the request goes on; correct it then."""
        if len(self.pending) >= MAX_BACKGROUND_COUNTS:
            return  # the engine is slow to tokenize: the (high) estimate stands
        task = asyncio.ensure_future(
            self._count_in_background(tracked, payload, key, chat=chat, subject=subject)
        )
        self.pending.add(task)
        task.add_done_callback(self._count_ended)

    def _count_ended(self, task: asyncio.Future[None]) -> None:
        self.pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("prompt_count_failed", error=repr(task.exception())[:200])

    async def _count_in_background(
        self,
        tracked: InflightRequest,
        payload: dict[str, Any],
        key: int,
        *,
        chat: bool,
        subject: object,
    ) -> None:
        count = await self._tokenize(payload, chat=chat, subject=subject)
        if count is None:
            return  # the estimate stands; not cached, so a later cap asks the engine again
        self.cache.put(key, count)
        if tracked.prompt_key is not None and not tracked.prompt_counted:
            tracked.prompt_tokens = count  # the answer's usage, when it came first, stands
            tracked.prompt_key = None
            tracked.prompt_exact = True
            if self.corrected is not None:
                self.corrected()  # a smaller count is room for requests waiting

    def remember_usage(self, tracked: InflightRequest) -> None:
        """Cache the prompt's count its answer's ``usage`` gave (see :func:`_count_usage`)."""
        if tracked.prompt_key is not None and tracked.prompt_counted:
            self.cache.put(tracked.prompt_key, tracked.prompt_tokens)
            tracked.prompt_key = None

    async def _tokenize(
        self, payload: dict[str, Any], *, chat: bool, subject: object = _FROM_PAYLOAD
    ) -> int | None:
        if not self._tokenize_ok:
            return None
        if subject is _FROM_PAYLOAD:
            subject = payload.get("messages") if chat else payload.get("prompt")
        if not chat and isinstance(subject, list) and not all(isinstance(t, int) for t in subject):
            # A prompt in parts (llama.cpp's infill, Ollama's system + prompt): one text.
            subject = "".join(p for p in subject if isinstance(p, str))
        query: dict[str, Any] = {"messages": subject} if chat else {"prompt": subject}
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
            if not isinstance(chunk, dict):
                continue
            generated, prompt = _answer_counts(chunk)
            if generated is not None:
                tracked.generated = generated
                _prompt_from_usage(tracked, {"prompt_tokens": prompt})
            elif _is_token_chunk(chunk):
                tracked.generated += 1  # one token per content chunk, as engines stream
    return tail


def _count_usage(tracked: InflightRequest, body: bytes) -> None:
    """Completion tokens from a whole answer's ``usage`` (when the body parses)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # an engine's garbage must not fail the answer
        return
    if isinstance(data, list):  # a batch (SGLang's /generate, TGI's POST /): one per item
        counts = [_answer_counts(item) for item in data if isinstance(item, dict)]
        if counts and all(c[0] is not None for c in counts):
            tracked.generated = sum(c[0] or 0 for c in counts)
        return
    if not isinstance(data, dict):
        return
    generated, prompt = _answer_counts(data)
    if generated is not None:
        tracked.generated = generated
        _prompt_from_usage(tracked, {"prompt_tokens": prompt})


def _answer_counts(data: dict[str, Any]) -> tuple[int | None, int | None]:
    """(generated, prompt) tokens an answer or stream event states, each None when it does not.

    OpenAI's ``usage`` (completion_tokens, prompt_tokens); the Responses API's and
    Anthropic's (output_tokens, input_tokens; the Responses API's inside
    ``response`` on its last event); SGLang's ``meta_info``; llama.cpp's
    ``tokens_predicted`` and ``tokens_evaluated``; TGI's ``details``; Ollama's
    ``eval_count`` and ``prompt_eval_count``.
    """
    usage = data.get("usage")
    if not isinstance(usage, dict) and isinstance(data.get("response"), dict):
        usage = data["response"].get("usage")
    if isinstance(usage, dict):
        for generated, prompt in (
            ("completion_tokens", "prompt_tokens"),
            ("output_tokens", "input_tokens"),
        ):
            if _count(usage.get(generated)) is not None:
                return usage[generated], _count(usage.get(prompt))
    meta = data.get("meta_info")
    if isinstance(meta, dict) and _count(meta.get("completion_tokens")) is not None:
        return meta["completion_tokens"], _count(meta.get("prompt_tokens"))
    if data.get("stop") is True and _count(data.get("tokens_predicted")) is not None:
        return data["tokens_predicted"], _count(data.get("tokens_evaluated"))
    details = data.get("details")
    if isinstance(details, dict) and _count(details.get("generated_tokens")) is not None:
        return details["generated_tokens"], None
    if data.get("done") is True and _count(data.get("eval_count")) is not None:
        return data["eval_count"], _count(data.get("prompt_eval_count"))
    return None, None


def _is_token_chunk(chunk: dict[str, Any]) -> bool:
    """Whether a stream event carries generated text (one token, as engines stream).

    OpenAI's ``choices``, the Responses API's and Anthropic's text deltas, SGLang's
    ``text``, llama.cpp's ``content``, TGI's ``token`` and Triton's ``text_output``.
    """
    if chunk.get("choices"):
        return True
    if chunk.get("type") in ("response.output_text.delta", "content_block_delta"):
        return True
    return any(key in chunk for key in ("text", "content", "token", "text_output"))


def _count(value: object) -> int | None:
    """``value`` when it is a token count an engine could state, else None."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


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
        tracked.prompt_exact = True


def _answer_has_usage(payload: dict[str, Any]) -> bool:
    """Whether the engine's answer will carry ``usage``: a whole answer, or a stream asked to.

    Truthiness as the engines read it (``"stream": 1`` streams too).
    """
    if not payload.get("stream"):
        return True
    options = payload.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))
