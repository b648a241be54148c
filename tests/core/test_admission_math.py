"""The proxy's admission arithmetic (kvguard.core.admission), with plain numbers."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvguard.core.admission import (
    HELD_POOLS,
    OVERRUN_READINGS_AHEAD,
    AdmissionTerms,
    Envelope,
    Growth,
    SpreadProfile,
    WindowOutcome,
    admission_deadline,
    admission_enforced,
    admission_terms,
    admits,
    apply_window,
    caps_for,
    fits_pool,
    growth,
    kv_exhaustion,
    may_hold,
    needs_exact_count,
    overrun_cancels,
    pool_lasts,
    pooled_reservation,
    spread_terms,
    step_grid,
    whole_blocks,
)


def test_critical_requests_have_no_window_caps():
    """Critical requests are never refused for their size; the others get the window in force."""
    assert caps_for("critical", (100, 50)) == (None, None)
    assert caps_for("standard", (100, 50)) == (100, 50)
    assert caps_for("sheddable", (None, 50)) == (None, 50)


@pytest.mark.parametrize(
    ("prompt_cap", "completion_cap", "shed_class", "enforced", "expected"),
    [
        (None, None, False, False, False),  # calm: the estimate serves
        (100, None, False, False, True),
        (None, 100, False, False, True),
        (None, None, True, False, True),  # a hold for room compares against the pool
        (None, None, False, True, True),  # an estimate admission would refuse
    ],
)
def test_exact_count_is_needed_only_when_it_decides(
    prompt_cap, completion_cap, shed_class, enforced, expected
):
    """The exact count is waited for only when a cap, a hold or an admission refusal uses it."""
    assert (
        needs_exact_count(
            prompt_cap, completion_cap, shed_class=shed_class, admission_refuses=enforced
        )
        is expected
    )


def test_a_prompt_over_the_prompt_cap_is_refused():
    """A prompt one token over the prompt cap is refused; one at the cap goes on."""
    assert apply_window(101, 10, 100, None, 16).refusal == "prompt_over_window"
    assert apply_window(100, 10, 100, None, 16) == WindowOutcome(None, 10)  # at the cap: fits


def test_with_both_caps_the_answer_gets_what_the_prompt_leaves():
    """Under both caps the answer's room is the completion cap less the prompt."""
    # 1000 - 900 = 100 tokens of room: 500 asked is clamped to it.
    assert apply_window(900, 500, 1000, 1000, 16) == WindowOutcome(None, 100, clamped=True)
    # 1000 - 990 = 10 < 16: no room for a useful answer.
    assert apply_window(990, 500, 1000, 1000, 16).refusal == "no_room_for_completion"


def test_with_only_a_completion_cap_the_prompt_is_not_subtracted():
    """Under a completion cap alone the room is the whole cap, whatever the prompt."""
    assert apply_window(900, 500, None, 200, 16) == WindowOutcome(None, 200, clamped=True)
    assert apply_window(5000, 100, None, 200, 16) == WindowOutcome(None, 100)  # under: as asked
    assert apply_window(5000, 100, None, 8, 16).refusal == "no_room_for_completion"


def test_a_request_without_max_tokens_is_clamped_to_the_room():
    """No max_tokens under a completion cap: the room is set; with no cap, nothing is."""
    assert apply_window(10, None, None, 64, 16) == WindowOutcome(None, 64, clamped=True)
    assert apply_window(10, None, None, None, 16) == WindowOutcome(None, None)  # no cap: unset


