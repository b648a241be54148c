"""Traffic patterns: deterministic from a seed, bounded, and each with its own shape."""

from __future__ import annotations

import itertools
import random
import statistics
from collections import Counter, defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.errors import InvalidInputError
from kvguard.sim.traffic import (
    PATTERNS,
    PRIORITIES,
    PriorityShares,
    RequestSpec,
    TrafficParams,
    bursty_short,
    generate,
    long_context,
    new_message_tokens,
)


def specs(pattern: str, seed: int = 0, **params: object) -> list[RequestSpec]:
    """Every spec of a pattern for the given parameters."""
    return list(generate(pattern, seed=seed, params=TrafficParams(**params)))  # type: ignore[arg-type]


def by_conversation(items: list[RequestSpec]) -> dict[int, list[RequestSpec]]:
    """Conversation turns grouped by conversation, in order."""
    groups: dict[int, list[RequestSpec]] = defaultdict(list)
    for spec in items:
        if spec.conversation is not None:
            groups[spec.conversation].append(spec)
    return groups


def test_patterns_are_documented():
    """Every pattern name has a description and a generator that yields requests."""
    assert set(PATTERNS) == {
        "steady",
        "bursty_short",
        "long_context",
        "prefill_heavy",
        "decode_heavy",
        "ramp",
        "mixed",
    }
    for name, text in PATTERNS.items():
        assert text
        assert specs(name, duration_s=20), name


@settings(max_examples=25, deadline=None)
@given(pattern=st.sampled_from(sorted(PATTERNS)), seed=st.integers(0, 2**32))
def test_same_seed_gives_the_same_specs(pattern, seed):
    """Two streams with the same seed and parameters are identical."""
    assert specs(pattern, seed, duration_s=10) == specs(pattern, seed, duration_s=10)


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_different_seeds_give_different_specs(pattern):
    """Another seed gives another stream."""
    assert specs(pattern, 1, duration_s=20) != specs(pattern, 2, duration_s=20)


@settings(max_examples=60, deadline=None)
@given(
    pattern=st.sampled_from(sorted(PATTERNS)),
    seed=st.integers(0, 2**32),
    duration_s=st.floats(0.1, 15),
    scale=st.floats(0.001, 3),
    max_context=st.integers(2, 20_000),
)
def test_every_spec_is_within_bounds(pattern, seed, duration_s, scale, max_context):
    """Arrivals are ordered and before the duration; sizes are >= 1 and fit the context."""
    items = specs(pattern, seed, duration_s=duration_s, scale=scale, max_context=max_context)
    times = [s.at_s for s in items]
    assert times == sorted(times)
    for spec in items:
        assert 0 <= spec.at_s < duration_s
        assert spec.prompt_tokens >= 1
        assert spec.output_tokens >= 1
        assert spec.prompt_tokens + spec.output_tokens <= max_context
        assert spec.priority in PRIORITIES
        assert spec.turn >= 0
        if spec.conversation is None:
            assert spec.turn == 0


@settings(max_examples=30, deadline=None)
@given(
    pattern=st.sampled_from(sorted(PATTERNS)),
    seed=st.integers(0, 2**32),
    scale=st.floats(0.01, 2),
)
def test_scale_multiplies_every_size(pattern, seed, scale):
    """With no context cap in the way, each size is the unscaled size times scale (>= 1)."""
    big = 10_000_000
    plain = specs(pattern, seed, duration_s=5, max_context=big)
    scaled = specs(pattern, seed, duration_s=5, scale=scale, max_context=big)
    assert len(plain) == len(scaled)
    for a, b in zip(plain, scaled, strict=True):
        if a.conversation is None:  # conversation prompts sum scaled parts, rounded each
            assert b.prompt_tokens == max(1, round(a.prompt_tokens * scale))
        assert b.output_tokens == max(1, round(a.output_tokens * scale))
        assert b.at_s == a.at_s


