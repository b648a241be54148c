"""The load generator: drives an OpenAI-compatible endpoint with a traffic pattern.

:func:`run_load` turns the specs of a :mod:`kvguard.sim.traffic` pattern into HTTP
requests (``/v1/completions`` or ``/v1/chat/completions``, streamed by default),
measures time to first token and end-to-end latency, and reads the engine's
preemption counter from ``/metrics`` before and after. It is bounded: it stops
sending at ``duration_s`` or ``max_requests``, whichever comes first, gives
in-flight requests a grace period, then cancels them. It only talks to the URL
it is given and never follows redirects.

A prompt of N tokens is N plain lowercase words: the simulator's tokenizer counts
each as one token, and real tokenizers count them as roughly one each.

One module of ~600 lines on purpose: sending, timing and bounding requests are one
loop whose limits (duration, count, grace, cancellation) must be read together; the
report and the command live apart (``loadgen_report``, ``kvguard.cli.loadgen``).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
from collections import Counter
from collections.abc import Coroutine, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from kvguard.errors import InvalidInputError
from kvguard.http_client import DEFAULT_KEEPALIVE_S
from kvguard.sim.loadgen_report import (
    ClassCounts,
    LoadReport,
    Percentiles,
    engine_reading,
    preemptions_in,
)
from kvguard.sim.traffic import (
    DEFAULT_MAX_CONTEXT,
    PATTERNS,
    PRIORITIES,
    PriorityShares,
    RequestSpec,
    TrafficParams,
    generate,
    new_message_tokens,
)

ENDPOINTS: Mapping[str, str] = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
}
SHED_STATUSES = frozenset({429, 503})
_SCRAPE_TIMEOUT_S = 5.0
_PROGRESS_INTERVAL_S = 0.5
_SAMPLE_INTERVAL_S = 0.5
_CHAT_TEMPLATE_TOKENS = 32  # role markers a chat template adds around the messages

# Plain lowercase words only: no digits, underscores or punctuation, so each is
# exactly one token to the simulator and close to one to a real tokenizer.
_WORD_LIST = (
    "apple river stone cloud green table window garden silver paper market ocean"
    " forest yellow bridge candle winter summer orange pencil mountain valley island"
    " coffee letter number planet rocket shadow thunder velvet wonder anchor basket"
    " castle dragon engine falcon ginger harbor jacket kettle ladder meadow needle"
    " oyster parrot quartz rabbit saddle tunnel umbrella violet walnut zipper amber"
    " breeze cherry desert ember feather glacier hollow ivory jungle lantern marble"
    " nectar orbit pepper quiet ripple spruce timber unity vessel willow yonder zenith"
    " blue calm deep early fair gentle happy kind light mild noble proud rapid"
    " sharp tall warm wild young bold brave clear"
)
_WORDS = tuple(_WORD_LIST.split())


@dataclass(frozen=True)
class LoadConfig:
    """What to drive, with which pattern, and the bounds of the run.

    ``url`` is the server's base URL (``http://host:port``). ``endpoint`` is
    ``completions`` or ``chat``. ``model`` None asks ``GET /v1/models`` and takes
    the first id. ``slo_ttft_s`` and ``slo_e2e_s`` define goodput. Values are
    checked here; a bad one raises :class:`InvalidInputError` naming the field.
    """

    url: str
    pattern: str = "steady"
    duration_s: float = 60.0
    max_requests: int = 1000
    concurrency: int = 64
    seed: int = 0
    priority_shares: PriorityShares = field(default_factory=PriorityShares)
    scale: float = 1.0
    max_context: int = DEFAULT_MAX_CONTEXT
    endpoint: str = "completions"
    stream: bool = True
    slo_ttft_s: float = 2.0
    slo_e2e_s: float = 30.0
    request_timeout_s: float = 60.0
    grace_s: float = 5.0
    priority_header: str = "X-Priority"
    model: str | None = None

    def __post_init__(self) -> None:
        check_url(self.url)
        if self.pattern not in PATTERNS:
            raise InvalidInputError(
                "pattern", self.pattern, f"must be one of {', '.join(PATTERNS)}"
            )
        if self.endpoint not in ENDPOINTS:
            raise InvalidInputError("endpoint", self.endpoint, "must be completions or chat")
        for name in ("duration_s", "slo_ttft_s", "slo_e2e_s", "request_timeout_s"):
            _positive(name, getattr(self, name))
        if not (math.isfinite(self.grace_s) and self.grace_s >= 0):
            raise InvalidInputError("grace_s", self.grace_s, "must be a number of seconds >= 0")
        for name in ("max_requests", "concurrency"):
            if getattr(self, name) < 1:
                raise InvalidInputError(name, getattr(self, name), "must be an integer >= 1")
        if not self.priority_header.strip():
            raise InvalidInputError("priority_header", self.priority_header, "must not be empty")
        if self.model is not None and not self.model.strip():
            raise InvalidInputError("model", self.model, "must not be empty")
        self.traffic()  # scale and max_context are checked where they are used

    @property
    def base_url(self) -> str:
        """The URL without a trailing slash, ready for a path."""
        return self.url.rstrip("/")

    def traffic(self) -> TrafficParams:
        """The pattern's parameters for this run."""
        return TrafficParams(self.duration_s, self.scale, self.max_context, self.priority_shares)


