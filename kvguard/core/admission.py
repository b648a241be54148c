"""Admission arithmetic: from numbers, whether a generation request fits, waits or is refused.

The admission proxy (:mod:`kvguard.actuators.proxy`) asks these questions of every
generation request; the answers depend only on token counts, the engine's pool, the
caps in force and the ``[proxy]`` settings. Waiting, counting, logging and the HTTP
answers stay in the proxy: here nothing is awaited and no clock is read, so every
rule can be tested with plain numbers.

Terms: a request's *projection* is its prompt plus the answer reserved for it
(:func:`reserved_answer`: what answers of its kind really use, or ``max_tokens``),
summed over its sequences (:func:`sequence_totals`), in whole KV blocks; *in flight*
is what the requests the engine has now are reserved at together — the sum of their
projections, or a quantile of their total where their expected lengths are known
(:func:`pooled_reservation`), never less than what the engine says it holds
(:func:`in_flight_tokens`); or, where less, the most they will hold at once step by
step (:class:`Envelope`); the *pool* is the engine's usable KV cache in tokens,
``None`` while unknown.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal

# Requests of a shed class held for room, at most: this many pools' worth (projected).
# One pool's worth sheds bursts the engine would have served within shed_wait_s; four
# kept the simulator's bursty_short goodput within 5% of holding without a bound.
HELD_POOLS = 4
UNKNOWN_MAX_TOKENS = 512  # projection of a request that sets no max_tokens

WindowRefusal = Literal["prompt_over_window", "no_room_for_completion"]


@dataclass(frozen=True)
class WindowOutcome:
    """What the window caps in force make of one request.

    ``refusal`` names why it must be refused (400), or is None; otherwise
    ``max_tokens`` is what to forward, and ``clamped`` says it is lower than (or,
    when the client set none, in place of) what the client asked.
    """

    refusal: WindowRefusal | None
    max_tokens: int | None
    clamped: bool = False


@dataclass(frozen=True)
class AdmissionTerms:
    """How much of the pool a request may fill under projected admission, and how long it waits."""

    ratio: float
    wait_s: float


def caps_for(priority: str, window: tuple[int | None, int | None]) -> tuple[int | None, int | None]:
    """The (prompt, completion) caps that apply to a request of ``priority``.

    Critical requests are never refused for their size: a refusal loses them as
    surely as a shed would, and critical traffic is never shed.
    """
    return (None, None) if priority == "critical" else window


def needs_exact_count(
    prompt_cap: int | None,
    completion_cap: int | None,
    *,
    shed_class: bool,
    admission_refuses: bool = False,
) -> bool:
    """Whether the prompt's exact count decides something now, so it is worth waiting for.

    A window cap and a hold for room (the request's class is shed) compare the prompt
    against a limit, and so does admission when the estimate would refuse it
    (``admission_refuses``: the estimate errs high, so one that fits with it fits);
    otherwise an estimate serves until the engine's count comes (asking it was most
    of the latency the proxy added).
    """
    return prompt_cap is not None or completion_cap is not None or shed_class or admission_refuses


def apply_window(
    prompt: int,
    max_tokens: int | None,
    prompt_cap: int | None,
    completion_cap: int | None,
    min_completion_tokens: int,
) -> WindowOutcome:
    """Check a request of ``prompt`` tokens asking ``max_tokens`` against the window caps.

    A prompt over ``prompt_cap`` is refused. Under ``completion_cap`` the room for the
    answer is the cap less the prompt when a prompt cap is in force too (the two
    caps then stand for one context window), else the whole cap; less room than
    ``min_completion_tokens`` is refused, and a ``max_tokens`` over the room (or
    none) is clamped to it.
    """
    if prompt_cap is not None and prompt > prompt_cap:
        return WindowOutcome("prompt_over_window", max_tokens)
    if completion_cap is None:
        return WindowOutcome(None, max_tokens)
    room = max(completion_cap - prompt, 0) if prompt_cap is not None else completion_cap
    if room < min_completion_tokens:
        return WindowOutcome("no_room_for_completion", max_tokens)
    if max_tokens is None or max_tokens > room:
        return WindowOutcome(None, room, clamped=True)
    return WindowOutcome(None, max_tokens)


def sequence_totals(
    prompt_tokens: Sequence[int], samples: int, max_tokens: int | None
) -> tuple[int, int | None]:
    """The (prompt, max_tokens) a request of several sequences holds in all.

    A request runs ``samples`` sequences for each of its prompts (``n``, ``best_of``;
    a batch of prompts): each sequence holds its prompt and its own answer, so the
    sums are what the request projects. A prompt shared by its samples is counted
    once per sample, as an engine without prefix caching holds it. A single sequence
    keeps an unknown ``max_tokens`` unknown (the caller assumes ``UNKNOWN_MAX_TOKENS``);
    several assume it for each one.
    """
    sequences = max(len(prompt_tokens), 1) * samples
    prompt = sum(prompt_tokens) * samples
    if max_tokens is None:
        return prompt, None if sequences == 1 else UNKNOWN_MAX_TOKENS * sequences
    return prompt, max_tokens * sequences


def reserved_answer(
    max_tokens: int | None, learned: int | None, context_room: int | None
) -> tuple[int, str]:
    """Tokens to reserve for one sequence's answer, and where the figure comes from.

    The ceiling is what the sequence may really write: ``max_tokens``, never more than
    the room left in the engine's context (``context_room``, when known), else that
    room, else ``UNKNOWN_MAX_TOKENS``.
    Under it, the ``learned`` length (a high quantile of recent answers of this kind
    of request) when there is one; without one, the ceiling itself (the
    conservative prior). ``UNKNOWN_MAX_TOKENS`` is a guess, not a limit: with nothing
    else known, a learned length over it is reserved in full. Returns ``(tokens,
    source)``, source one of ``observed``, ``max_tokens``, ``context`` or ``default``.
    """
    if max_tokens is not None and (context_room is None or max_tokens <= context_room):
        ceiling, source = max_tokens, "max_tokens"
    elif context_room is not None:
        ceiling, source = max(context_room, 0), "context"
    elif learned is not None:
        return max(learned, 1), "observed"  # 512 is a guess, not a limit: what was seen
    else:
        ceiling, source = UNKNOWN_MAX_TOKENS, "default"
    if learned is not None and learned < ceiling:
        return max(learned, 1), "observed"
    return ceiling, source


def pooled_reservation(
    each_at_quantile: int, expected: int, variance: float, quantile: float
) -> int:
    """What a set of answers is reserved at together: a ``quantile`` of their total.

    Reserving every answer at a high quantile of its own length reserves the set at
    far more than that quantile of the set's total: answers do not all run long at
    once, and where a route serves both short and long answers the quantile is a
    long one's, so each short answer would hold a long one's room (the pool then
    sits mostly idle while requests are shed). The set's total is the sum of
    independent lengths, so it is reserved at their ``expected`` sum plus ``z``
    standard deviations of it (``variance`` summed; ``z`` the normal quantile of
    ``quantile``: 1.64 for 0.95). The margin grows with the square root of the
    number of answers, not with their number. Never more than
    ``each_at_quantile``, the sum of each answer at its own quantile: pooling only
    ever gives room back, and at ``quantile`` 1 nothing is pooled.
    """
    if quantile >= 1.0:
        return each_at_quantile
    margin = NormalDist().inv_cdf(quantile) * math.sqrt(max(variance, 0.0))
    return min(each_at_quantile, expected + math.ceil(max(margin, 0.0)))


def whole_blocks(tokens: int, block_size: int) -> int:
    """``tokens`` rounded up to whole KV blocks of ``block_size`` (engines allocate blocks)."""
    return -(-tokens // block_size) * block_size


def fits_pool(in_flight: int, own: int, pool: int | None, ratio: float) -> bool:
    """Whether ``in_flight`` projections plus ``own`` tokens stay within ``ratio`` of ``pool``.

    An unknown pool has no room to show: False.
    """
    if pool is None:
        return False
    return in_flight + own <= pool * ratio


def may_hold(held_tokens: int, pool: int | None, shed_ratio: float, own: int = 0) -> bool:
    """Whether one more request of a shed class may be held for room rather than shed now.

    Only against a known pool, with holding enabled (``shed_ratio`` above 0), for a
    request whose own projection (``own`` tokens; 0 while not yet known) could fit
    ``shed_ratio`` of the pool at all, and while the projections already held stay
    under ``HELD_POOLS`` times that: a flood of shed requests must not pile up without
    bound (the last one held overshoots it by at most one share), and one request of
    ``n`` = 2^31 sequences must not take the whole bound and get every other one shed
    at once.
    """
    if pool is None or shed_ratio <= 0:
        return False
    share = pool * shed_ratio
    if own > share:
        return False  # it could never fit: holding it only delays its 503
    return held_tokens < share * HELD_POOLS


ADMISSION_MODES = ("observed", "projected", "off")


def admission_enforced(mode: str, *, enforcing: bool, pool: int | None) -> bool:
    """Whether admission checks each request against the pool now.

    With ``admission = "observed"`` (each answer reserved at what answers of its kind
    really use) or ``"projected"`` (reserved at ``max_tokens``), while enforcing (not
    dry-run), and against a known pool.
    """
    return mode in ("observed", "projected") and enforcing and pool is not None


def admission_terms(
    *, critical: bool, admission_ratio: float, admission_wait_s: float, read_timeout_s: float
) -> AdmissionTerms:
    """The share of the pool a request may fill, and how long it may wait for it.

    Critical requests are never shed: they may use the whole pool (not just
    ``admission_ratio``) and wait as long as the engine's own answer may take
    (``read_timeout_s``); the others wait ``admission_wait_s``, then are shed.
    """
    if critical:
        return AdmissionTerms(ratio=1.0, wait_s=read_timeout_s)
    return AdmissionTerms(ratio=admission_ratio, wait_s=admission_wait_s)


def admission_deadline(
    arrived: float, queue_since: float, wait_s: float, overload_wait_s: float
) -> float:
    """When a request that began to wait for room at ``arrived`` stops waiting (is shed).

    ``queue_since`` is when requests began to wait for room without a break (at or
    before ``arrived``: the request is one of them). A queue that has stood longer
    than ``wait_s`` — the longest any request may wait — is not a burst being absorbed
    but overload: room frees slower than requests come, and a request held longer only
    adds its wait to its client's latency before the 503 it would likely get anyway (a
    client or load balancer can retry elsewhere at once). From then on a request waits
    ``overload_wait_s`` at most; before, ``wait_s`` (CoDel's rule as "Fail at Scale"
    applies it to a server's queue: the standing queue, not one request's wait, sets
    the bound). The result is never later than ``arrived + wait_s``.
    """
    standing_from = queue_since + wait_s
    return min(arrived + wait_s, max(arrived, standing_from) + overload_wait_s)


def admits(
    in_flight: int,
    own: int,
    pool: int | None,
    ratio: float,
    *,
    critical: bool,
    with_it: int | None = None,
) -> bool:
    """Whether admission lets a request of ``own`` tokens in now.

    ``with_it`` is what the requests in flight and this one project together when
    that is less than ``in_flight + own`` (their peak step by step: :class:`Envelope`).
    An unknown pool admits (the pool may become unknown while a request waits: the
    engine went away). A critical request larger than the whole pool would never
    fit: it goes in once nothing else is in flight, as the engine would take it alone.
    """
    if pool is None:
        return True
    if critical and not in_flight:
        return True
    if with_it is not None:
        return with_it <= pool * ratio
    return fits_pool(in_flight, own, pool, ratio)


@dataclass(frozen=True)
class Growth:
    """How one request's hold on the pool grows, engine step by engine step, until it ends.

    A continuous-batching engine writes one token of every running sequence per step,
    and frees all a request holds when it ends.
    """

    held: int  # tokens it holds now (each sequence's last block counted whole)
    per_step: int  # tokens it adds per step: one per sequence being written
    steps: int  # steps until it has written its whole reservation


def growth(held: int, final: int, sequences: int, block_size: int) -> Growth:
    """The :class:`Growth` of a request holding ``held`` tokens that may reach ``final``.

    ``final`` is its projection (prompt + the answer reserved, every sequence).
    """
    per_step = max(sequences, 1)
    steps = max(-(-(final - held) // per_step), 0)
    # Engines allocate whole blocks: each sequence's last one may be mostly empty.
    return Growth(held + (block_size - 1) * per_step, per_step, steps)


class Envelope:
    """The most a set of requests will hold at once from now on, each writing its reservation.

    Summing every request's projection reserves as if all of them reached their end
    at the same moment. They do not: a request that ends frees all it holds, and one
    that has just begun holds only its prompt. Step by step, each holds what it
    holds now plus a token per sequence per step, until it has written its whole
    reservation and ends; the set holds the sum, which rises between two ends and
    drops at each: its peak is just before one of them. A request that ends sooner
    than its reservation only lowers every later step, so the peak is a bound for
    any lengths within the reservations. Where answers of similar lengths start
    apart (decode-heavy traffic) it is near half their projections' sum; where all
    start together, the sum. Requests that wait in the engine's queue write later
    than assumed: the error is their delay in steps times the tokens a step adds.
    """

    def __init__(self, growths: Iterable[Growth]) -> None:
        items = sorted(growths, key=lambda g: g.steps)
        self._steps = [g.steps for g in items]
        count = len(items)
        held = [0] * (count + 1)  # from k on: of those ending at or after steps[k]
        rate = [0] * (count + 1)
        for k in range(count - 1, -1, -1):
            held[k] = held[k + 1] + items[k].held
            rate[k] = rate[k + 1] + items[k].per_step
        self._held, self._rate = held, rate
        # What the set holds just before the k-th (by steps) ends.
        self._at = [held[k] + self._steps[k] * rate[k] for k in range(count)]
        # For a newcomer of one sequence: the most of at[k] + steps[k] over k < i.
        self._best_one = [0] * (count + 1)
        for k in range(count):
            self._best_one[k + 1] = max(self._best_one[k], self._at[k] + self._steps[k])
        # The most of at[k] over k >= i: the set's peaks after a newcomer has ended.
        self._best_after = [0] * (count + 1)
        for k in range(count - 1, -1, -1):
            self._best_after[k] = max(self._best_after[k + 1], self._at[k])
        self.peak = self._best_after[0]

    def __len__(self) -> int:
        """Requests in the set."""
        return len(self._steps)

    def peak_with(self, newcomer: Growth) -> int:
        """The set's peak with ``newcomer`` in it too (at the same step count from now)."""
        steps = newcomer.steps
        before = bisect_right(self._steps, steps)  # those ending no later than it; then later
        if not before:
            best = 0
        elif newcomer.per_step == 1:
            best = self._best_one[before] + newcomer.held
        else:
            best = newcomer.held + max(
                self._at[k] + newcomer.per_step * self._steps[k] for k in range(before)
            )
        later = bisect_left(self._steps, steps)  # those still running at its last step
        last = (
            self._held[later]
            + steps * self._rate[later]
            + newcomer.held
            + newcomer.per_step * steps
        )
        return max(best, last, self._best_after[before])


