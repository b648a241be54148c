"""What requests really use: recent answer lengths, learned online, bounded in memory.

Clients ask ``max_tokens`` far over what they use (a chat UI sends 4096 for a 300-token
answer), so reserving the ask for every request leaves most of the KV pool idle, and
reserving nothing lets a burst overfill it. :class:`ObservedLengths` keeps the answer
lengths of recent completions per *kind* of request — model, route and priority —
and answers with a high quantile of them: the reservation an answer of that kind
gets. Until a kind has ``min_samples`` completions of its own, the broader kinds
stand in for it (the model and route over all priorities, then the model, then
everything); with none of them known, there is no estimate and the caller reserves
the ask (the conservative prior).

Completed answers alone are a biased sample: short answers finish first, so early in
a burst the first answers seen are the short ones, while the long ones of the same
kind are still being written. :meth:`ObservedLengths.estimate` therefore also takes
the answers still running, each known to be at least as long as what it has written
so far (right-censored), and reads the quantile off the Kaplan-Meier estimate of the
length distribution. While more than ``1 - quantile`` of the answers may still be
longer than any seen to end, there is no estimate either: the caller reserves the
ask until the long ones end or enough short ones outweigh them.

Every figure is per sequence (a request with ``n`` = 4 holds four answers), and each
kind keeps only its ``window`` most recent lengths; at most ``max_kinds`` kinds are
kept (the least recently seen is forgotten). Nothing here reads a clock or does I/O.

It also learns, per model, how the proxy's byte-based prompt estimate compares with
the engine's count (:meth:`ObservedLengths.prompt_scale`), so a prompt admitted
before the engine counted it is sized close to what it really holds.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

# A kind of request: (model, route, priority). "" stands for "any" in the broader kinds.
Kind = tuple[str, str, str]
PROMPT_RATIO_SCALE = 1000
# The estimate is 3 bytes a token; no tokenizer packs English into 12.
MIN_PROMPT_SCALE = 0.25


@dataclass(frozen=True)
class LengthTerms:
    """How answer lengths are learned (``[proxy] reserve_*``)."""

    quantile: float = 0.95
    min_samples: int = 20
    window: int = 256
    max_kinds: int = 64


@dataclass(frozen=True)
class LengthEstimate:
    """A reservation per sequence, and what it was learned from (for reasons and /status)."""

    tokens: int
    samples: int
    kind: Kind

    def describe(self, quantile: float) -> str:
        """``p95 output 310 tokens (of 240 answers)``: the words a reason uses."""
        return f"p{quantile * 100:g} output {self.tokens} tokens (of {self.samples} answers)"


class _Recent:
    """The last ``window`` values of one kind, with its quantile computed on demand."""

    __slots__ = ("_quantile", "_sorted", "added", "values")

    def __init__(self, window: int) -> None:
        self.values: deque[int] = deque(maxlen=window)
        self.added = 0  # values ever added: the window holds the last len(values) of them
        self._quantile: tuple[float, int] | None = None  # (q, value), until the next add
        self._sorted: list[int] | None = None  # the values ascending, until the next add

    def add(self, value: int) -> None:
        self.values.append(value)
        self.added += 1
        self._quantile = None
        self._sorted = None

    def ascending(self) -> list[int]:
        """The values in ascending order (kept until the next add; do not change it)."""
        if self._sorted is None:
            self._sorted = sorted(self.values)
        return self._sorted

    def quantile(self, q: float) -> int:
        cached = self._quantile
        if cached is not None and cached[0] == q:
            return cached[1]
        ordered = self.ascending()
        # Nearest rank: the smallest value at least q of the values are at or under.
        value = ordered[max(0, math.ceil(q * len(ordered)) - 1)]
        self._quantile = (q, value)
        return value


class ObservedLengths:
    """Recent answer lengths per kind of request, and whole request sizes over all kinds."""

    def __init__(self, terms: LengthTerms = LengthTerms()) -> None:
        self.terms = terms
        self._kinds: OrderedDict[Kind, _Recent] = OrderedDict()
        # Prompt + answer of recent requests, all kinds: what a typical request needs.
        self._sizes = _Recent(terms.window)
        # Answers cut before their end (the client went away, kvguard cancelled them, the
        # engine failed), at the length they had: each would have been at least that
        # long. Per kind, (how many answers of the kind had ended then, the length), so
        # only those cut while the kept ended answers were seen count.
        self._cut: OrderedDict[Kind, deque[tuple[int, int]]] = OrderedDict()
        # Per model: the engine's prompt count over the proxy's estimate (thousandths).
        self._prompt_ratios: OrderedDict[Kind, _Recent] = OrderedDict()

    def __len__(self) -> int:
        """Kinds kept (bounded by ``max_kinds``)."""
        return len(self._kinds)

    def observe(
        self,
        kind: Kind,
        output_per_sequence: int,
        request_tokens: int,
        *,
        at_limit: bool = False,
    ) -> None:
        """Record one finished answer: its length per sequence, and its whole size.

        Recorded under the kind itself and every broader kind, so a new priority of
        a known route starts from the route's lengths, not from nothing. ``at_limit``:
        it stopped at the length its client allowed (``max_tokens``), so it is a lower
        bound of its length, recorded as a cut answer is (:meth:`observe_cut`): the
        answers of clients that ask for little say nothing of how long an answer asked
        for more would run, and read as lengths they would reserve it too little.
        """
        output = max(0, int(output_per_sequence))
        if at_limit:
            self.observe_cut(kind, output)
        else:
            for key in _broader(kind):
                self._recent(self._kinds, key).add(output)
        self._sizes.add(max(0, int(request_tokens)))

    def observe_cut(self, kind: Kind, written_per_sequence: int) -> None:
        """Record an answer cut before its end, at what it had written (per sequence).

        Not a length, but a lower bound on one: the quantile counts it as an answer
        still running would be counted, so the long answers that are cut (by the
        client, or cancelled for running past their reservation) are not forgotten.
        """
        written = int(written_per_sequence)
        if written < 1:
            return
        for key in _broader(kind):
            ended = self._kinds.get(key)
            cuts = self._cut.get(key)
            if cuts is None:
                cuts = self._cut[key] = deque(maxlen=self.terms.window)
                while len(self._cut) > self.terms.max_kinds:
                    self._cut.popitem(last=False)
            else:
                self._cut.move_to_end(key)
            cuts.append((ended.added if ended is not None else 0, written))

    def _recent(self, table: OrderedDict[Kind, _Recent], key: Kind) -> _Recent:
        """``table``'s values for ``key``, made most recently seen (the oldest kind forgotten)."""
        recent = table.get(key)
        if recent is None:
            recent = table[key] = _Recent(self.terms.window)
            while len(table) > self.terms.max_kinds:
                table.popitem(last=False)
        else:
            table.move_to_end(key)
        return recent

    def estimate(
        self, kind: Kind, running: Iterable[tuple[Kind, int]] = (), beyond: int = 0
    ) -> LengthEstimate | None:
        """The ``quantile`` of answer lengths of ``kind`` (or the nearest broader kind).

        ``running`` are the answers still being written, as (their kind, tokens per
        sequence written so far): each will be at least that long, so those of the
        kind counted in (its own, or a narrower one) with the ended ones (see the
        module's docstring). With ``beyond``, the quantile of the answers longer than
        that: what one already ``beyond`` tokens long will likely reach. None while
        no kind it falls under has ``min_samples`` ended answers, or while the
        quantile lies past every answer seen to end: then the caller reserves what
        the client asked.
        """
        for key in _broader(kind):
            recent = self._kinds.get(key)
            if recent is None or len(recent.values) < self.terms.min_samples:
                continue
            q = self.terms.quantile
            censored = [g for k, g in running if g > 0 and _covers(key, k)]
            # Cut while the ended answers kept were seen: they age out together.
            since = recent.added - len(recent.values)
            censored.extend(w for at, w in self._cut.get(key, ()) if at >= since)
            if not censored and not beyond:
                return LengthEstimate(recent.quantile(q), len(recent.values), key)
            censored.sort()
            tokens = censored_quantile(recent.ascending(), censored, q, beyond)
            if tokens is None:
                return None
            return LengthEstimate(tokens, len(recent.values), key)
        return None

    def table(self, kind: Kind, running: Iterable[tuple[Kind, int]] = ()) -> LengthTable | None:
        """The whole estimated distribution of answer lengths of ``kind``, not one quantile.

        The same kind :meth:`estimate` reads (its own, else the nearest broader one
        with ``min_samples`` ended answers), with the same answers still running and
        cut counted as lower bounds; None when no kind it falls under has enough.
        What admission reads each answer's expected length and spread from, to
        reserve for the in-flight answers together (see :class:`LengthTable`).
        """
        for key in _broader(kind):
            recent = self._kinds.get(key)
            if recent is None or len(recent.values) < self.terms.min_samples:
                continue
            censored = [g for k, g in running if g > 0 and _covers(key, k)]
            since = recent.added - len(recent.values)
            censored.extend(w for at, w in self._cut.get(key, ()) if at >= since)
            censored.sort()
            return LengthTable.estimate(recent.ascending(), censored, len(recent.values), key)
        return None

    def observe_prompt(self, model: str, counted: int, estimated: int) -> None:
        """Record the engine's count of a prompt against the estimate it was admitted with."""
        if counted < 1 or estimated < 1:
            return
        # Kept in thousandths: the quantile code sorts ints.
        ratio = round(PROMPT_RATIO_SCALE * counted / estimated)
        self._recent(self._prompt_ratios, (model, "", "")).add(ratio)

    def prompt_scale(self, model: str) -> float | None:
        """What the engine counts per estimated prompt token, for ``model`` (a high quantile).

        None before ``min_samples`` prompts of the model were counted. The byte-based
        estimate errs high (about 2x on plain English); scaled by the ``quantile`` of
        recent ratios it still errs high for all but a few prompts, and those are
        corrected when the engine's count comes.
        """
        recent = self._prompt_ratios.get((model, "", ""))
        if recent is None or len(recent.values) < self.terms.min_samples:
            return None
        # A floor: a count that leaves out cached prefix tokens (some engines' usage
        # does) must not shrink every estimate to nothing.
        return max(MIN_PROMPT_SCALE, recent.quantile(self.terms.quantile) / PROMPT_RATIO_SCALE)

    def typical_request_tokens(self) -> int | None:
        """The ``quantile`` of recent requests' prompt + answer, or None before ``min_samples``."""
        if len(self._sizes.values) < self.terms.min_samples:
            return None
        return self._sizes.quantile(self.terms.quantile)

    def snapshot(self) -> list[dict[str, object]]:
        """Each kind's estimate and sample count, most recently seen first (for /status)."""
        out: list[dict[str, object]] = []
        for (model, route, priority), recent in reversed(self._kinds.items()):
            out.append(
                {
                    "model": model or "*",
                    "route": route or "*",
                    "priority": priority or "*",
                    "samples": len(recent.values),
                    "output_tokens": recent.quantile(self.terms.quantile),
                }
            )
        return out