def _positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise InvalidInputError(name, value, "must be a number of seconds > 0")


def check_url(url: str) -> None:
    """Raise :class:`InvalidInputError` unless ``url`` is ``http(s)://host[:port][/prefix]``."""
    allowed = "must be an http:// or https:// URL with a host, like http://127.0.0.1:8000"
    try:
        parts = urlsplit(url)
        port_ok = parts.port is None or parts.port > 0
    except ValueError:  # a port that is not a number, or out of range
        raise InvalidInputError("url", url, allowed) from None
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise InvalidInputError("url", url, allowed)
    if parts.query or parts.fragment or parts.username or parts.password:
        raise InvalidInputError("url", url, allowed + " (no query, fragment or credentials)")


def words(seed: str, count: int) -> str:
    """``count`` plain lowercase words, the same for the same ``seed``."""
    rng = random.Random(seed)
    return " ".join(rng.choices(_WORDS, k=count))


@dataclass(frozen=True)
class _Outcome:
    priority: str
    status: str
    kind: str  # "ok", "shed", "failed" or "unfinished"
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class _Conversation:
    # (role, text) of the history kept by the client; a failed turn is dropped from it,
    # as a user re-asks, so the history only holds answered turns.
    history: list[tuple[str, str]] = field(default_factory=list)
    last_spec: RequestSpec | None = None