@given(
    prompt=st.integers(1, 10_000),
    asked=st.none() | st.integers(1, 10_000),
    prompt_cap=st.none() | st.integers(1, 10_000),
    completion_cap=st.integers(1, 10_000),
    minimum=st.integers(1, 64),
)
def test_an_admitted_answer_never_exceeds_the_cap(
    prompt, asked, prompt_cap, completion_cap, minimum
):
    """An admitted answer fits the caps; a clamp leaves it at least the minimum."""
    outcome = apply_window(prompt, asked, prompt_cap, completion_cap, minimum)
    if outcome.refusal is None:
        assert outcome.max_tokens is not None
        assert outcome.max_tokens <= completion_cap
        assert outcome.clamped == (asked is None or asked > outcome.max_tokens)
        if outcome.clamped:  # a client may ask for less than the minimum; a clamp never does
            assert outcome.max_tokens >= minimum
        else:
            assert outcome.max_tokens == asked
        if prompt_cap is not None:  # the two caps stand for one context window
            assert prompt <= prompt_cap
            assert prompt + outcome.max_tokens <= completion_cap


def test_projections_round_up_to_whole_blocks():
    """Projections are counted in whole KV blocks, rounded up."""
    assert whole_blocks(1, 16) == 16
    assert whole_blocks(16, 16) == 16
    assert whole_blocks(17, 16) == 32
    assert whole_blocks(0, 16) == 0


def test_fits_pool_is_inclusive_and_an_unknown_pool_has_no_room():
    """Fitting exactly at the ratio fits; one block more does not; no pool, no room."""
    assert fits_pool(600, 200, 1000, 0.8)  # 800 <= 800
    assert not fits_pool(600, 216, 1000, 0.8)
    assert not fits_pool(0, 1, None, 1.0)


def test_held_requests_are_bounded_by_held_pools():
    """Shed-class requests are held up to HELD_POOLS x shed_ratio of the pool, not beyond."""
    pool, ratio = 1000, 0.5
    bound = pool * ratio * HELD_POOLS
    assert may_hold(int(bound) - 1, pool, ratio)
    assert not may_hold(int(bound), pool, ratio)
    assert not may_hold(0, pool, 0.0)  # shed_ratio 0: shed the whole class at once
    assert not may_hold(0, None, ratio)  # no pool to measure against


def test_may_hold_weighs_the_requests_own_projection():
    """A request that could never fit is not held; none may take the whole bound."""
    pool, ratio = 10_000, 0.8
    share = pool * ratio
    assert may_hold(0, pool, ratio, own=int(share))  # fits the shed share exactly
    assert not may_hold(0, pool, ratio, own=int(share) + 1)  # never fits: shed now
    assert not may_hold(0, pool, ratio, own=2**31 * 1000)  # n = 2^31: not held
    bound = share * HELD_POOLS
    assert may_hold(int(bound) - 1, pool, ratio, own=int(share))  # the last one held
    assert not may_hold(int(bound), pool, ratio, own=1)


def test_projected_admission_is_enforced_only_live_against_a_known_pool():
    """Projected admission applies only when chosen, enforcing, and the pool is known."""
    assert admission_enforced("projected", enforcing=True, pool=1000)
    assert not admission_enforced("off", enforcing=True, pool=1000)
    assert not admission_enforced("projected", enforcing=False, pool=1000)  # dry run
    assert not admission_enforced("projected", enforcing=True, pool=None)


def test_critical_requests_may_fill_the_pool_and_wait_as_long_as_an_answer():
    """Critical requests get the whole pool and read_timeout_s; others the ratio and wait."""
    kwargs = {"admission_ratio": 0.9, "admission_wait_s": 5.0, "read_timeout_s": 600.0}
    assert admission_terms(critical=True, **kwargs) == AdmissionTerms(1.0, 600.0)
    assert admission_terms(critical=False, **kwargs) == AdmissionTerms(0.9, 5.0)


def test_a_request_waits_admission_wait_s_in_a_burst_and_overload_wait_s_in_overload():
    """A queue younger than the longest wait is a burst; an older one is overload."""
    # The first of a burst (the queue begins with it): the whole wait.
    assert admission_deadline(100.0, 100.0, 5.0, 0.25) == 105.0
    # One that comes 1 s into a queue: the queue is overload at 105, and the request
    # waits 0.25 s more (not until its own 5 s are up, at 106).
    assert admission_deadline(101.0, 100.0, 5.0, 0.25) == 105.25
    # One that comes 4.9 s into the queue: the queue is overload 0.1 s later.
    assert admission_deadline(104.9, 100.0, 5.0, 0.25) == pytest.approx(105.25)
    # One that comes to a queue older than admission_wait_s: overload_wait_s.
    assert admission_deadline(112.0, 100.0, 5.0, 0.25) == 112.25
    # overload_wait_s as long as admission_wait_s: the rule is off.
    assert admission_deadline(112.0, 100.0, 5.0, 5.0) == 117.0
    assert admission_deadline(0.0, 0.0, 0.0, 0.25) == 0.0  # no wait at all


