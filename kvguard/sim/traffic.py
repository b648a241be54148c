"""Traffic patterns: deterministic streams of request specs drawn from a seed.

Pure: no I/O, no clock, no event loop. A pattern is a generator of
:class:`RequestSpec` ordered by arrival offset; the load generator
(:mod:`kvguard.sim.loadgen`) turns specs into HTTP requests. The patterns are the
traffic shapes that stress different limits at the same token throughput
(docs/how-it-works.md, "What goes wrong"), so the guard's pattern detection and
ladder can be exercised one shape at a time.

Every size is in tokens and multiplied by ``scale`` (so a test can aim the same
shape at a tiny KV pool), then capped so that ``prompt_tokens + output_tokens``
never exceeds ``max_context``. Only ``random.Random(seed)`` is used: the same seed and
parameters give the same specs, on any machine.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvguard.errors import InvalidInputError

PRIORITIES: tuple[str, ...] = ("critical", "standard", "sheddable")
DEFAULT_MAX_CONTEXT = 8192

PATTERNS: Mapping[str, str] = MappingProxyType(
    {
        "steady": "Poisson arrivals at a fixed rate, moderate prompts and answers",
        "bursty_short": "thousands of short requests arriving in bursts separated by quiet gaps",
        "long_context": (
            "a few conversations growing turn by turn toward max context, then restarting"
        ),
        "prefill_heavy": "long prompts (2k-8k tokens), short answers",
        "decode_heavy": "short prompts, long generations (500-2000 tokens)",
        "ramp": "request rate rising linearly over the duration until something gives",
        "mixed": "a seeded blend of steady, bursty, long-context, prefill- and decode-heavy",
    }
)


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: when, how big, and for whom.

    ``at_s`` is the offset from the start of the run. For a conversation turn it is
    the earliest send time: the turn also waits for the previous turn to complete.
    ``prompt_tokens`` is the planned prompt; a later turn's prompt is the previous
    prompt, plus the previous answer (planned at its ``output_tokens``), plus a new
    user message. ``output_tokens`` is the answer's TRUE length: where the model
    would stop on its own. A real client does not know it and asks for more
    (``max_tokens``); the load generator decides what to ask and how the engine
    learns the true length (:mod:`kvguard.sim.loadgen`). ``conversation`` is None
    for a one-shot request; ``turn`` counts from 0 and returns to 0 when a
    conversation restarts.
    """

    at_s: float
    prompt_tokens: int
    output_tokens: int
    priority: str
    conversation: int | None = None
    turn: int = 0


@dataclass(frozen=True)
class PriorityShares:
    """Shares of the priority classes; normalized when drawing, so they need not sum to 1."""

    critical: float = 0.1
    standard: float = 0.6
    sheddable: float = 0.3

    def __post_init__(self) -> None:
        for name in PRIORITIES:
            share = getattr(self, name)
            if not math.isfinite(share) or share < 0:
                raise InvalidInputError(name, share, "a priority share must be a number >= 0")
        if self.total() <= 0:
            raise InvalidInputError(
                "priority_shares", self.as_dict(), "the priority shares must sum to more than 0"
            )

    def total(self) -> float:
        """Sum of the three shares."""
        return self.critical + self.standard + self.sheddable

    def as_dict(self) -> dict[str, float]:
        """The shares by class name."""
        return {name: float(getattr(self, name)) for name in PRIORITIES}

    def draw(self, rng: random.Random) -> str:
        """One priority class, drawn with probability proportional to its share."""
        point = rng.random() * self.total()
        for name in PRIORITIES:
            point -= getattr(self, name)
            if point < 0:
                return name
        # Floating-point rounding can leave `point` a hair above zero at the end.
        return next(n for n in reversed(PRIORITIES) if getattr(self, n) > 0)


@dataclass(frozen=True)
class TrafficParams:
    """What every pattern shares: its time span, size scale, context cap and priority mix.

    ``duration_s`` bounds the arrival offsets (every spec has ``at_s < duration_s``),
    ``scale`` multiplies every token size (a size never drops below 1 token), and
    ``max_context`` caps ``prompt_tokens + output_tokens`` of every request.
    """

    duration_s: float = 60.0
    scale: float = 1.0
    max_context: int = DEFAULT_MAX_CONTEXT
    shares: PriorityShares = field(default_factory=PriorityShares)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise InvalidInputError(
                "duration_s", self.duration_s, "must be a number of seconds > 0"
            )
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise InvalidInputError("scale", self.scale, "must be a number > 0")
        if self.max_context < 2:
            raise InvalidInputError(
                "max_context", self.max_context, "must be >= 2 tokens (a prompt and an answer)"
            )

    def tokens(self, rng: random.Random, low: int, high: int) -> int:
        """A uniform size in ``[low, high]`` tokens at scale 1, scaled, at least 1."""
        return self.scaled(rng.randint(low, high))

    def scaled(self, tokens: int) -> int:
        """``tokens`` times ``scale``, rounded, at least 1 (a recorded 0 still costs a token)."""
        return max(1, round(tokens * self.scale))

    def one_shot(self, rng: random.Random, at_s: float, prompt: int, answer: int) -> RequestSpec:
        """A request outside any conversation, capped to the context limit.

        ``answer`` is the true output length; the priority class is drawn from ``rng``.
        """
        prompt, answer = cap_to_context(prompt, answer, self.max_context)
        return RequestSpec(at_s, prompt, answer, self.shares.draw(rng))


