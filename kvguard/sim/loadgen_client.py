"""One request of the load generator, sent the way a real client sends it.

A real client does not know how long the answer will be: it asks for ``max_tokens``
(a fixed budget, capped at the room the context leaves) and the model stops on its
own. The load generator knows each request's true length (``RequestSpec.output_tokens``)
and tells the engine, so the answer has that length on any engine:

``sim-field``
    the body carries ``"kvguard_sim_output_tokens": <true length>``; kvguard's
    simulated engine stops there (finish_reason ``stop``) unless ``max_tokens`` is
    shorter. Real engines ignore the field or warn about it.
``ignore-eos``
    for real engines (vLLM): ``max_tokens`` is the true length and ``"ignore_eos":
    true`` makes the answer exactly that long.

A 429 or 503 carrying ``Retry-After`` (seconds) is retried after that delay, capped,
up to the run's retry budget; one without it is not (the server gave no hint when
to come back). Every time is measured from the request's *scheduled* send time.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from kvguard.sim.loadgen_report import RequestOutcome
from kvguard.sim.traffic import RequestSpec

ENDPOINTS: Mapping[str, str] = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
}
SHED_STATUSES = frozenset({429, 503})
OUTPUT_LENGTHS = ("auto", "sim-field", "ignore-eos")
SIM_OUTPUT_FIELD = "kvguard_sim_output_tokens"
SIM_OWNER = "kvguard-sim"  # the owned_by of the simulated engine's model card
# vLLM's `priority` request field per class (lower runs first under its priority policy).
ENGINE_PRIORITIES: Mapping[str, int] = {"critical": 0, "standard": 1, "sheddable": 2}


@dataclass(frozen=True)
class ClientSettings:
    """What every request of a run shares: where, how, and how hard to insist.

    ``client_max_tokens`` None sends the true length as ``max_tokens`` (the old,
    clairvoyant client); ``output_length`` is ``sim-field`` or ``ignore-eos`` (auto is
    resolved before the run). ``max_context`` caps prompt + ``max_tokens``.
    ``engine_priority`` also sends the class as vLLM's ``priority`` field
    (:data:`ENGINE_PRIORITIES`), for an engine scheduling by priority.
    """

    base_url: str
    endpoint: str
    model: str
    stream: bool
    priority_header: str
    request_timeout_s: float
    max_context: int
    client_max_tokens: int | None
    output_length: str
    retries: int
    retry_cap_s: float
    engine_priority: bool = False


@dataclass
class Attempts:
    """How often a request was sent again, kept where a cancellation cannot lose it."""

    retries: int = 0


def retry_after_s(value: str | None) -> float | None:
    """Seconds of a ``Retry-After`` header; None when absent or an HTTP date (not honoured)."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def resolve_output_length(mode: str, card: Mapping[str, Any] | None) -> str:
    """``auto`` becomes ``sim-field`` on kvguard's simulator, ``ignore-eos`` elsewhere."""
    if mode != "auto":
        return mode
    return "sim-field" if card is not None and card.get("owned_by") == SIM_OWNER else "ignore-eos"


