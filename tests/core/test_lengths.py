"""Learned answer lengths: quantiles per kind, broader kinds standing in, bounded memory."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvguard.core import admission as rules
from kvguard.core.lengths import LengthTable, LengthTerms, ObservedLengths, censored_quantile

CHAT = ("llama", "/v1/chat/completions", "standard")


def test_no_estimate_until_min_samples_then_the_quantile():
    """Before min_samples answers there is no estimate (the caller reserves max_tokens)."""
    lengths = ObservedLengths(LengthTerms(quantile=0.95, min_samples=20, window=100))
    for tokens in range(1, 20):
        lengths.observe(CHAT, tokens, tokens + 10)
    assert lengths.estimate(CHAT) is None
    lengths.observe(CHAT, 20, 30)
    estimate = lengths.estimate(CHAT)
    assert estimate is not None
    # Nearest rank: 95% of 1..20 are at or under 19.
    assert (estimate.tokens, estimate.samples, estimate.kind) == (19, 20, CHAT)
    assert estimate.describe(0.95) == "p95 output 19 tokens (of 20 answers)"


def test_only_the_most_recent_window_counts():
    """Old answers fall out: the traffic changed, so does the reservation."""
    lengths = ObservedLengths(LengthTerms(quantile=0.5, min_samples=4, window=4))
    for tokens in (1000, 1000, 1000, 1000, 10, 10, 10, 10):
        lengths.observe(CHAT, tokens, tokens)
    estimate = lengths.estimate(CHAT)
    assert estimate is not None
    assert estimate.tokens == 10


def test_a_new_priority_starts_from_its_route_then_its_model_then_everything():
    """Broader kinds stand in until a kind has its own min_samples answers."""
    lengths = ObservedLengths(LengthTerms(quantile=1.0, min_samples=3, window=10))
    for _ in range(3):
        lengths.observe(CHAT, 300, 400)
    critical = ("llama", "/v1/chat/completions", "critical")
    estimate = lengths.estimate(critical)
    assert estimate is not None
    assert (estimate.tokens, estimate.kind) == (300, ("llama", "/v1/chat/completions", ""))
    other_route = ("llama", "/v1/completions", "standard")
    assert lengths.estimate(other_route).kind == ("llama", "", "")  # type: ignore[union-attr]
    other_model = ("qwen", "/v1/completions", "standard")
    assert lengths.estimate(other_model).kind == ("", "", "")  # type: ignore[union-attr]
    # Its own answers, once there are enough, replace the broader ones.
    for _ in range(3):
        lengths.observe(critical, 50, 60)
    assert lengths.estimate(critical).tokens == 50  # type: ignore[union-attr]


def test_memory_is_bounded_by_kinds_and_window():
    """A client naming a new model per request cannot grow the statistics without bound."""
    lengths = ObservedLengths(LengthTerms(min_samples=1, window=8, max_kinds=10))
    for i in range(1_000):
        lengths.observe((f"model-{i}", "/v1/completions", "standard"), i, i)
    assert len(lengths) == 10
    assert all(kind["samples"] <= 8 for kind in lengths.snapshot())


def test_typical_request_size_is_the_quantile_of_prompt_plus_answer():
    """The window cap's floor: a high quantile of whole requests, all kinds together."""
    lengths = ObservedLengths(LengthTerms(quantile=0.5, min_samples=3, window=10))
    assert lengths.typical_request_tokens() is None
    for total in (100, 200, 300):
        lengths.observe(CHAT, 10, total)
    assert lengths.typical_request_tokens() == 200


@pytest.mark.parametrize(
    ("max_tokens", "learned", "context_room", "expected"),
    [
        (4096, 310, None, (310, "observed")),  # over-asked: what answers really use
        (200, 310, None, (200, "max_tokens")),  # never over what the client allows
        (4096, None, None, (4096, "max_tokens")),  # no estimate yet: the conservative prior
        (None, None, 30_000, (30_000, "context")),  # no max_tokens: the context's room
        (None, 310, 30_000, (310, "observed")),
        (None, None, None, (rules.UNKNOWN_MAX_TOKENS, "default")),
        (None, 3000, None, (3000, "observed")),  # 512 is a guess: what was seen wins
        (None, None, -5, (0, "context")),  # a prompt over the context: nothing left
        (10**9, None, 30_000, (30_000, "context")),  # an absurd max_tokens: the context's room
    ],
)
def test_an_answer_is_reserved_at_the_learned_length_under_its_ceiling(
    max_tokens, learned, context_room, expected
):
    """Learned length under max_tokens, else the context's room, else the default."""
    assert rules.reserved_answer(max_tokens, learned, context_room) == expected