def cap_to_context(prompt: int, answer: int, max_context: int) -> tuple[int, int]:
    """``(prompt, answer)`` cut so their sum fits ``max_context``; the prompt gives way first."""
    # The answer is kept whole where it fits because it is what distinguishes a
    # decode-heavy request; the prompt gives way first.
    answer = min(answer, max_context - 1)
    return min(prompt, max_context - answer), answer


def _fork(rng: random.Random) -> random.Random:
    """A generator seeded from ``rng``: a sub-stream whose draws do not disturb its siblings."""
    return random.Random(rng.getrandbits(64))


def _poisson_times(rng: random.Random, rate_per_s: float, duration_s: float) -> Iterator[float]:
    t = rng.expovariate(rate_per_s)
    while t < duration_s:
        yield t
        t += rng.expovariate(rate_per_s)


def steady(
    rng: random.Random, params: TrafficParams, *, rate_per_s: float = 4.0
) -> Iterator[RequestSpec]:
    """Poisson arrivals at ``rate_per_s`` (default 4/s) of moderate requests.

    Prompts 200-1000 tokens, answers 50-300 tokens (before ``scale``).
    """
    for t in _poisson_times(rng, rate_per_s, params.duration_s):
        yield params.one_shot(rng, t, params.tokens(rng, 200, 1000), params.tokens(rng, 50, 300))


def bursty_short(
    rng: random.Random,
    params: TrafficParams,
    *,
    burst_min: int = 100,
    burst_max: int = 300,
    mean_gap_s: float = 3.0,
    spread_s: float = 0.05,
) -> Iterator[RequestSpec]:
    """Bursts of ``burst_min``-``burst_max`` short requests, separated by quiet gaps.

    The first burst starts at 0; the quiet gaps between bursts are 0.5 to 1.5 times
    ``mean_gap_s`` (default 3 s), and a burst's requests arrive within ``spread_s``
    (default 0.05 s), effectively at once. Prompts 50-300 tokens, answers 20-100 tokens
    (before ``scale``). At the defaults a minute holds thousands of requests.
    """
    start = 0.0
    while start < params.duration_s:
        offsets = sorted(rng.uniform(0, spread_s) for _ in range(rng.randint(burst_min, burst_max)))
        for offset in offsets:
            if start + offset >= params.duration_s:
                return
            prompt, answer = params.tokens(rng, 50, 300), params.tokens(rng, 20, 100)
            yield params.one_shot(rng, start + offset, prompt, answer)
        # A floor under the gap keeps bursts apart: the quiet is what makes them bursts.
        start += spread_s + mean_gap_s * rng.uniform(0.5, 1.5)


def long_context(
    rng: random.Random,
    params: TrafficParams,
    *,
    conversations: int | None = None,
    think_min_s: float = 0.5,
    think_max_s: float = 3.0,
    first_conversation: int = 0,
) -> Iterator[RequestSpec]:
    """A few conversations that grow turn by turn toward ``max_context``.

    ``conversations`` run side by side (default: 4 to 8, drawn from the seed), each
    starting within the first 2 s. A turn's prompt is the previous prompt plus the
    previous answer plus a new user message; the first message is 500-2000 tokens
    (a system prompt and a document), later ones 50-400, answers 100-500 (before
    ``scale``). Turns are ``think_min_s``-``think_max_s`` apart at the earliest.
    When the next turn would not fit in ``max_context`` the conversation restarts
    at turn 0 with the same number and a priority drawn afresh. Conversation
    numbers start at ``first_conversation``.
    """
    count = conversations if conversations is not None else rng.randint(4, 8)
    # Each conversation draws from its own generator, so the merge order cannot
    # change what any one conversation looks like.
    streams = [
        _conversation(_fork(rng), params, first_conversation + n, (think_min_s, think_max_s))
        for n in range(count)
    ]
    yield from heapq.merge(*streams, key=lambda spec: spec.at_s)


def _conversation(
    rng: random.Random, params: TrafficParams, number: int, think_s: tuple[float, float]
) -> Iterator[RequestSpec]:
    t = rng.uniform(0, min(2.0, params.duration_s))
    turn, prompt, answer = 0, 0, 0
    priority = params.shares.draw(rng)
    while t < params.duration_s:
        message = params.tokens(rng, 500, 2000) if turn == 0 else params.tokens(rng, 50, 400)
        next_answer = params.tokens(rng, 100, 500)
        grown = prompt + answer + message
        if turn > 0 and grown + 1 > params.max_context:
            turn, prompt, answer = 0, 0, 0
            priority = params.shares.draw(rng)
            continue
        if turn == 0:
            grown, next_answer = cap_to_context(grown, next_answer, params.max_context)
        else:
            next_answer = min(next_answer, params.max_context - grown)
        yield RequestSpec(t, grown, next_answer, priority, number, turn)
        turn, prompt, answer = turn + 1, grown, next_answer
        t += rng.uniform(*think_s)


