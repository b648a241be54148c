"""The load generator: drives an OpenAI-compatible endpoint with a pattern or a trace.

:func:`run_load` turns request specs (a :mod:`kvguard.sim.traffic` pattern, or a
recorded trace replayed by :mod:`kvguard.sim.trace`) into HTTP requests
(``/v1/completions`` or ``/v1/chat/completions``, streamed by default), open-loop:
each goes out at its offset, and its latencies count from that scheduled time, so
waiting for a client slot or a retry counts. It reads the engine's preemption
counter from ``/metrics`` before and after. It is bounded: it stops sending at
``duration_s`` or ``max_requests``, whichever comes first, gives in-flight requests a
grace period, then cancels them. It only talks to the URL it is given and never
follows redirects. How one request is sent (``max_tokens``, the true length,
retries) is :mod:`kvguard.sim.loadgen_client`.

A prompt of N tokens is N plain lowercase words: the simulator's tokenizer counts
each as one token, and real tokenizers count them as roughly one each.

Sending, timing and bounding requests are one loop whose limits (duration, count,
grace, cancellation) must be read together, so they stay in this module; the single
request, the report and the command live apart (``loadgen_client``,
``loadgen_report``, ``kvguard.cli.loadgen``).
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
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from kvguard.errors import InvalidInputError
from kvguard.http_client import DEFAULT_KEEPALIVE_S
from kvguard.sim.loadgen_client import (
    ENDPOINTS,
    OUTPUT_LENGTHS,
    Attempts,
    Client,
    ClientSettings,
    resolve_output_length,
)
from kvguard.sim.loadgen_report import (
    ClassCounts,
    LoadReport,
    Percentiles,
    RequestOutcome,
    Slo,
    engine_reading,
    preemptions_in,
)
from kvguard.sim.trace import TRACE_HEADERS, Trace, load_trace, replay
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

DEFAULT_CLIENT_MAX_TOKENS = 2048
_SCRAPE_TIMEOUT_S = 5.0
_PROGRESS_INTERVAL_S = 0.5
_SAMPLE_INTERVAL_S = 0.5
_CHAT_TEMPLATE_TOKENS = 32  # role markers a chat template adds around the messages
REAL_TOKENIZER_MARGIN = 0.95  # share of a real engine's context the plans stay within

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
    """What to drive, with which traffic, how the client behaves, and the bounds of the run.

    ``url`` is the server's base URL (``http://host:port``). ``endpoint`` is
    ``completions`` or ``chat``. ``model`` None asks ``GET /v1/models`` and takes
    the first id. ``trace`` (a file) replaces ``pattern``: it is replayed from
    ``start_s`` recorded seconds on, ``speed`` times faster (``trace_format`` None:
    told by the header). ``client_max_tokens`` is the ``max_tokens`` every request
    asks for (None: the request's true length); ``output_length`` is how the engine
    learns the true length (``auto``, ``sim-field`` or ``ignore-eos``). A 429/503
    with ``Retry-After`` is retried up to ``retries`` times, each wait capped at
    ``retry_cap_s``. ``engine_priority`` also sends each request's class as vLLM's
    ``priority`` body field (critical 0, standard 1, sheddable 2), for an engine
    scheduling by priority. ``slo_ttft_s``, ``slo_tpot_s`` and the optional
    ``slo_e2e_s`` define a good request. Values are checked here; a bad one raises
    :class:`InvalidInputError` naming the field.
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
    slo_e2e_s: float | None = None
    request_timeout_s: float = 60.0
    grace_s: float = 5.0
    priority_header: str = "X-Priority"
    model: str | None = None
    slo_tpot_s: float = 0.1
    client_max_tokens: int | None = DEFAULT_CLIENT_MAX_TOKENS
    output_length: str = "auto"
    retries: int = 0
    retry_cap_s: float = 10.0
    trace: str | None = None
    trace_format: str | None = None
    speed: float = 1.0
    start_s: float = 0.0
    engine_priority: bool = False

    def __post_init__(self) -> None:
        check_url(self.url)
        if self.pattern not in PATTERNS:
            raise InvalidInputError(
                "pattern", self.pattern, f"must be one of {', '.join(PATTERNS)}"
            )
        if self.endpoint not in ENDPOINTS:
            raise InvalidInputError("endpoint", self.endpoint, "must be completions or chat")
        for name in ("duration_s", "slo_ttft_s", "slo_tpot_s", "request_timeout_s"):
            _positive(name, getattr(self, name))
        if self.slo_e2e_s is not None:
            _positive("slo_e2e_s", self.slo_e2e_s)
        for name in ("grace_s", "retry_cap_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise InvalidInputError(
                    name, getattr(self, name), "must be a number of seconds >= 0"
                )
        for name in ("max_requests", "concurrency"):
            if getattr(self, name) < 1:
                raise InvalidInputError(name, getattr(self, name), "must be an integer >= 1")
        if self.retries < 0:
            raise InvalidInputError("retries", self.retries, "must be an integer >= 0")
        if self.client_max_tokens is not None and self.client_max_tokens < 1:
            raise InvalidInputError(
                "client_max_tokens", self.client_max_tokens, "must be an integer >= 1, or trace"
            )
        if self.output_length not in OUTPUT_LENGTHS:
            raise InvalidInputError(
                "output_length", self.output_length, f"must be one of {', '.join(OUTPUT_LENGTHS)}"
            )
        if not self.priority_header.strip():
            raise InvalidInputError("priority_header", self.priority_header, "must not be empty")
        if self.model is not None and not self.model.strip():
            raise InvalidInputError("model", self.model, "must not be empty")
        self._check_trace()
        self.traffic()  # scale and max_context are checked where they are used

    def _check_trace(self) -> None:
        if not (math.isfinite(self.speed) and self.speed > 0):
            raise InvalidInputError("speed", self.speed, "must be a number > 0")
        if not (math.isfinite(self.start_s) and self.start_s >= 0):
            raise InvalidInputError("start_s", self.start_s, "must be a number of seconds >= 0")
        if self.trace_format is not None and self.trace_format not in TRACE_HEADERS:
            raise InvalidInputError(
                "trace_format", self.trace_format, f"must be one of {', '.join(TRACE_HEADERS)}"
            )
        if self.trace is None:
            # Silently replaying nothing at a speed would hide a forgotten --trace.
            for name, value, default in (
                ("speed", self.speed, 1.0),
                ("start_s", self.start_s, 0.0),
                ("trace_format", self.trace_format, None),
            ):
                if value != default:
                    raise InvalidInputError(name, value, "applies only when replaying a trace")
        elif not self.trace.strip():
            raise InvalidInputError("trace", self.trace, "must name a trace file")

    @property
    def base_url(self) -> str:
        """The URL without a trailing slash, ready for a path."""
        return self.url.rstrip("/")

    @property
    def label(self) -> str:
        """What the run sends, for the report: the pattern's name, or ``trace``."""
        return "trace" if self.trace is not None else self.pattern

    def traffic(self) -> TrafficParams:
        """The pattern's (or the trace's) parameters for this run."""
        return TrafficParams(self.duration_s, self.scale, self.max_context, self.priority_shares)

    def slo(self) -> Slo:
        """What a good request meets."""
        return Slo(self.slo_ttft_s, self.slo_tpot_s, self.slo_e2e_s)


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


def read_trace(config: LoadConfig) -> Trace | None:
    """The config's trace, read and validated whole (None without one).

    Raises :class:`InvalidInputError` for a malformed file (naming its line) and for
    a ``start_s`` at or past the trace's last arrival (nothing would be replayed).
    """
    if config.trace is None:
        return None
    trace = load_trace(config.trace, config.trace_format)
    if config.start_s > trace.span_s:
        raise InvalidInputError(
            "start_s",
            config.start_s,
            f"must be at most {trace.span_s:g} s, the last arrival of {trace.name}",
        )
    return trace


@dataclass
class _Conversation:
    # (role, text) of the history kept by the client; a failed turn is dropped from it,
    # as a user re-asks, so the history only holds answered turns.
    history: list[tuple[str, str]] = field(default_factory=list)
    last_spec: RequestSpec | None = None
    ended_at: float = -math.inf  # loop time the previous turn's answer ended


class _Run:
    """One run's state: dispatch, in-flight tasks, and what has come back."""

    def __init__(self, config: LoadConfig, client: Client) -> None:
        self.config = config
        self.client = client
        self.loop = asyncio.get_running_loop()
        self.start = self.loop.time()
        self.deadline = self.start + config.duration_s
        self.slots = asyncio.Semaphore(config.concurrency)
        self.tasks: set[asyncio.Task[RequestOutcome | None]] = set()
        self.outcomes: list[RequestOutcome] = []
        self.sent = 0
        self.by_kind: Counter[str] = Counter()
        self._conversations: dict[int, _Conversation] = {}
        self._tails: dict[int, asyncio.Task[RequestOutcome | None]] = {}

    # ------------------------------------------------------------------ dispatch
    async def dispatch(self, specs: Iterator[RequestSpec]) -> None:
        """Send specs at their offsets until the duration or the request budget is spent."""
        for number, spec in enumerate(specs):
            if self.sent >= self.config.max_requests or not await self._wait_until(spec.at_s):
                return
            if spec.conversation is None:
                # Open loop: a request is sent (and counted) when it is due; waiting for a
                # client slot happens in its own task, so a slow server delays no later
                # arrival, and one still waiting when the run ends counts as unfinished
                # instead of vanishing from the report.
                self.sent += 1
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

    def _spawn(
        self, coro: Coroutine[Any, Any, RequestOutcome | None]
    ) -> asyncio.Task[RequestOutcome | None]:
        task: asyncio.Task[RequestOutcome | None] = self.loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _one_shot(self, number: int, spec: RequestSpec) -> RequestOutcome:
        try:
            await self.slots.acquire()
        except asyncio.CancelledError:
            # The run ended while it waited for a connection: the user got nothing.
            outcome = self.client.unfinished(spec)
            self.outcomes.append(outcome)
            self.by_kind[outcome.kind] += 1
            raise
        text = words(f"{self.config.seed}/{number}", spec.prompt_tokens)
        try:
            return await self._send(spec, [("user", text)], self.start + spec.at_s)
        finally:
            self.slots.release()

    async def _turn(
        self,
        number: int,
        spec: RequestSpec,
        conversation: int,
        previous: asyncio.Task[RequestOutcome | None] | None,
    ) -> RequestOutcome | None:
        if previous is not None:
            await asyncio.wait({previous})  # its outcome is recorded by that task itself
        if not await self._take_slot():
            return None
        state = self._conversations.setdefault(conversation, _Conversation())
        # A turn is due at its offset, or when the user has read the previous answer.
        scheduled = max(self.start + spec.at_s, state.ended_at)
        try:
            if spec.turn == 0:
                state.history = []
            tokens = new_message_tokens(spec, state.last_spec)
            state.last_spec = spec
            asked = [*state.history, ("user", words(f"{self.config.seed}/{number}", tokens))]
            outcome = await self._send(spec, asked, scheduled)
            if outcome.completed:
                answer = words(f"{self.config.seed}/{number}/answer", outcome.completion_tokens)
                state.history = [*asked, ("assistant", answer)]
            return outcome
        finally:
            state.ended_at = self.loop.time()
            self.slots.release()

    async def _send(
        self, spec: RequestSpec, messages: list[tuple[str, str]], scheduled: float
    ) -> RequestOutcome:
        # Recorded exactly once, in `finally`: a cancellation (the grace period ran
        # out) leaves the default outcome, and is then re-raised.
        attempts = Attempts()
        outcome = self.client.unfinished(spec)
        try:
            outcome = await self.client.send(
                spec,
                messages,
                scheduled=scheduled,
                give_up_at=self.deadline + self.config.grace_s,
                attempts=attempts,
            )
        finally:
            if outcome.kind == "unfinished":
                outcome = replace(outcome, retries=attempts.retries)
            self.outcomes.append(outcome)
            self.by_kind[outcome.kind] += 1
        return outcome

    # ------------------------------------------------------------------ report
    def report(self, preemptions: float | None, duration_s: float) -> LoadReport:
        """The report over every recorded outcome."""
        config = self.config
        slo = config.slo()
        totals = ClassCounts.of(self.outcomes, slo)
        classes = {
            name: ClassCounts.of([o for o in self.outcomes if o.priority == name], slo)
            for name in PRIORITIES
        }
        done = [o for o in self.outcomes if o.completed]
        return LoadReport(
            pattern=config.label,
            seed=config.seed,
            model=self.client.settings.model,
            duration_s=duration_s,
            sent=totals.sent,
            succeeded=totals.succeeded,
            failed=totals.failed,
            shed=totals.shed,
            unfinished=totals.unfinished,
            by_priority=classes,
            ttft_s=Percentiles.of([o.ttft_s for o in done if o.ttft_s is not None]),
            e2e_s=Percentiles.of([o.e2e_s for o in done if o.e2e_s is not None]),
            prompt_tokens=sum(o.prompt_tokens for o in done),
            completion_tokens=totals.completion_tokens,
            slo_ttft_s=config.slo_ttft_s,
            slo_e2e_s=config.slo_e2e_s,
            goodput=totals.slo_met,
            goodput_ratio=totals.slo_attainment,
            preemptions=preemptions,
            status_counts=dict(Counter(o.status for o in self.outcomes)),
            refused=totals.refused,
            clamped=totals.clamped,
            goodput_tokens=totals.goodput_tokens,
            requested_max_tokens=totals.requested_max_tokens,
            tpot_s=Percentiles.of([t for o in done if (t := o.tpot_s) is not None]),
            ttft_p99_s=totals.ttft_p99_s,
            tpot_p99_s=totals.tpot_p99_s,
            retries=totals.retries,
            slo_tpot_s=config.slo_tpot_s,
            client_max_tokens=(
                "trace" if config.client_max_tokens is None else config.client_max_tokens
            ),
            retries_allowed=config.retries,
            output_length=self.client.settings.output_length,
            trace=None if config.trace is None else Path(config.trace).name,
            speed=config.speed,
            start_s=config.start_s,
        )

    def progress_line(self) -> str:
        """The one-line progress shown on a terminal."""
        elapsed = min(self.loop.time() - self.start, self.config.duration_s)
        return (
            f"loadgen {self.config.label}  {elapsed:.1f}s/{self.config.duration_s:g}s"
            f"  sent {self.sent}  ok {self.by_kind['completed']}  shed {self.by_kind['shed']}"
            f"  failed {self.by_kind['failed']}"
        )


async def _server_card(session: aiohttp.ClientSession, base_url: str) -> Mapping[str, Any]:
    """The first model card the server lists at ``GET /v1/models``."""
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
    except (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError) as exc:
        raise InvalidInputError("url", base_url, f"{allowed}; {type(exc).__name__}") from exc
    except (ValueError, LookupError, TypeError) as exc:
        raise InvalidInputError("url", base_url, f"{allowed}; unexpected answer") from exc
    if not isinstance(card, dict) or "id" not in card:
        raise InvalidInputError("url", base_url, f"{allowed}; a model card without an id")
    return card


def _context_limit(card: Mapping[str, Any] | None) -> int | None:
    limit = None if card is None else card.get("max_model_len")
    return limit if isinstance(limit, int) and limit > 1 else None


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


async def _model_card(
    monitor: aiohttp.ClientSession, config: LoadConfig
) -> Mapping[str, Any] | None:
    """The server's first model card; None when a named model makes it optional and it fails.

    Without ``model`` the card is required (its id is the model). With one, it is
    only asked for ``output_length`` auto, and a server that lists no models is
    taken for a real engine.
    """
    if config.model is None:
        return await _server_card(monitor, config.base_url)
    if config.output_length != "auto":
        return None
    try:
        return await _server_card(monitor, config.base_url)
    except InvalidInputError:
        return None


async def run_load(config: LoadConfig, *, stop: asyncio.Event | None = None) -> LoadReport:
    """Drive ``config.url`` with ``config.pattern`` (or ``config.trace``) and report what came back.

    A trace is read and validated whole before anything is sent. Bounded: sending
    stops at ``duration_s`` or ``max_requests``; in-flight requests then have until
    the deadline plus ``grace_s`` before they are cancelled and counted as
    unfinished (not failed: the run cut them off, the server did not). Raises
    :class:`InvalidInputError` for a malformed trace, and when no model is given and
    the server does not list one. A progress line is drawn on stderr when it is a
    terminal. Setting ``stop`` (Ctrl-C) ends the run at once: what is in flight is
    cancelled and counted unfinished, and the report covers what was sent.
    """
    trace = read_trace(config)
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
        card = await _model_card(monitor, config)
        model = config.model if config.model is not None else str(card["id"] if card else "")
        # A card's limit is the named model's only when it is that model's card.
        limit = _context_limit(card) if card and card.get("id") == model else None
        output_length = resolve_output_length(config.output_length, card)
        if limit is not None:
            # Never plan requests the server will refuse; chat templates add a few tokens.
            room = limit - (_CHAT_TEMPLATE_TOKENS if config.endpoint == "chat" else 0)
            if output_length == "ignore-eos":
                # A real tokenizer reads N plain words as a few percent more than N
                # tokens (3% for Llama's): plan within 95% of its context.
                room = math.floor(room * REAL_TOKENIZER_MARGIN)
            config = replace(config, max_context=max(2, min(config.max_context, room)))
        specs: Iterator[RequestSpec]
        if trace is not None:
            specs = replay(
                trace,
                config.traffic(),
                seed=config.seed,
                speed=config.speed,
                start_s=config.start_s,
            )
        else:
            specs = generate(config.pattern, seed=config.seed, params=config.traffic())
        client = Client(session, _client_settings(config, model, output_length))
        before = await _scrape(monitor, config.base_url)
        run = _Run(config, client)
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


def _client_settings(config: LoadConfig, model: str, output_length: str) -> ClientSettings:
    return ClientSettings(
        base_url=config.base_url,
        endpoint=config.endpoint,
        model=model,
        stream=config.stream,
        priority_header=config.priority_header,
        request_timeout_s=config.request_timeout_s,
        max_context=config.max_context,
        client_max_tokens=config.client_max_tokens,
        output_length=output_length,
        retries=config.retries,
        retry_cap_s=config.retry_cap_s,
        engine_priority=config.engine_priority,
    )