def test_what_is_in_flight_is_never_less_than_the_engine_holds():
    """The engine's count is the floor: traffic past the proxy, answers over their estimate."""
    assert rules.in_flight_tokens(5_000, None) == 5_000
    assert rules.in_flight_tokens(5_000, 8_000) == 8_000
    assert rules.in_flight_tokens(5_000, 3_000) == 5_000


def test_the_prompt_estimate_is_scaled_by_what_the_engine_counted():
    """Per model, a high quantile of engine count / estimate, after min_samples prompts."""
    lengths = ObservedLengths(LengthTerms(quantile=0.95, min_samples=4, window=10))
    assert lengths.prompt_scale("llama") is None
    for counted in (40, 45, 50, 48):
        lengths.observe_prompt("llama", counted, 100)
    assert lengths.prompt_scale("llama") == 0.5  # the highest ratio of four: errs high
    assert lengths.prompt_scale("qwen") is None  # per model
    lengths.observe_prompt("llama", 0, 100)  # nonsense is not learned
    assert lengths.prompt_scale("llama") == 0.5


def test_answers_still_running_keep_the_quantile_from_the_short_ones_that_ended_first():
    """Early in a burst the short answers end first: the long ones still running count.

    Twenty short answers ended (1..20 tokens); six of the same kind are still being
    written, each already past 300 tokens. More than 5% of the answers are longer than
    any that ended, so there is no p95 yet (the caller reserves the ask); once enough
    of them end, the quantile is read from lengths that include them.
    """
    lengths = ObservedLengths(LengthTerms(quantile=0.95, min_samples=20, window=100))
    for tokens in range(1, 21):
        lengths.observe(CHAT, tokens, tokens + 10)
    assert lengths.estimate(CHAT).tokens == 19  # type: ignore[union-attr]
    running = [(CHAT, 300)] * 6
    assert lengths.estimate(CHAT, running) is None
    # Running answers of another model, or with nothing written yet, tell nothing.
    assert lengths.estimate(CHAT, [(("qwen", *CHAT[1:]), 300)] * 6).tokens == 19  # type: ignore[union-attr]
    assert lengths.estimate(CHAT, [(CHAT, 0)] * 6).tokens == 19  # type: ignore[union-attr]
    # A narrower kind's running answers count for the broader kind standing in for it.
    critical = ("llama", "/v1/chat/completions", "critical")
    assert lengths.estimate(critical, [(critical, 300)] * 6) is None
    for tokens in (400, 500, 600, 700, 800, 900):
        lengths.observe(CHAT, tokens, tokens + 10)
    # 26 ended: p95 by nearest rank is the 25th, 800.
    assert lengths.estimate(CHAT).tokens == 800  # type: ignore[union-attr]


def test_the_censored_quantile_by_hand():
    """Kaplan-Meier: an answer running at c tokens is at risk for every end up to c."""
    # 4 ended (10, 20, 30, 40), one running at 25. S(10)=4/5, S(20)=4/5*3/4=3/5,
    # then the running one leaves the risk set: S(30)=3/5*1/2=3/10, S(40)=0.
    assert censored_quantile([10, 20, 30, 40], [25], 0.5) == 30
    assert censored_quantile([10, 20, 30, 40], [25], 0.4) == 20
    # Without it, the median of four is the second (nearest rank).
    assert censored_quantile([10, 20, 30, 40], [], 0.5) == 20
    # A running answer longer than every ended one: the top of the tail is unknown.
    assert censored_quantile([10, 20, 30, 40], [50], 1.0) is None
    assert censored_quantile([10, 20, 30, 40], [50], 0.75) == 40
    # Ties end together.
    assert censored_quantile([5, 5, 5, 9], [], 0.75) == 5


@given(
    ended=st.lists(st.integers(0, 5000), min_size=1, max_size=60),
    running=st.lists(st.integers(1, 5000), max_size=30),
    q=st.sampled_from([0.5, 0.9, 0.95, 0.99, 1.0]),
)
def test_running_answers_never_lower_the_quantile(ended, running, q):
    """Without running answers it is the nearest-rank quantile; with them, never lower.

    Kaplan-Meier moves a running answer's share onto the longer ends (it is at least
    that long), where leaving it out spreads it over every end: never a smaller
    reservation than the ended answers alone give.
    """
    ended.sort()
    running.sort()
    nearest = ended[max(0, math.ceil(q * len(ended)) - 1)]
    assert censored_quantile(ended, [], q) == nearest
    with_running = censored_quantile(ended, running, q)
    assert with_running is None or with_running >= nearest