class _Run:
    """One run's state: dispatch, in-flight tasks, and what has come back."""

    def __init__(self, config: LoadConfig, session: aiohttp.ClientSession, model: str) -> None:
        self.config = config
        self.session = session
        self.model = model
        self.loop = asyncio.get_running_loop()
        self.start = self.loop.time()
        self.deadline = self.start + config.duration_s
        self.slots = asyncio.Semaphore(config.concurrency)
        self.tasks: set[asyncio.Task[_Outcome | None]] = set()
        self.outcomes: list[_Outcome] = []
        self.sent = 0
        self.by_kind: Counter[str] = Counter()
        self._conversations: dict[int, _Conversation] = {}
        self._tails: dict[int, asyncio.Task[_Outcome | None]] = {}

    # ------------------------------------------------------------------ dispatch
    async def dispatch(self, specs: Iterator[RequestSpec]) -> None:
        """Send specs at their offsets until the duration or the request budget is spent."""
        for number, spec in enumerate(specs):
            if self.sent >= self.config.max_requests or not await self._wait_until(spec.at_s):
                return
            if spec.conversation is None:
                if not await self._take_slot():
                    return
                self._spawn(self._one_shot(number, spec))
            else:
                conversation = spec.conversation
                previous = self._tails.get(conversation)
                turn = self._turn(number, spec, conversation, previous)
                self._tails[conversation] = self._spawn(turn)

    async def drain(self) -> None:
        """Let in-flight requests finish until the deadline plus the grace period."""
        if self.tasks:
            left = max(self.deadline - self.loop.time(), 0.0) + self.config.grace_s
            await asyncio.wait(set(self.tasks), timeout=left)

    async def cancel_all(self) -> None:
        """Cancel whatever is still in flight and wait for it to record its end."""
        pending = set(self.tasks)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _wait_until(self, at_s: float) -> bool:
        target = self.start + at_s
        if target >= self.deadline:
            return False
        await asyncio.sleep(max(0.0, target - self.loop.time()))
        return True

    async def _take_slot(self) -> bool:
        # Waiting for a free slot is bounded by the deadline: when the server is
        # saturated, arrivals queue here, as they would in a client's own pool.
        left = self.deadline - self.loop.time()
        if left <= 0:
            return False
        try:
            await asyncio.wait_for(self.slots.acquire(), timeout=left)
        except (asyncio.TimeoutError, TimeoutError):
            return False
        if self.sent >= self.config.max_requests:
            self.slots.release()
            return False
        self.sent += 1
        return True

    def _spawn(self, coro: Coroutine[Any, Any, _Outcome | None]) -> asyncio.Task[_Outcome | None]:
        task: asyncio.Task[_Outcome | None] = self.loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _one_shot(self, number: int, spec: RequestSpec) -> _Outcome:
        text = words(f"{self.config.seed}/{number}", spec.prompt_tokens)
        try:
            return await self._send(spec, [("user", text)])
        finally:
            self.slots.release()

    async def _turn(
        self,
        number: int,
        spec: RequestSpec,
        conversation: int,
        previous: asyncio.Task[_Outcome | None] | None,
    ) -> _Outcome | None:
        if previous is not None:
            await asyncio.wait({previous})  # its outcome is recorded by that task itself
        if not await self._take_slot():
            return None
        try:
            state = self._conversations.setdefault(conversation, _Conversation())
            if spec.turn == 0:
                state.history = []
            tokens = new_message_tokens(spec, state.last_spec)
            state.last_spec = spec
            asked = [*state.history, ("user", words(f"{self.config.seed}/{number}", tokens))]
            outcome = await self._send(spec, asked)
            if outcome.kind == "ok":
                answer = words(f"{self.config.seed}/{number}/answer", outcome.completion_tokens)
                state.history = [*asked, ("assistant", answer)]
            return outcome
        finally:
            self.slots.release()

    # ------------------------------------------------------------------ one request
    def _body(self, spec: RequestSpec, messages: list[tuple[str, str]]) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": spec.max_tokens}
        if self.config.endpoint == "chat":
            body["messages"] = [{"role": role, "content": text} for role, text in messages]
        else:
            body["prompt"] = " ".join(text for _, text in messages)
        body["stream"] = self.config.stream
        if self.config.stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def _send(self, spec: RequestSpec, messages: list[tuple[str, str]]) -> _Outcome:
        # Recorded exactly once, in `finally`: a cancellation (the grace period ran
        # out) leaves the default outcome, and is then re-raised.
        # Still running when the run's grace period ended: cut off by us, not failed by the server.
        outcome = _Outcome(spec.priority, "unfinished", "unfinished")
        try:
            outcome = await self._exchange(spec, messages)
        except (asyncio.TimeoutError, TimeoutError):
            outcome = _Outcome(spec.priority, "timeout", "failed")
        except aiohttp.ClientError:
            outcome = _Outcome(spec.priority, "connection_error", "failed")
        except ValueError:  # JSON that does not decode, or a shape we cannot read
            outcome = _Outcome(spec.priority, "bad_response", "failed")
        finally:
            self.outcomes.append(outcome)
            self.by_kind[outcome.kind] += 1
        return outcome

    async def _exchange(self, spec: RequestSpec, messages: list[tuple[str, str]]) -> _Outcome:
        began = self.loop.time()
        async with self.session.post(
            self.config.base_url + ENDPOINTS[self.config.endpoint],
            json=self._body(spec, messages),
            headers={self.config.priority_header: spec.priority},
            timeout=aiohttp.ClientTimeout(total=self.config.request_timeout_s),
            allow_redirects=False,
        ) as response:
            status = str(response.status)
            if response.status in SHED_STATUSES:
                return _Outcome(spec.priority, status, "shed")
            if not 200 <= response.status < 300:
                return _Outcome(spec.priority, status, "failed")
            if self.config.stream:
                return await self._read_stream(spec, response, began)
            return await self._read_body(spec, response, began)

    async def _read_body(
        self, spec: RequestSpec, response: aiohttp.ClientResponse, began: float
    ) -> _Outcome:
        data = json.loads(await response.read())
        prompt, completion = _usage(data)
        e2e = self.loop.time() - began
        return _Outcome(spec.priority, str(response.status), "ok", None, e2e, prompt, completion)

    async def _read_stream(
        self, spec: RequestSpec, response: aiohttp.ClientResponse, began: float
    ) -> _Outcome:
        first: float | None = None
        prompt = completion = 0
        finished = False
        async for raw in response.content:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue  # blank separators, comments and event names
            payload = line[len("data:") :].strip()
            if payload == "[DONE]":
                finished = True
                break
            chunk = json.loads(payload)
            if not isinstance(chunk, dict) or "error" in chunk:
                return _Outcome(spec.priority, "stream_error", "failed")
            if chunk.get("usage"):
                prompt, completion = _usage(chunk)
            for choice in chunk.get("choices") or []:
                if first is None and _content(choice):
                    first = self.loop.time() - began
                finished = finished or bool(choice.get("finish_reason"))
        if not finished:
            return _Outcome(spec.priority, "incomplete", "failed")
        e2e = self.loop.time() - began
        return _Outcome(spec.priority, str(response.status), "ok", first, e2e, prompt, completion)

    # ------------------------------------------------------------------ report
    def report(self, preemptions: float | None, duration_s: float) -> LoadReport:
        """The report over every recorded outcome."""
        config = self.config
        ok = [o for o in self.outcomes if o.kind == "ok"]
        classes = {
            name: ClassCounts(
                sent=sum(o.priority == name for o in self.outcomes),
                succeeded=sum(o.priority == name and o.kind == "ok" for o in self.outcomes),
                failed=sum(o.priority == name and o.kind == "failed" for o in self.outcomes),
                shed=sum(o.priority == name and o.kind == "shed" for o in self.outcomes),
                unfinished=sum(
                    o.priority == name and o.kind == "unfinished" for o in self.outcomes
                ),
            )
            for name in PRIORITIES
        }
        good = sum(_within_slo(o, config) for o in ok)
        return LoadReport(
            pattern=config.pattern,
            seed=config.seed,
            model=self.model,
            duration_s=duration_s,
            sent=len(self.outcomes),
            succeeded=len(ok),
            failed=self.by_kind["failed"],
            shed=self.by_kind["shed"],
            unfinished=self.by_kind["unfinished"],
            by_priority=classes,
            ttft_s=Percentiles.of([o.ttft_s for o in ok if o.ttft_s is not None]),
            e2e_s=Percentiles.of([o.e2e_s for o in ok if o.e2e_s is not None]),
            prompt_tokens=sum(o.prompt_tokens for o in ok),
            completion_tokens=sum(o.completion_tokens for o in ok),
            slo_ttft_s=config.slo_ttft_s,
            slo_e2e_s=config.slo_e2e_s,
            goodput=good,
            goodput_ratio=good / len(self.outcomes) if self.outcomes else None,
            preemptions=preemptions,
            status_counts=dict(Counter(o.status for o in self.outcomes)),
        )

    def progress_line(self) -> str:
        """The one-line progress shown on a terminal."""
        elapsed = min(self.loop.time() - self.start, self.config.duration_s)
        return (
            f"loadgen {self.config.pattern}  {elapsed:.1f}s/{self.config.duration_s:g}s"
            f"  sent {self.sent}  ok {self.by_kind['ok']}  shed {self.by_kind['shed']}"
            f"  failed {self.by_kind['failed']}"
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


def _within_slo(outcome: _Outcome, config: LoadConfig) -> bool:
    e2e = outcome.e2e_s if outcome.e2e_s is not None else math.inf
    if e2e > config.slo_e2e_s:
        return False
    if not config.stream:
        return True  # the first token cannot be seen apart from the last
    ttft = outcome.ttft_s if outcome.ttft_s is not None else e2e
    return ttft <= config.slo_ttft_s


async def _first_model(session: aiohttp.ClientSession, base_url: str) -> tuple[str, int | None]:
    """The first model the server lists at ``GET /v1/models``, and its max_model_len if given."""
    allowed = "must serve GET /v1/models with at least one model (or name the model)"
    try:
        async with session.get(
            base_url + "/v1/models",
            timeout=aiohttp.ClientTimeout(total=_SCRAPE_TIMEOUT_S),
            allow_redirects=False,
        ) as response:
            response.raise_for_status()
            data = json.loads(await response.read())
        card = data["data"][0]
        limit = card.get("max_model_len")
        return str(card["id"]), limit if isinstance(limit, int) and limit > 1 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError) as exc:
        raise InvalidInputError("url", base_url, f"{allowed}; {type(exc).__name__}") from exc
    except (ValueError, LookupError, TypeError) as exc:
        raise InvalidInputError("url", base_url, f"{allowed}; unexpected answer") from exc