@given(
    st.floats(0, 1e4),
    st.floats(0, 1e4),
    st.floats(0, 600),
    st.floats(0, 600),
)
def test_the_overload_rule_only_ever_shortens_a_wait(since, after, wait_s, overload_s):
    """Never later than the whole wait; never earlier than the shorter of the two waits."""
    arrived = since + after
    deadline = admission_deadline(arrived, since, wait_s, overload_s)
    assert deadline <= arrived + wait_s
    assert deadline >= arrived + min(wait_s, overload_s) - 1e-9
    if after >= wait_s:  # the queue was overload when it came
        assert deadline == pytest.approx(arrived + min(wait_s, overload_s))


def test_projected_admission_admits_what_fits_and_a_lone_critical_request():
    """What fits the ratio goes in; an unknown pool admits; a critical request may go in alone."""
    assert admits(10_000, 10_000, None, 0.9, critical=False)  # the pool went unknown: admit
    assert admits(0, 5000, 1000, 1.0, critical=True)  # too big, but alone: the engine takes it
    assert not admits(16, 5000, 1000, 1.0, critical=True)  # not alone: waits
    assert not admits(0, 5000, 1000, 0.9, critical=False)  # only critical goes in alone
    assert admits(400, 500, 1000, 0.9, critical=False)  # 900 <= 900
    assert not admits(416, 500, 1000, 0.9, critical=False)


def test_answers_are_cancelled_only_when_the_pool_would_not_last_until_kvguard_acts_again():
    """The engine's count plus what the answers write meanwhile, against the pool."""
    assert OVERRUN_READINGS_AHEAD == 2  # the next reading, and one more: it can come late
    # 7,000 held, the answers write 1,000 before kvguard can act again: 8,000 fits.
    assert overrun_cancels(7000, 1000, 8000, [1500, 1200], running=5) == 0
    # 7,100 + 1,000 would not: the first candidate goes (its 1,500 and a fifth of it all).
    assert overrun_cancels(7100, 1000, 8000, [1500, 1200], running=5) == 1
    # Small candidates: as many as it takes, and no more than there are.
    assert overrun_cancels(7950, 400, 8000, [50, 50, 50], running=4) == 3
    assert overrun_cancels(7950, 400, 8000, [50, 200, 50], running=4) == 2
    assert overrun_cancels(7950, 400, 8000, [50], running=4) == 1  # all there are
    # Nothing known about the pool: nothing cancelled.
    assert overrun_cancels(9000, 400, None, [100], running=1) == 0


@given(
    used=st.integers(0, 20_000),
    growth=st.integers(0, 5_000),
    pool=st.integers(1, 20_000),
    footprints=st.lists(st.integers(1, 3_000), max_size=20),
)
def test_overrun_cancels_the_fewest_that_make_the_pool_last(used, growth, pool, footprints):
    """After the cancels the pool lasts (unless every candidate went); one fewer would not."""
    running = len(footprints) + 3
    n = overrun_cancels(used, growth, pool, footprints, running)
    assert 0 <= n <= len(footprints)
    share = growth / running

    def lasts(k: int) -> bool:
        return used - sum(footprints[:k]) + max(growth - k * share, 0) <= pool

    assert n == len(footprints) or lasts(n)
    assert n == 0 or not lasts(n - 1)
    # pool_lasts is the same reckoning, for any number cut.
    for k in {0, n, len(footprints)}:
        assert pool_lasts(used, growth, pool, footprints, running, cancels=k) == lasts(k)