def test_bursty_short_arrives_in_bursts_of_short_requests():
    """Many requests within a fraction of a second, then a quiet gap; thousands a minute."""
    items = specs("bursty_short", 7, duration_s=60)
    assert len(items) >= 1000
    starts = [0, *(i for i in range(1, len(items)) if items[i].at_s - items[i - 1].at_s > 1)]
    bursts = [items[a:b] for a, b in zip(starts, [*starts[1:], len(items)], strict=True)]
    assert 12 <= len(bursts) <= 40
    for burst in bursts[:-1]:  # the last one may be cut by the duration
        assert len(burst) >= 100
        assert burst[-1].at_s - burst[0].at_s <= 0.05 + 1e-9
    assert all(50 <= s.prompt_tokens <= 300 and 20 <= s.output_tokens <= 100 for s in items)


def test_bursty_short_parameters_shape_the_bursts():
    """Burst size, spread and gap come from the parameters; the first burst starts at 0."""
    rng = random.Random(3)
    params = TrafficParams(duration_s=30)
    items = list(bursty_short(rng, params, burst_min=5, burst_max=5, mean_gap_s=1, spread_s=0.01))
    assert items[0].at_s < 0.01
    gaps = [b.at_s - a.at_s for a, b in itertools.pairwise(items)]
    quiet = [gap for gap in gaps if gap > 0.01]
    assert all(0.5 <= gap <= 1.5 + 0.01 for gap in quiet)
    assert len(quiet) == len(items) // 5 - 1 + (len(items) % 5 > 0)
    assert 18 < len(items) // 5 < 60


def test_long_context_conversations_grow_turn_by_turn_and_restart():
    """Each turn's prompt is the previous prompt + answer + a new message, under max_context."""
    items = specs("long_context", 5, duration_s=120, scale=0.05, max_context=300)
    conversations = by_conversation(items)
    assert 4 <= len(conversations) <= 8
    restarts = 0
    for turns in conversations.values():
        assert turns[0].turn == 0
        for prev, spec in itertools.pairwise(turns):
            assert spec.at_s > prev.at_s
            if spec.turn == 0:
                restarts += 1
                continue
            assert spec.turn == prev.turn + 1
            message = new_message_tokens(spec, prev)
            assert message >= 1
            assert spec.prompt_tokens == prev.prompt_tokens + prev.output_tokens + message
            assert spec.prompt_tokens > prev.prompt_tokens
        for spec in turns:
            assert spec.prompt_tokens + spec.output_tokens <= 300
    assert restarts >= 4


def test_long_context_reaches_toward_the_context_limit():
    """Before a restart a conversation has filled most of its context."""
    items = specs("long_context", 9, duration_s=600, scale=0.1, max_context=2000)
    for turns in by_conversation(items).values():
        peaks = [
            prev.prompt_tokens + prev.output_tokens
            for prev, spec in itertools.pairwise(turns)
            if spec.turn == 0
        ]
        assert peaks
        # A restart means one more message (at most 400 x 0.1 = 40 tokens) and a
        # 1-token answer would not fit.
        assert all(peak + 40 + 1 > 2000 for peak in peaks)


def test_long_context_number_of_conversations_is_a_parameter():
    """`conversations` fixes how many run side by side, numbered from `first_conversation`."""
    rng = random.Random(0)
    items = list(long_context(rng, TrafficParams(duration_s=10), conversations=2))
    assert {s.conversation for s in items} == {0, 1}
    rng = random.Random(0)
    items = list(
        long_context(rng, TrafficParams(duration_s=10), conversations=3, first_conversation=10)
    )
    assert {s.conversation for s in items} == {10, 11, 12}


def test_prefill_heavy_prompts_dwarf_answers():
    """Prompts of 2k-8k tokens, answers of at most 128."""
    items = specs("prefill_heavy", 1, duration_s=60, max_context=100_000)
    assert len(items) > 50
    assert all(2000 <= s.prompt_tokens <= 8000 and s.output_tokens <= 128 for s in items)
    assert statistics.mean(s.prompt_tokens for s in items) > 20 * statistics.mean(
        s.output_tokens for s in items
    )