async def _scrape(session: aiohttp.ClientSession, base_url: str) -> str | None:
    """The text of ``GET /metrics``; None when the server does not serve it."""
    try:
        async with session.get(
            base_url + "/metrics",
            timeout=aiohttp.ClientTimeout(total=_SCRAPE_TIMEOUT_S),
            allow_redirects=False,
        ) as response:
            if response.status != 200:
                return None
            return await response.text()
    except (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError, UnicodeDecodeError):
        return None


def _preemption_delta(before: str | None, after: str | None) -> float | None:
    # A counter that is absent before the run but present after it started at 0
    # (labelled counters appear on first use); one that fell was reset by a restart.
    if before is None or after is None:
        return None
    end = preemptions_in(after)
    if end is None:
        return None
    start = preemptions_in(before) or 0.0
    return end - start if end >= start else end


@dataclass
class _CacheSampler:
    """Samples the engine's KV usage and queue while the run lasts."""

    usage: list[float] = field(default_factory=list)
    waiting: list[float] = field(default_factory=list)

    async def run(self, session: aiohttp.ClientSession, base_url: str) -> None:
        while True:
            text = await _scrape(session, base_url)
            if text is not None:
                reading = engine_reading(text)
                usage = reading.kv_cache_usage_ratio if reading else None
                waiting = reading.requests_waiting if reading else None
                if usage is not None:
                    self.usage.append(usage)
                if waiting is not None:
                    self.waiting.append(waiting)
            await asyncio.sleep(_SAMPLE_INTERVAL_S)