def test_answers_reserved_together_need_a_margin_that_grows_as_the_square_root():
    """100 answers expected at 200 ± 100: p95 of the total is 20,000 + 1.645 x 1,000."""
    assert pooled_reservation(50_000, 20_000, 100 * 100**2, 0.95) == 20_000 + 1645
    # One answer alone: its own margin, 1.645 standard deviations.
    assert pooled_reservation(500, 200, 100**2, 0.95) == 200 + 165
    # At most the sum of each at its own quantile: pooling only gives room back.
    assert pooled_reservation(300, 200, 100**2, 0.95) == 300
    # At the quantile 1 nothing is pooled; at 0.5 the expected total alone.
    assert pooled_reservation(50_000, 20_000, 10**6, 1.0) == 50_000
    assert pooled_reservation(50_000, 20_000, 10**6, 0.5) == 20_000


@given(
    st.lists(st.tuples(st.integers(0, 5000), st.floats(0, 1e6)), max_size=50),
    st.floats(0.5, 1.0),
)
def test_the_pooled_reservation_covers_the_expected_total_and_never_exceeds_each_alone(
    answers, quantile
):
    """Between the expected total and the sum of each alone; it grows with the quantile."""
    expected = sum(e for e, _ in answers)
    variance = sum(v for _, v in answers)
    each = expected + sum(math.ceil(3 * v**0.5) for _, v in answers)
    reserved = pooled_reservation(each, expected, variance, quantile)
    assert expected <= reserved <= each
    assert reserved <= pooled_reservation(each, expected, variance, min(1.0, quantile + 0.01))


def _held_at(growths: list[Growth], step: int) -> int:
    """What the set holds ``step`` steps from now, each request counted until it ends."""
    return sum(g.held + g.per_step * step for g in growths if step <= g.steps)


def _brute_peak(growths: list[Growth]) -> int:
    return max(
        (_held_at(growths, s) for s in range(max((g.steps for g in growths), default=0) + 1)),
        default=0,
    )


def test_the_envelope_peaks_just_before_an_end_not_at_the_sum_of_ends():
    """Two answers started apart: the set never holds both whole at once.

    A holds 100 and ends in 300 steps (at 400); B holds 50 and ends in 100 (at 150).
    Summed, 550; step by step, just before B ends they hold 200 + 150 = 350, and
    just before A ends, A alone: 400.
    """
    a, b = Growth(held=100, per_step=1, steps=300), Growth(held=50, per_step=1, steps=100)
    envelope = Envelope([a, b])
    assert envelope.peak == 400
    # A newcomer of 10 + 250 steps: its end (260) beside A's 100 + 250 = 350: 610;
    # before that, B's end: 200 + 150 + 110 = 460; A's end comes after it.
    assert envelope.peak_with(Growth(held=10, per_step=1, steps=250)) == 610
    # Started together and ending together, it is the sum: nothing is given back.
    same = [Growth(held=100, per_step=2, steps=50)] * 3
    assert Envelope(same).peak == 3 * (100 + 2 * 50)
    assert Envelope([]).peak == 0
    assert Envelope([]).peak_with(Growth(held=7, per_step=3, steps=5)) == 22


def test_a_growth_counts_each_sequence_s_last_block_whole():
    """4 sequences, 16-token blocks: 60 tokens more than held; 100 to go at 4 a step."""
    g = growth(held=200, final=600, sequences=4, block_size=16)
    assert g == Growth(held=200 + 15 * 4, per_step=4, steps=100)
    assert growth(held=700, final=600, sequences=1, block_size=1).steps == 0  # past it


_growths = st.lists(
    st.builds(
        Growth,
        held=st.integers(0, 500),
        per_step=st.integers(1, 4),
        steps=st.integers(0, 60),
    ),
    max_size=8,
)