def in_flight_tokens(reserved: int, engine_used: int | None) -> int:
    """What the pool holds and has promised: the proxy's reservations, or the engine's count.

    The engine's own count of KV tokens in use (read every tick) is the floor: it
    sees traffic that bypasses the proxy and answers longer than their reservation,
    so an under-estimate is corrected within one tick. Reservations are given back
    the moment each answer ends, which the proxy sees before the engine's next
    reading.
    """
    return reserved if engine_used is None else max(reserved, engine_used)


KV_EXHAUSTION_SETTINGS = ("auto", "preempt", "fail")
KvExhaustion = Literal["preempt", "fail"]


def kv_exhaustion(
    setting: str, kind: str | None, reports_preemptions: bool
) -> tuple[KvExhaustion, str]:
    """What the engine does when its KV pool runs out, and why kvguard believes so.

    ``setting`` is ``[engine] on_kv_exhaustion``: ``preempt`` or ``fail`` as the
    operator says; ``auto`` reads the engine. SGLang retracts requests (its
    retraction counter appears only with the first one); vLLM preempts and says so in
    ``vllm:num_preemptions`` (``reports_preemptions``; an engine that shows vLLM's
    names without that counter cannot be taken to preempt). Every other engine, and
    an engine not read yet, is taken to fail: llama.cpp fails the request that finds
    no room, and what an unknown engine does is unknown — the safe side is to cancel
    before the pool runs out. Returns ``(mode, reason)``.
    """
    if setting == "preempt":
        return "preempt", "[engine] on_kv_exhaustion"
    if setting == "fail":
        return "fail", "[engine] on_kv_exhaustion"
    if kind == "sglang":
        return "preempt", "SGLang retracts a request whose next block is not there"
    if kind == "vllm" and reports_preemptions:
        return "preempt", "vLLM preempts a request whose next block is not there"
    if kind is None:
        return "fail", "the engine's kind is not known yet"
    return "fail", f"{kind} is not known to preempt (auto)"