def test_answers_cut_before_their_end_are_remembered_as_at_least_that_long():
    """A long answer cancelled or abandoned is not forgotten: it would have been longer.

    Without it, every long answer of a kind that gets cut drops out of what is learned,
    reservations stay short, and more long ones are admitted short.
    """
    lengths = ObservedLengths(LengthTerms(quantile=0.95, min_samples=20, window=100))
    for tokens in range(1, 21):
        lengths.observe(CHAT, tokens, tokens + 10)
    assert lengths.estimate(CHAT).tokens == 19  # type: ignore[union-attr]
    lengths.observe_cut(CHAT, 0)  # cut before it wrote anything: tells nothing
    assert lengths.estimate(CHAT).tokens == 19  # type: ignore[union-attr]
    for _ in range(3):
        lengths.observe_cut(CHAT, 500)
    # 3 of 23 answers are longer than any that ended: no p95 yet.
    assert lengths.estimate(CHAT) is None
    # The broader kinds remember them too.
    assert lengths.estimate(("llama", "/v1/chat/completions", "critical")) is None
    # They age with the ended answers: once the window has turned over, they are gone.
    for _ in range(100):
        lengths.observe(CHAT, 30, 40)
    assert lengths.estimate(CHAT).tokens == 30  # type: ignore[union-attr]


def test_an_answer_that_stopped_at_its_max_tokens_is_only_at_least_that_long():
    """Answers that ran to their client's max_tokens are lower bounds, not lengths.

    Learned as lengths, one-token probes (max_tokens 1) made a kind's p95 one token,
    and a burst of the same route asking 600 tokens each was reserved one token each:
    twice the pool admitted at once, on an engine that dies when it runs out.
    """
    lengths = ObservedLengths(LengthTerms(quantile=0.95, min_samples=20, window=100))
    for _ in range(50):
        lengths.observe(CHAT, 1, 11, at_limit=True)
    # Nothing is known of where answers of the kind end: the caller reserves max_tokens.
    assert lengths.estimate(CHAT) is None
    assert lengths.table(CHAT) is None
    # Their sizes still count as requests of the traffic (the window cap's floor).
    assert lengths.typical_request_tokens() == 11
    # Answers that ended on their own make the estimate, the stopped ones at risk in it:
    # with 30 of 80 only known to be past 1 token, the p95 of the rest still holds.
    for tokens in range(1, 31):
        lengths.observe(CHAT, tokens, tokens + 10)
    estimate = lengths.estimate(CHAT)
    assert estimate is not None
    assert estimate.tokens == 29
    # Read as lengths (as before), the fifty one-token answers alone make the p95 one token.
    plain = ObservedLengths(LengthTerms(quantile=0.95, min_samples=20, window=100))
    for _ in range(50):
        plain.observe(CHAT, 1, 11)
    assert plain.estimate(CHAT).tokens == 1  # type: ignore[union-attr]


def test_the_quantile_beyond_a_length_needs_enough_answers_past_it():
    """Fewer than 1 / (1 - q) answers longer than it: no quantile (the caller's ceiling)."""
    ended = [10] * 100 + list(range(500, 520))  # twenty past 400
    assert censored_quantile(ended, [], 0.95, beyond=400) == 518  # the 19th of 20
    assert censored_quantile(ended, [], 0.95, beyond=505) is None  # fourteen past it
    assert censored_quantile(ended, [600], 0.95, beyond=400) == 519  # one running counts
    assert censored_quantile(ended, [], 1.0, beyond=400) is None