@given(
    _growths,
    st.builds(
        Growth, held=st.integers(0, 500), per_step=st.integers(1, 4), steps=st.integers(0, 60)
    ),
)
def test_the_envelope_is_the_step_by_step_maximum_and_never_over_the_sum(growths, newcomer):
    """Against a brute-force walk over every step; and never more than the projections' sum."""
    envelope = Envelope(growths)
    assert envelope.peak == _brute_peak(growths)
    assert envelope.peak_with(newcomer) == _brute_peak([*growths, newcomer])
    summed = sum(g.held + g.per_step * g.steps for g in [*growths, newcomer])
    assert envelope.peak_with(newcomer) <= summed


def test_admits_takes_the_step_by_step_projection_when_given():
    """``with_it`` replaces in_flight + own; a lone critical request still goes in."""
    assert admits(900, 500, 1000, 1.0, critical=False, with_it=1000)
    assert not admits(900, 50, 1000, 1.0, critical=False, with_it=1001)
    assert admits(0, 5000, 1000, 1.0, critical=True, with_it=5000)


def test_the_spread_bound_is_the_mean_plus_z_deviations_of_each_interval():
    """Two requests over a grid of two intervals of 10 steps, by hand.

    A (100 held, 1 a step, 20 steps) is surely written: 110, then 120. B (50 held, 1
    a step, 20 steps) is still being written at step 10 with chance 1/2: at most 60
    in the first interval (chance 1), 70 in the second (chance 1/2: mean 35,
    variance 70^2/4). The peak is the second interval's 120 + 35 + z * 35.
    """
    grid = step_grid(20, 2)
    assert grid == [0, 10, 20]
    a = spread_terms(Growth(100, 1, 20), grid, None)
    b = spread_terms(Growth(50, 1, 20), grid, [1.0, 0.5])
    assert a == ([110.0, 120.0], [1.0, 1.0])
    assert b == ([60.0, 70.0], [1.0, 0.5])
    profile = SpreadProfile(grid, [a, b], z=1.645)
    assert profile.peak_with() == math.ceil(max(170, 120 + 35 + 1.645 * 35))
    # A newcomer surely written for 9 steps, then done: only the first interval grows.
    c = spread_terms(Growth(10, 1, 9), grid, None)
    assert c == ([19.0, 19.0], [1.0, 0.0])
    assert profile.peak_with(*c) == math.ceil(max(189, 120 + 35 + 1.645 * 35))


@given(
    _growths,
    st.builds(
        Growth, held=st.integers(0, 500), per_step=st.integers(1, 4), steps=st.integers(0, 60)
    ),
)
def test_with_every_end_certain_the_spread_bound_covers_every_step(growths, newcomer):
    """Surely-written requests: the spread bound is never under the step-by-step truth."""
    grid = step_grid(max([g.steps for g in [*growths, newcomer]]), 7)
    profile = SpreadProfile(grid, [spread_terms(g, grid, None) for g in growths], z=1.645)
    bound = profile.peak_with(*spread_terms(newcomer, grid, None))
    assert bound >= _brute_peak([*growths, newcomer])


@pytest.mark.parametrize(
    ("setting", "kind", "reports", "mode"),
    [
        ("auto", "vllm", True, "preempt"),
        # vLLM's names without its preemption counter: an engine that cannot preempt.
        ("auto", "vllm", False, "fail"),
        # SGLang's retraction counter appears only with its first retraction.
        ("auto", "sglang", False, "preempt"),
        ("auto", "llamacpp", False, "fail"),
        ("auto", "tgi", False, "fail"),
        ("auto", "trtllm", True, "fail"),
        ("auto", None, False, "fail"),
        ("fail", "vllm", True, "fail"),
        ("preempt", "llamacpp", False, "preempt"),
    ],
)
def test_what_the_engine_does_when_its_pool_runs_out(setting, kind, reports, mode):
    """``[engine] on_kv_exhaustion``: the operator's word, else the engine's kind and counter."""
    got, reason = kv_exhaustion(setting, kind, reports)
    assert got == mode
    assert reason  # said in the log event, so never empty
    if setting != "auto":
        assert reason == "[engine] on_kv_exhaustion"