class Client:
    """Sends requests of one run on one session; see the module's docstring."""

    def __init__(self, session: aiohttp.ClientSession, settings: ClientSettings) -> None:
        self.session = session
        self.settings = settings
        self.loop = asyncio.get_running_loop()

    def max_tokens(self, spec: RequestSpec) -> int:
        """The ``max_tokens`` sent for ``spec``.

        The client's budget (or the true length with ``client_max_tokens`` None),
        never past the room the context leaves after the planned prompt. With
        ``ignore-eos`` it is the true length, within that same budget, so the answer
        is as long as on the simulator.
        """
        s = self.settings
        room = max(1, s.max_context - spec.prompt_tokens)
        budget = min(
            room, spec.output_tokens if s.client_max_tokens is None else s.client_max_tokens
        )
        if s.output_length == "ignore-eos":
            return max(1, min(budget, spec.output_tokens))
        return max(1, budget)

    def body(self, spec: RequestSpec, messages: list[tuple[str, str]]) -> dict[str, Any]:
        """The JSON body of ``spec`` with ``messages`` as (role, text)."""
        s = self.settings
        body: dict[str, Any] = {"model": s.model, "max_tokens": self.max_tokens(spec)}
        if s.endpoint == "chat":
            body["messages"] = [{"role": role, "content": text} for role, text in messages]
        else:
            body["prompt"] = " ".join(text for _, text in messages)
        body["stream"] = s.stream
        if s.stream:
            body["stream_options"] = {"include_usage": True}
        if s.engine_priority:
            body["priority"] = ENGINE_PRIORITIES[spec.priority]
        if s.output_length == "sim-field":
            body[SIM_OUTPUT_FIELD] = spec.output_tokens
        else:
            body["ignore_eos"] = True
        return body

    def unfinished(self, spec: RequestSpec) -> RequestOutcome:
        """The outcome of a request the run cut off."""
        return self._outcome(spec, "unfinished", "unfinished", self.max_tokens(spec))

    def _outcome(
        self, spec: RequestSpec, status: str, kind: str, max_tokens: int
    ) -> RequestOutcome:
        return RequestOutcome(
            spec.priority,
            status,
            kind,
            max_tokens=max_tokens,
            output_tokens=spec.output_tokens,
            streamed=self.settings.stream,
        )

    async def send(
        self,
        spec: RequestSpec,
        messages: list[tuple[str, str]],
        *,
        scheduled: float,
        give_up_at: float,
        attempts: Attempts,
    ) -> RequestOutcome:
        """Send until answered, retrying a 429/503 with ``Retry-After`` within the budget.

        ``scheduled`` (loop time) is when the request was meant to go out: latencies
        count from there. No retry starts at or after ``give_up_at`` (the run's end).
        """
        body = self.body(spec, messages)
        while True:
            outcome, wait_s = await self._attempt(spec, body, scheduled)
            if (
                outcome.kind == "shed"
                and wait_s is not None
                and attempts.retries < self.settings.retries
            ):
                delay = min(wait_s, self.settings.retry_cap_s)
                if self.loop.time() + delay < give_up_at:
                    await asyncio.sleep(delay)
                    attempts.retries += 1
                    continue
            return replace(outcome, retries=attempts.retries)

    async def _attempt(
        self, spec: RequestSpec, body: dict[str, Any], scheduled: float
    ) -> tuple[RequestOutcome, float | None]:
        asked = int(body["max_tokens"])
        try:
            return await self._exchange(spec, body, scheduled)
        except (asyncio.TimeoutError, TimeoutError):
            return self._outcome(spec, "timeout", "failed", asked), None
        except aiohttp.ClientError:
            return self._outcome(spec, "connection_error", "failed", asked), None
        except ValueError:  # JSON that does not decode, or a shape we cannot read
            return self._outcome(spec, "bad_response", "failed", asked), None

    async def _exchange(
        self, spec: RequestSpec, body: dict[str, Any], scheduled: float
    ) -> tuple[RequestOutcome, float | None]:
        s = self.settings
        asked = int(body["max_tokens"])
        async with self.session.post(
            s.base_url + ENDPOINTS[s.endpoint],
            json=body,
            headers={s.priority_header: spec.priority},
            timeout=aiohttp.ClientTimeout(total=s.request_timeout_s),
            allow_redirects=False,
        ) as response:
            status = str(response.status)
            if response.status in SHED_STATUSES:
                wait_s = retry_after_s(response.headers.get("Retry-After"))
                return self._outcome(spec, status, "shed", asked), wait_s
            if 400 <= response.status < 500:
                return self._outcome(spec, status, "refused", asked), None
            if not 200 <= response.status < 300:
                return self._outcome(spec, status, "failed", asked), None
            if s.stream:
                return await self._read_stream(spec, response, scheduled, asked), None
            return await self._read_body(spec, response, scheduled, asked), None

    async def _read_body(
        self, spec: RequestSpec, response: aiohttp.ClientResponse, scheduled: float, asked: int
    ) -> RequestOutcome:
        data = json.loads(await response.read())
        prompt, completion = _usage(data)
        choices = data.get("choices") if isinstance(data, dict) else None
        first = choices[0] if isinstance(choices, list) and choices else {}
        reason = first.get("finish_reason") if isinstance(first, dict) else None
        return replace(
            self._outcome(spec, str(response.status), "completed", asked),
            e2e_s=self.loop.time() - scheduled,
            prompt_tokens=prompt,
            completion_tokens=completion,
            finish_reason=reason if isinstance(reason, str) else None,
        )

    async def _read_stream(
        self, spec: RequestSpec, response: aiohttp.ClientResponse, scheduled: float, asked: int
    ) -> RequestOutcome:
        first: float | None = None
        prompt = completion = 0
        reason: str | None = None
        done = False
        async for raw in response.content:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue  # blank separators, comments and event names
            payload = line[len("data:") :].strip()
            if payload == "[DONE]":
                done = True
                break
            chunk = json.loads(payload)
            if not isinstance(chunk, dict) or "error" in chunk:
                return self._outcome(spec, "stream_error", "failed", asked)
            if chunk.get("usage"):
                prompt, completion = _usage(chunk)
            for choice in chunk.get("choices") or []:
                if first is None and _content(choice):
                    first = self.loop.time() - scheduled
                ended = choice.get("finish_reason") if isinstance(choice, dict) else None
                if isinstance(ended, str) and ended:
                    reason = ended
        if not (done or reason):
            return self._outcome(spec, "incomplete", "failed", asked)
        return replace(
            self._outcome(spec, str(response.status), "completed", asked),
            ttft_s=first,
            e2e_s=self.loop.time() - scheduled,
            prompt_tokens=prompt,
            completion_tokens=completion,
            finish_reason=reason,
        )


def _usage(data: object) -> tuple[int, int]:
    """Prompt and completion tokens of an OpenAI ``usage`` object (0 when absent)."""
    if not isinstance(data, dict):
        raise ValueError("response is not a JSON object")  # noqa: TRY004 -- read as a bad response
    usage = data.get("usage") or {}
    if not isinstance(usage, dict):
        raise ValueError("usage is not a JSON object")  # noqa: TRY004 -- read as a bad response
    return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)


def _content(choice: object) -> bool:
    """Whether a streamed choice carries generated text (completions or chat delta)."""
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    text = choice.get("text") or (delta.get("content") if isinstance(delta, dict) else None)
    return bool(text)