def prefill_heavy(
    rng: random.Random, params: TrafficParams, *, rate_per_s: float = 2.0
) -> Iterator[RequestSpec]:
    """Poisson arrivals at ``rate_per_s`` (default 2/s) of long prompts with short answers.

    Prompts 2000-8000 tokens, answers 16-128 tokens (before ``scale``).
    """
    for t in _poisson_times(rng, rate_per_s, params.duration_s):
        yield params.one_shot(rng, t, params.tokens(rng, 2000, 8000), params.tokens(rng, 16, 128))


def decode_heavy(
    rng: random.Random, params: TrafficParams, *, rate_per_s: float = 2.0
) -> Iterator[RequestSpec]:
    """Poisson arrivals at ``rate_per_s`` (default 2/s) of short prompts with long answers.

    Prompts 20-200 tokens, answers 500-2000 tokens (before ``scale``).
    """
    for t in _poisson_times(rng, rate_per_s, params.duration_s):
        yield params.one_shot(rng, t, params.tokens(rng, 20, 200), params.tokens(rng, 500, 2000))


def ramp(
    rng: random.Random,
    params: TrafficParams,
    *,
    start_rate_per_s: float = 1.0,
    end_rate_per_s: float = 50.0,
) -> Iterator[RequestSpec]:
    """Arrivals whose rate rises linearly from ``start_rate_per_s`` to ``end_rate_per_s``.

    A Poisson process with rate ``r(t) = start + (end - start) * t / duration``
    (defaults 1/s to 50/s), sampled exactly by inverting its integrated rate, so the
    load keeps rising until the server gives. Sizes as ``steady``.
    """
    r0, slope = start_rate_per_s, (end_rate_per_s - start_rate_per_s) / params.duration_s
    t = 0.0
    while True:
        # Solve r0*dt + slope*(t*dt + dt^2/2) = E for the next gap dt (E ~ Exp(1)).
        target = rng.expovariate(1.0)
        rate_now = r0 + slope * t
        if rate_now <= 0 and slope <= 0:
            return
        if abs(slope) < 1e-12:
            t += target / rate_now
        else:
            disc = rate_now * rate_now + 2 * slope * target
            if disc < 0:  # a falling rate that reaches zero: no more arrivals
                return
            t += (math.sqrt(disc) - rate_now) / slope
        if t >= params.duration_s:
            return
        yield params.one_shot(rng, t, params.tokens(rng, 200, 1000), params.tokens(rng, 50, 300))


def mixed(rng: random.Random, params: TrafficParams) -> Iterator[RequestSpec]:
    """A seeded blend: steady, bursty, long-context, prefill- and decode-heavy at once.

    Each part runs at a fraction of its own default rate, the fraction drawn from
    the seed (0.25-0.75 of steady, 0.5-1.5/s prefill- and decode-heavy, bursts of
    20-80 about every 5 s, 2-3 conversations), and the parts' specs are merged by
    arrival time.
    """
    parts = [
        steady(_fork(rng), params, rate_per_s=4.0 * rng.uniform(0.25, 0.75)),
        bursty_short(_fork(rng), params, burst_min=20, burst_max=80, mean_gap_s=5.0),
        long_context(_fork(rng), params, conversations=rng.randint(2, 3)),
        prefill_heavy(_fork(rng), params, rate_per_s=rng.uniform(0.5, 1.5)),
        decode_heavy(_fork(rng), params, rate_per_s=rng.uniform(0.5, 1.5)),
    ]
    yield from heapq.merge(*parts, key=lambda spec: spec.at_s)


_GENERATORS: Mapping[str, Callable[[random.Random, TrafficParams], Iterator[RequestSpec]]] = {
    "steady": steady,
    "bursty_short": bursty_short,
    "long_context": long_context,
    "prefill_heavy": prefill_heavy,
    "decode_heavy": decode_heavy,
    "ramp": ramp,
    "mixed": mixed,
}


def generate(
    pattern: str, *, seed: int, params: TrafficParams | None = None
) -> Iterator[RequestSpec]:
    """The specs of ``pattern`` for ``seed``, ordered by ``at_s``, all before the duration.

    Raises :class:`InvalidInputError` for an unknown pattern name. The stream is
    finite (bounded by ``params.duration_s``) but may be long: take what you need.
    """
    if pattern not in _GENERATORS:
        raise InvalidInputError("pattern", pattern, f"must be one of {', '.join(PATTERNS)}")
    rng = random.Random(seed)
    return _GENERATORS[pattern](rng, params if params is not None else TrafficParams())


def new_message_tokens(spec: RequestSpec, previous: RequestSpec | None) -> int:
    """Tokens of the new user message in a conversation turn (the whole prompt at turn 0).

    ``previous`` is the conversation's previous spec as planned; the rest of the
    prompt is the history (previous prompt and answer).
    """
    if spec.turn == 0 or previous is None:
        return spec.prompt_tokens
    return spec.prompt_tokens - previous.prompt_tokens - previous.output_tokens