def test_decode_heavy_answers_dwarf_prompts():
    """Prompts of at most 200 tokens, answers of 500-2000."""
    items = specs("decode_heavy", 1, duration_s=60)
    assert len(items) > 50
    assert all(s.prompt_tokens <= 200 and 500 <= s.output_tokens <= 2000 for s in items)
    assert statistics.mean(s.output_tokens for s in items) > 5 * statistics.mean(
        s.prompt_tokens for s in items
    )


def test_ramp_rate_rises_over_the_duration():
    """Each quarter of the run holds more arrivals than the one before."""
    items = specs("ramp", 4, duration_s=40)
    quarters = Counter(int(s.at_s // 10) for s in items)
    counts = [quarters[q] for q in range(4)]
    assert counts == sorted(counts)
    assert counts[3] > 3 * counts[0]
    # Expected arrivals: the integral of 1 + 49 t / 40 over 40 s = 1020.
    assert 900 < len(items) < 1150


def test_steady_rate_is_constant():
    """About 4 arrivals a second, the same in each half of the run."""
    items = specs("steady", 2, duration_s=200)
    assert 700 < len(items) < 900
    first = sum(s.at_s < 100 for s in items)
    assert abs(first - (len(items) - first)) < 0.15 * len(items)


def test_mixed_blends_conversations_and_one_shot_requests():
    """The blend holds conversations, short bursts, and prefill- and decode-heavy requests."""
    items = specs("mixed", 11, duration_s=60, max_context=100_000)
    assert 2 <= len(by_conversation(items)) <= 3
    one_shot = [s for s in items if s.conversation is None]
    assert any(s.prompt_tokens >= 2000 and s.output_tokens <= 128 for s in one_shot)
    assert any(s.output_tokens >= 500 and s.prompt_tokens <= 200 for s in one_shot)
    assert sum(s.prompt_tokens <= 300 and s.output_tokens <= 100 for s in one_shot) > 100


def test_default_priority_shares_are_respected():
    """10 % critical, 60 % standard, 30 % sheddable, within sampling noise."""
    items = specs("bursty_short", 3, duration_s=120)
    counts = Counter(s.priority for s in items)
    assert len(items) > 5000
    for name, share in PriorityShares().as_dict().items():
        assert abs(counts[name] / len(items) - share) < 0.03, name


@given(
    shares=st.tuples(st.floats(0, 10), st.floats(0, 10), st.floats(0, 10)).filter(
        lambda t: sum(t) > 0.1
    ),
    seed=st.integers(0, 1000),
)
@settings(max_examples=30, deadline=None)
def test_a_class_with_no_share_is_never_drawn(shares, seed):
    """Shares are normalized; a zero share never appears."""
    mix = PriorityShares(*shares)
    rng = random.Random(seed)
    drawn = {mix.draw(rng) for _ in range(200)}
    assert drawn <= {name for name, share in mix.as_dict().items() if share > 0}


def test_custom_shares_shift_the_mix():
    """All-critical traffic is all critical."""
    items = specs("steady", 0, duration_s=20, shares=PriorityShares(1, 0, 0))
    assert {s.priority for s in items} == {"critical"}


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"duration_s": 0}, "duration_s"),
        ({"duration_s": float("inf")}, "duration_s"),
        ({"scale": 0}, "scale"),
        ({"scale": float("nan")}, "scale"),
        ({"max_context": 1}, "max_context"),
    ],
)
def test_bad_parameters_are_refused(params, field):
    """Out-of-range parameters raise InvalidInputError naming the field."""
    with pytest.raises(InvalidInputError) as caught:
        TrafficParams(**params)
    assert caught.value.field == field


def test_bad_shares_and_unknown_patterns_are_refused():
    """Negative or all-zero shares and unknown pattern names are errors."""
    with pytest.raises(InvalidInputError):
        PriorityShares(-1, 1, 1)
    with pytest.raises(InvalidInputError):
        PriorityShares(0, 0, 0)
    with pytest.raises(InvalidInputError) as caught:
        generate("tsunami", seed=0)
    assert caught.value.field == "pattern"