def _moments(values: list[int]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    return mean, sum((v - mean) ** 2 for v in values) / len(values)


def test_the_length_table_without_running_answers_is_the_sample_itself():
    """Nothing running: the mean and variance of the answers seen (past a length: the longer)."""
    lengths = ObservedLengths(LengthTerms(min_samples=5, window=100))
    seen = [40] * 10 + [400] * 10 + [1000] * 5
    for tokens in seen:
        lengths.observe(CHAT, tokens, tokens + 10)
    table = lengths.table(CHAT)
    assert table is not None
    assert (table.samples, table.kind, table.tail) == (25, CHAT, 0.0)
    mean, variance = table.moments(0, 4096)
    assert mean == pytest.approx(_moments(seen)[0])
    assert variance == pytest.approx(_moments(seen)[1])
    # An answer that has written 41 tokens is one of the 400s or the 1000s.
    mean, variance = table.moments(41, 4096)
    assert (mean, variance) == pytest.approx(_moments([400] * 10 + [1000] * 5))
    # Its max_tokens is 500: a 1000-token answer of its kind would stop at 500.
    assert table.moments(41, 500) == pytest.approx(_moments([400] * 10 + [500] * 5))
    # Past every length seen to end, nothing is known: its ceiling, no spread.
    assert table.moments(1001, 2048) == (2048.0, 0.0)


def test_answers_still_running_put_their_unknown_share_at_the_ceiling():
    """Ten short answers ended, ten long ones run: half the mass is unknown, at the ceiling."""
    lengths = ObservedLengths(LengthTerms(min_samples=5, window=100))
    for _ in range(10):
        lengths.observe(CHAT, 40, 50)
    running = [(CHAT, 300)] * 10
    table = lengths.table(CHAT, running)
    assert table is not None
    assert table.tail == pytest.approx(0.5)
    assert table.moments(0, 2000) == pytest.approx(_moments([40] * 10 + [2000] * 10))
    # Answers of another kind running tell nothing about this one.
    other = ("llama", "/v1/completions", "standard")
    assert lengths.table(CHAT, [(other, 300)] * 10).tail == 0.0  # type: ignore[union-attr]
    # A model never seen is read from every answer seen (the broadest kind).
    assert lengths.table(("other", "/x", "critical")).kind == ("", "", "")  # type: ignore[union-attr]
    assert ObservedLengths().table(CHAT) is None  # nothing seen: the caller reserves the ask


@given(
    st.lists(st.integers(1, 3000), min_size=1, max_size=60),
    st.lists(st.integers(1, 3000), max_size=60),
    st.integers(0, 3000),
    st.integers(1, 4000),
)
def test_the_expected_length_lies_between_what_is_written_and_the_ceiling(
    ended, running, beyond, ceiling
):
    """Whatever was seen, an answer is expected to end between what it wrote and its ceiling."""
    lengths = ObservedLengths(LengthTerms(min_samples=1, window=100))
    for tokens in ended:
        lengths.observe(CHAT, tokens, tokens)
    table = lengths.table(CHAT, [(CHAT, g) for g in running])
    assert table is not None
    mean, variance = table.moments(beyond, ceiling)
    top = max(beyond, ceiling)
    assert min(beyond, top) - 1e-6 <= mean <= top + 1e-6
    assert 0.0 <= variance <= (top - min(beyond, top)) ** 2 / 4 + 1e-6


@given(
    st.lists(st.integers(1, 500), min_size=1, max_size=60),
    st.lists(st.integers(1, 500), max_size=60),
    st.sampled_from([0.5, 0.9, 0.95, 0.99, 1.0]),
)
def test_the_table_reads_the_same_quantile_as_the_estimate(ended, running, q):
    """Admission reads the quantile off the table it reads the moments from: the same figure."""
    lengths = ObservedLengths(LengthTerms(quantile=q, min_samples=1, window=100))
    for tokens in ended:
        lengths.observe(CHAT, tokens, tokens)
    answers = [(CHAT, g) for g in running]
    table = lengths.table(CHAT, answers)
    assert table is not None
    assert table.quantile(q) == lengths.estimate(CHAT, answers)


def test_the_chance_an_answer_is_still_being_written_reads_the_estimate_given_its_length():
    """Four answers ended at 100-400 tokens, a quarter each; one has written 150 so far.

    It is longer than 100, so it ends at 200, 300 or 400, a third each: it reaches
    250 with chance 2/3, 350 with 1/3. Under a ceiling of 300 the 400 ends there;
    past the ceiling it is surely done. Longer than every answer seen: nothing known.
    """
    table = LengthTable.estimate([100, 200, 300, 400], [], 4, ("m", "/v1/completions", "s"))
    chances = table.still_writing(150, 1000, [150, 200, 250, 350, 450])
    assert chances == pytest.approx([1.0, 1.0, 2 / 3, 1 / 3, 0.0])
    assert table.still_writing(150, 300, [300, 350]) == pytest.approx([2 / 3, 0.0])
    assert table.still_writing(500, 1000, [600]) is None
    # An answer still running past the longest ended one: the tail ends at the ceiling.
    censored = LengthTable.estimate([100, 200], [300], 2, ("m", "/v1/completions", "s"))
    assert censored.still_writing(250, 1000, [999, 1000, 1001]) == pytest.approx([1.0, 1.0, 0.0])