class LengthTable:
    """The Kaplan-Meier estimate of one kind's answer lengths, as masses at the lengths seen.

    ``lengths`` ascending (the distinct lengths of ended answers), ``masses`` the
    estimated share of answers ending at each, and ``tail`` the share estimated to be
    longer than every one seen to end (answers still running past the longest ended
    one): what nothing seen yet tells. :meth:`moments` answers, for one answer that
    has written ``beyond`` tokens and may write at most ``ceiling``, the mean and
    variance of where it will end, the unknown tail placed at the ceiling (as the
    conservative prior reserves). Lookups are O(log n) on prefix sums, so every
    running answer can be re-read each tick.
    """

    __slots__ = ("_m0", "_m1", "_m2", "kind", "lengths", "samples", "tail")

    def __init__(
        self, lengths: list[int], masses: list[float], tail: float, samples: int, kind: Kind
    ) -> None:
        self.lengths = lengths
        self.tail = tail
        self.samples = samples
        self.kind = kind
        # Prefix sums of mass, mass x length and mass x length^2.
        self._m0 = [0.0]
        self._m1 = [0.0]
        self._m2 = [0.0]
        for length, mass in zip(lengths, masses, strict=True):
            self._m0.append(self._m0[-1] + mass)
            self._m1.append(self._m1[-1] + mass * length)
            self._m2.append(self._m2[-1] + mass * length * length)

    @classmethod
    def estimate(
        cls, ended: list[int], running: list[int], samples: int, kind: Kind
    ) -> LengthTable:
        """The product-limit estimate from ``ended`` lengths and ``running`` lower bounds.

        Both lists ascending.
        An answer running (or cut) at ``c`` tokens is known to be longer than every
        length up to ``c``, and counted at risk there, as :func:`censored_quantile` does.
        """
        lengths: list[int] = []
        masses: list[float] = []
        at_risk = len(ended) + len(running)
        survival = 1.0
        i = j = 0
        while i < len(ended):
            length = ended[i]
            while j < len(running) and running[j] < length:
                j += 1
                at_risk -= 1
            ended_here = 0
            while i < len(ended) and ended[i] == length:
                ended_here += 1
                i += 1
            mass = survival * ended_here / at_risk
            survival -= mass
            at_risk -= ended_here
            lengths.append(length)
            masses.append(mass)
        return cls(lengths, masses, max(survival, 0.0), samples, kind)

    def quantile(self, q: float) -> LengthEstimate | None:
        """The ``q`` quantile, as :meth:`ObservedLengths.estimate` reads it (one pass, not two).

        The smallest length by which at least ``q`` of the answers are estimated to
        have ended; None while it lies past every length seen to end.
        """
        # A sum of fractions: 19/20 of the mass is not exactly 0.95.
        at = bisect_left(self._m0, q - 1e-9, lo=1)
        if at > len(self.lengths):
            return None
        return LengthEstimate(self.lengths[at - 1], self.samples, self.kind)

    def moments(self, beyond: int, ceiling: int) -> tuple[float, float]:
        """Mean and variance of where an answer ``beyond`` tokens long ends, at most ``ceiling``.

        Only lengths at or over ``beyond`` count (it has written that much); lengths
        over ``ceiling`` and the unknown tail end at the ceiling (it cannot write
        more). With nothing known past ``beyond``: the ceiling, no spread.
        """
        top = max(ceiling, beyond)
        lo = bisect_left(self.lengths, beyond)
        hi = max(lo, bisect_left(self.lengths, top))
        mass = self._m0[hi] - self._m0[lo]
        first = self._m1[hi] - self._m1[lo]
        second = self._m2[hi] - self._m2[lo]
        capped = self._m0[-1] - self._m0[hi] + self.tail
        total = mass + capped
        if total <= 1e-12:
            return float(top), 0.0
        mean = (first + capped * top) / total
        variance = (second + capped * top * top) / total - mean * mean
        return mean, max(variance, 0.0)

    def still_writing(
        self, written: int, ceiling: int, lengths: Iterable[int]
    ) -> list[float] | None:
        """For each length, the chance an answer ``written`` tokens long reaches it.

        ``P(L >= x | L > written)``, the answer's end ``L`` at most ``ceiling`` (longer
        lengths and the unknown tail end there): 0 past the ceiling. None when nothing
        is known past ``written`` (it is longer than every answer seen to end, and
        none is estimated longer): the caller assumes the ceiling.
        """
        top = max(ceiling, written)
        total = self._m0[-1] + self.tail

        def at_least(x: int) -> float:
            if x > top:
                return 0.0
            return total - self._m0[bisect_left(self.lengths, x)]

        known = at_least(written + 1)
        if known <= 1e-12:
            return None
        return [min(at_least(x) / known, 1.0) if x > written else 1.0 for x in lengths]