async def _show_progress(run: _Run) -> None:
    while True:
        sys.stderr.write("\r" + run.progress_line() + "  ")
        sys.stderr.flush()
        await asyncio.sleep(_PROGRESS_INTERVAL_S)


async def run_load(config: LoadConfig, *, stop: asyncio.Event | None = None) -> LoadReport:
    """Drive ``config.url`` with ``config.pattern`` and report what came back.

    Bounded: sending stops at ``duration_s`` or ``max_requests``; in-flight requests
    then have until the deadline plus ``grace_s`` before they are cancelled and
    counted as unfinished (not failed: the run cut them off, the server did not).
    Raises :class:`InvalidInputError` when
    no model is given and the server does not list one. A progress line is drawn
    on stderr when it is a terminal. Setting ``stop`` (Ctrl-C) ends the run at once:
    what is in flight is cancelled and counted unfinished, and the report covers
    what was sent.
    """
    # Idle connections dropped before the server's keep-alive timer could close one
    # under a new POST (kvguard.http_client): that request would be lost, not refused.
    connector = aiohttp.TCPConnector(
        limit=config.concurrency, keepalive_timeout=DEFAULT_KEEPALIVE_S
    )
    # Scrapes get their own session: a saturated request pool must not starve the
    # KV sampler exactly when the cache is fullest.
    async with (
        aiohttp.ClientSession() as monitor,
        aiohttp.ClientSession(connector=connector) as session,
    ):
        model, limit = config.model, None
        if model is None:
            model, limit = await _first_model(monitor, config.base_url)
        if limit is not None:
            # Never plan requests the server will refuse; chat templates add a few tokens.
            room = limit - (_CHAT_TEMPLATE_TOKENS if config.endpoint == "chat" else 0)
            config = replace(config, max_context=max(2, min(config.max_context, room)))
        specs = generate(config.pattern, seed=config.seed, params=config.traffic())
        before = await _scrape(monitor, config.base_url)
        run = _Run(config, session, model)
        progress = asyncio.ensure_future(_show_progress(run)) if sys.stderr.isatty() else None
        sampler = _CacheSampler()
        sampling = asyncio.ensure_future(sampler.run(monitor, config.base_url))
        try:
            dispatching = asyncio.ensure_future(run.dispatch(specs))
            waiters: set[asyncio.Future[Any]] = {dispatching}
            if stop is not None:
                waiters.add(asyncio.ensure_future(stop.wait()))
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            for waiter in waiters - {dispatching}:
                waiter.cancel()
            if stop is not None and stop.is_set():
                dispatching.cancel()
                await asyncio.gather(dispatching, return_exceptions=True)
            else:
                await dispatching
                await run.drain()
        finally:
            sampling.cancel()
            await asyncio.gather(sampling, return_exceptions=True)
            await run.cancel_all()
            if progress is not None:
                progress.cancel()
                await asyncio.gather(progress, return_exceptions=True)
                sys.stderr.write("\r" + run.progress_line() + "  \n")
        duration_s = run.loop.time() - run.start
        after = await _scrape(monitor, config.base_url)
    report = run.report(_preemption_delta(before, after), duration_s)
    return replace(
        report,
        kv_usage_peak=max(sampler.usage, default=None),
        kv_usage_mean=sum(sampler.usage) / len(sampler.usage) if sampler.usage else None,
        waiting_peak=max(sampler.waiting, default=None),
    )