# How many of kvguard's shortest poll intervals the pool must last before an overrun
# cancel waits for the next reading: that reading, and one more, because it can come
# late (a slow scrape, a loaded host: the tick is late exactly when the engine is
# busiest) and a cancel frees the engine's blocks only once it has aborted the request.
OVERRUN_READINGS_AHEAD = 2


def overrun_cancels(
    used: int, growth: float, pool: int | None, footprints: Sequence[int], running: int
) -> int:
    """How many answers to cancel so the pool lasts until kvguard can act again.

    ``used`` is what the engine says it holds now and ``growth`` what the answers
    will write before kvguard can act again (:data:`OVERRUN_READINGS_AHEAD` readings);
    ``footprints`` are the candidates' holdings in the order they would go and
    ``running`` the sequences being written (each cancelled one takes its share of
    the growth with it). 0 while what the engine holds and adds stays within the
    pool; past it an engine that preempts would have to preempt, one that allocates
    per sequence would crash. An unknown pool cancels nothing.
    """
    if pool is None:
        return 0
    share = growth / running if running > 0 else 0.0
    cancels = 0
    while used + growth > pool and cancels < len(footprints):
        used -= footprints[cancels]
        growth = max(growth - share, 0.0)
        cancels += 1
    return cancels


def pool_lasts(
    used: int,
    growth: float,
    pool: int | None,
    footprints: Sequence[int],
    running: int,
    *,
    cancels: int,
) -> bool:
    """Whether the pool lasts until kvguard can act again once the first ``cancels`` go.

    The same reckoning as :func:`overrun_cancels`: False where even cutting every
    candidate would not be enough (what fills the pool is not theirs).
    """
    if pool is None:
        return True
    share = growth / running if running > 0 else 0.0
    for footprint in footprints[:cancels]:
        used -= footprint
        growth = max(growth - share, 0.0)
    return used + growth <= pool