def censored_quantile(
    ended: list[int], running: list[int], q: float, beyond: int = 0
) -> int | None:
    """The ``q`` quantile of lengths from ``ended`` answers and ``running`` lower bounds.

    Both lists ascending. The Kaplan-Meier product-limit estimate of the share of
    answers longer than x, where an answer still running at ``c`` tokens is known
    to be longer than every length up to ``c`` (and counted at risk there); the
    quantile is the smallest ended length at which that share falls to ``1 - q``
    or below, or None when it never does within what has ended. Without running
    answers it is the nearest-rank quantile of ``ended``. With ``beyond``, the
    quantile of the answers longer than ``beyond`` (the share relative to theirs):
    what an answer already ``beyond`` tokens long will likely reach.
    """
    if beyond > 0:
        # A quantile of the answers longer than `beyond` needs enough of them: with
        # fewer than 1 / (1 - q) it would only be the longest of a handful.
        longer = (
            len(ended) - bisect_right(ended, beyond) + len(running) - bisect_left(running, beyond)
        )
        if q >= 1.0 or longer < math.ceil(1.0 / (1.0 - q) - 1e-9):
            return None
    at_risk = len(ended) + len(running)
    survival = 1.0
    base: float | None = None if beyond > 0 else 1.0  # the share longer than `beyond`
    slack = 1e-9  # a product of fractions: 19/20 * ... is not exactly 0.05
    i = j = 0
    while i < len(ended):
        length = ended[i]
        if base is None and length > beyond:
            base = survival
        while j < len(running) and running[j] < length:
            j += 1  # still running, but shorter so far: no longer known to be at risk
            at_risk -= 1
        ended_here = 0
        while i < len(ended) and ended[i] == length:
            ended_here += 1
            i += 1
        survival *= 1.0 - ended_here / at_risk
        at_risk -= ended_here
        if base is not None and survival <= (1.0 - q) * base + slack:
            return length
    return None


def _covers(key: Kind, kind: Kind) -> bool:
    """Whether ``key`` is ``kind`` or one of its broader kinds (``""`` stands for any)."""
    return all(part in ("", own) for part, own in zip(key, kind, strict=True))


def _broader(kind: Kind) -> tuple[Kind, ...]:
    """``kind``, then the same model and route over any priority, the model, everything."""
    model, route, _ = kind
    return tuple(dict.fromkeys((kind, (model, route, ""), (model, "", ""), ("", "", ""))))