# Intervals the steps ahead are cut into for the spread bound: finer costs more per
# check (it is computed only when the cheaper bounds refuse), coarser counts more
# growth within each interval than there is.
SPREAD_INTERVALS = 32


def step_grid(horizon: int, intervals: int = SPREAD_INTERVALS) -> list[int]:
    """Steps from 0 to ``horizon`` cutting it into at most ``intervals`` intervals."""
    horizon = max(horizon, 1)
    cuts = min(intervals, horizon)
    return [horizon * j // cuts for j in range(cuts + 1)]


def spread_terms(
    g: Growth, grid: Sequence[int], chances: Sequence[float] | None
) -> tuple[list[float], list[float]]:
    """One request's (sizes, chances) per interval of ``grid`` for :class:`SpreadProfile`.

    Within an interval it holds at most what it holds at the interval's end (it
    grows, up to ``g.steps``), and only while still being written: ``chances[j]`` is
    the chance it still is at the interval's start (the chance falls, so that is the
    most of it). Without ``chances`` it is written to its end for sure.
    """
    sizes, odds = [], []
    for j in range(len(grid) - 1):
        sizes.append(float(g.held + g.per_step * min(grid[j + 1], g.steps)))
        if chances is None:
            odds.append(1.0 if grid[j] <= g.steps else 0.0)
        else:
            odds.append(chances[j] if grid[j] <= g.steps else 0.0)
    return sizes, odds


class SpreadProfile:
    """A high quantile of what a set of requests will hold, interval by interval ahead.

    Where answers' lengths are known as a distribution (not only a quantile each),
    each request's hold at a step is its size then if it is still being written, else
    nothing: a sum of independent terms, so the set's hold at each step is bounded by
    its mean plus ``z`` standard deviations (as :func:`pooled_reservation` bounds the
    total, but in time: answers that will likely have ended free their room). The
    peak over the intervals is the bound. Requests whose end is certain (nothing
    learned) count in full until it.
    """

    def __init__(
        self, grid: Sequence[int], terms: Iterable[tuple[list[float], list[float]]], z: float
    ) -> None:
        self.grid = list(grid)
        count = len(self.grid) - 1
        self._mean = [0.0] * count
        self._var = [0.0] * count
        self.z = z
        for sizes, odds in terms:
            for j in range(count):
                size, p = sizes[j], odds[j]
                if p > 0.0:
                    self._mean[j] += size * p
                    self._var[j] += size * size * p * (1.0 - p)

    def peak_with(self, sizes: Sequence[float] = (), odds: Sequence[float] = ()) -> int:
        """The bound's peak with one more request's terms (none: the set's own)."""
        best = 0.0
        for j in range(len(self._mean)):
            mean, var = self._mean[j], self._var[j]
            if sizes:
                size, p = sizes[j], odds[j]
                mean += size * p
                var += size * size * p * (1.0 - p)
            best = max(best, mean + self.z * math.sqrt(max(var, 0.0)))
        return math.ceil(best)
