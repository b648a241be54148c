"""The ladder: levels with hysteresis, actions per pattern, cooldowns, fp8 and release."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.core.forecast import Forecast, ResourceForecast
from kvguard.core.policy import LEVELS, GuardState, PolicyConfig, decide

CAPACITY = 100_000.0
POLICY = PolicyConfig()


# Prompt tokens waiting in the engine's queue, unless a test says: too few to change the
# demand (the level below stays what is in use, so reasons read kv_usage).
QUEUED = 1.0


def fc(
    usage: float,
    tte: float = math.inf,
    gpu_free: float = 0.5,
    preemptions: float = 0.0,
    queued: float = QUEUED,
) -> Forecast:
    """A forecast of KV usage, time to exhaustion, GPU free share, preemptions and queue.

    By default something waits in the engine's queue (``queued`` prompt tokens): a
    cache past ``elevated``'s usage then binds (``binding_of``).
    """
    used = usage * CAPACITY
    kv = ResourceForecast(used, CAPACITY, CAPACITY * 0.98, 0.0, {}, tte)
    gpu = ResourceForecast((1 - gpu_free) * 80.0, 80.0, 79.0, 0.0, {}, math.inf)
    return Forecast(
        kv=kv,
        gpu=gpu,
        kv_used_tokens=used,
        preemptions_per_s=preemptions,
        queue_demand_tokens=queued,
    )


def run(usages, *, pattern="steady", policy=POLICY, state=None, dt=0.5, start=0.0):
    """Decide once per usage value, dt apart; returns the decisions."""
    state = state or GuardState()
    decisions = []
    for i, usage in enumerate(usages):
        d = decide(
            start + i * dt, fc(usage) if isinstance(usage, float) else usage, pattern, policy, state
        )
        decisions.append(d)
        state = d.state
    return decisions


def test_calm_stays_ok_with_no_plan():
    """Low usage, no trend: ok, nothing to do."""
    decisions = run([0.3] * 10)
    assert {d.level for d in decisions} == {"ok"}
    assert all(d.plan == () for d in decisions)


def test_escalation_needs_confirm_ticks():
    """A level is entered only after confirm_ticks consecutive ticks past its threshold."""
    levels = [d.level for d in run([0.92, 0.92, 0.92])]
    assert levels == ["ok", "ok", "high"]
    assert [d.level for d in run([0.92, 0.5, 0.92, 0.92])] == ["ok", "ok", "ok", "ok"]


@pytest.mark.parametrize(
    ("pattern", "kind", "detail"),
    [
        ("long_context", "tighten_window", ("max_prompt_tokens", "max_tokens")),
        ("bursty_short", "shed", ("priority", "sheddable")),
        ("prefill_heavy", "tighten_window", ("max_prompt_tokens",)),
        ("decode_heavy", "tighten_window", ("max_tokens",)),
        ("steady", "shed", ("priority", "sheddable")),
    ],
)
def test_the_ladder_picks_the_patterns_first_action(pattern, kind, detail):
    """At high, each pattern gets its first response (docs/how-it-works.md, the ladder)."""
    decision = run([0.92] * 3, pattern=pattern)[-1]
    assert decision.level == "high"
    first = decision.plan[0]
    assert first.kind == kind
    if kind == "shed":
        assert first.priority == "sheddable"
    else:
        for name in detail:
            assert getattr(first, name) == 10_000  # 10% of the 100,000-token pool
    assert "high: kv_usage 0.920 >= 0.900" in decision.crossed


def test_critical_long_context_escalates_to_evict_and_cancel():
    """At critical, long_context tightens further, evicts and cancels the largest."""
    decision = run([0.99] * 3, pattern="long_context")[-1]
    assert decision.level == "critical"
    kinds = [a.kind for a in decision.plan]
    assert kinds == ["tighten_window", "evict", "cancel_largest"]
    assert decision.plan[0].max_tokens == 5_000


def test_bursty_critical_sheds_standard_traffic():
    """bursty_short at critical sheds standard (and so sheddable) traffic."""
    decision = run([0.99] * 3, pattern="bursty_short")[-1]
    assert [(a.kind, a.priority) for a in decision.plan] == [("shed", "standard")]


def test_a_trend_alone_never_escalates():
    """A short time to exhaustion at low usage stays ok; with usage it escalates, so far."""
    assert run([fc(0.3, tte=5.0)] * 5)[-1].level == "ok"
    # Past tte_min_usage the trend raises the level to high (act before the pool fills)...
    assert run([fc(0.6, tte=5.0)] * 5)[-1].level == "high"
    assert run([fc(0.6, tte=5.0, queued=0.0)] * 5)[-1].level == "high"
    # ...but a trend alone never reaches critical: it takes a cache past high's usage.
    assert run([fc(0.85, tte=5.0)] * 5)[-1].level == "high"
    assert run([fc(0.92, tte=5.0)] * 5)[-1].level == "critical"


def test_with_admission_guarding_the_pool_a_kv_trend_only_alerts():
    """The proxy checks every request against the pool: the trend alone cannot exhaust it.

    The same rising cache at 60% that reaches high without admission only reaches
    elevated (an alert, nothing shed); usage past high's threshold still escalates.
    """

    def guarded(forecast, n=5):
        state, d = GuardState(), None
        for i in range(n):
            d = decide(i * 0.5, forecast, "steady", POLICY, state, admission_guards=True)
            state = d.state
        return d

    rising = guarded(fc(0.6, tte=5.0))
    assert rising.level == "elevated"
    assert rising.plan == ()
    assert guarded(fc(0.92, tte=5.0)).level in ("high", "critical")
    assert run([fc(0.6, tte=5.0)] * 5)[-1].level == "high"  # unguarded, as before


def test_hysteresis_does_not_flap_on_a_sawtooth():
    """Usage alternating 0.88/0.91 around the 0.90 threshold: high once, then stays high."""
    decisions = run([0.91, 0.91, 0.91] + [0.88, 0.91] * 100)
    changes = [d for d in decisions if d.level != d.previous_level]
    assert [(c.previous_level, c.level) for c in changes] == [("ok", "high")]


def test_stepping_down_takes_a_hold_time_per_level():
    """From critical, calm steps down one level per hold time, never straight to ok."""
    decisions = run([0.99] * 3 + [0.2] * 200, pattern="bursty_short")
    changes = [
        (round(d.t, 1), d.previous_level, d.level) for d in decisions if d.level != d.previous_level
    ]
    assert [c[1:] for c in changes] == [
        ("ok", "critical"),
        ("critical", "high"),
        ("high", "elevated"),
        ("elevated", "ok"),
    ]
    times = [c[0] for c in changes]
    assert all(later - earlier >= POLICY.hold_s for earlier, later in itertools.pairwise(times[1:]))


def test_mitigations_are_released_when_no_longer_needed():
    """Stepping down from high undoes the shed it put in force."""
    decisions = run([0.92] * 3 + [0.2] * 100, pattern="bursty_short")
    released = [a for d in decisions for a in d.plan if a.kind == "release"]
    assert [(a.target, a.kind) for a in released] == [("shed", "release")]
    assert decisions[-1].state.active == {}


def test_a_disabled_action_falls_through():
    """With tighten_window disabled, long_context at high sheds sheddable traffic instead."""
    policy = replace(POLICY, disabled=frozenset({"tighten_window"}))
    decision = run([0.92] * 3, pattern="long_context", policy=policy)[-1]
    assert [(a.kind, a.priority) for a in decision.plan] == [("shed", "sheddable")]
    policy = replace(POLICY, disabled=frozenset({"evict", "cancel_largest"}))
    decision = run([0.99] * 3, pattern="long_context", policy=policy)[-1]
    assert [a.kind for a in decision.plan] == ["tighten_window", "shed"]


def test_one_shot_actions_respect_their_cooldown():
    """Eviction repeats at critical only every cooldown; the wait is recorded as deferred."""
    decisions = run([0.99] * 130, pattern="long_context")  # 65 s at critical
    evicts = [d.t for d in decisions if any(a.kind == "evict" for a in d.plan)]
    assert evicts[0] == 1.0
    assert all(b - a >= POLICY.cooldowns_s["evict"] for a, b in itertools.pairwise(evicts))
    assert len(evicts) == 3
    assert any("evict: cooldown" in d.deferred for d in decisions)


def test_fp8_after_sustained_pressure_and_revert_after_long_calm():
    """kv_fp8 after fp8_after_s at high or worse; revert_kv_fp8 after fp8_revert_calm_s of ok."""
    policy = replace(POLICY, fp8_after_s=60.0, fp8_revert_calm_s=120.0, hold_s=10.0)
    decisions = run([0.92] * 200 + [0.2] * 600, pattern="long_context", policy=policy, dt=1.0)
    fp8 = [d.t for d in decisions if any(a.kind == "kv_fp8" for a in d.plan)]
    revert = [d.t for d in decisions if any(a.kind == "revert_kv_fp8" for a in d.plan)]
    assert fp8 == [62.0]  # entered high at t=2, sustained 60 s
    ok_at = next(d.t for d in decisions if d.level == "ok" and d.previous_level == "elevated")
    assert revert == [ok_at + 120.0]


def test_restarts_are_capped_per_hour():
    """No more than max_restarts_per_hour kv_fp8/revert restarts in any hour."""
    policy = replace(
        POLICY,
        fp8_after_s=10.0,
        fp8_revert_calm_s=10.0,
        hold_s=5.0,
        cooldowns_s={**POLICY.cooldowns_s, "kv_fp8": 0.0, "revert_kv_fp8": 0.0},
    )
    cycle = [0.92] * 40 + [0.2] * 60
    decisions = run(cycle * 20, pattern="bursty_short", policy=policy, dt=1.0)  # 2,000 s
    restarts = [
        d.t for d in decisions if any(a.kind in ("kv_fp8", "revert_kv_fp8") for a in d.plan)
    ]
    for t in restarts:
        assert sum(t - 3600 < u <= t for u in restarts) <= policy.max_restarts_per_hour
    assert any("restart cap reached" in s for d in decisions for s in d.deferred)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0.0, 1.0), min_size=1, max_size=30),
    st.floats(0.0, 1.0),
    st.sampled_from(["long_context", "bursty_short", "prefill_heavy", "decode_heavy", "steady"]),
)
def test_decide_is_deterministic_and_more_usage_never_lowers_the_level(history, usage, pattern):
    """Same inputs, same decision; from any state, higher usage never gives a lower level."""
    state = run([float(u) for u in history], pattern=pattern)[-1].state
    now = len(history) * 0.5
    a = decide(now, fc(usage), pattern, POLICY, state)
    b = decide(now, fc(usage), pattern, POLICY, state)
    assert a == b
    more = decide(now, fc(min(1.0, usage + 0.05)), pattern, POLICY, state)
    assert LEVELS.index(more.level) >= LEVELS.index(a.level)


def test_a_queue_that_overflows_the_pool_escalates_at_once():
    """Queued prompts count as demand; demand past the pool needs no confirmation."""
    kv = ResourceForecast(0.3 * CAPACITY + 0.9 * CAPACITY, CAPACITY, CAPACITY * 0.98, 0.0, {}, 0.0)
    gpu = ResourceForecast(None, None, None, None)
    burst = Forecast(
        kv=kv, gpu=gpu, kv_used_tokens=0.3 * CAPACITY, queue_demand_tokens=0.9 * CAPACITY
    )
    decision = decide(0.0, burst, "bursty_short", POLICY, GuardState())
    assert decision.level == "critical"
    assert decision.binding == "kv_cache"
    assert "critical: kv_demand 1.200 >= 0.970" in decision.crossed
    assert [(a.kind, a.priority) for a in decision.plan] == [("shed", "standard")]


def test_a_full_pool_nothing_waits_for_is_an_alert_not_pressure():
    """Usage past high with an empty queue and no preemption: elevated, nothing shed.

    An engine running its pool at 92% with nothing waiting is using what it paid
    for; shedding then would only lose requests (the underload control's peaks).
    """
    decisions = run([fc(0.92, queued=0.0)] * 10)
    assert {d.level for d in decisions[2:]} == {"elevated"}
    assert all(d.plan == () for d in decisions)
    assert {d.binding for d in decisions} == {"none"}


def test_a_queue_with_room_in_the_cache_is_compute_and_never_sheds():
    """A long queue while the cache has room: compute binds; no KV level past elevated."""
    decisions = run([fc(0.4, tte=5.0, queued=0.5 * CAPACITY)] * 10)
    assert {d.binding for d in decisions} == {"compute"}
    assert all(d.plan == () for d in decisions)
    assert all(d.level in ("ok", "elevated") for d in decisions)


def test_preemptions_mean_the_kv_cache_binds_whatever_the_usage():
    """The engine evicting running sequences is the KV cache turning work away."""
    decision = run([fc(0.5, preemptions=3.0, queued=0.0)] * 3)[-1]
    assert decision.binding == "kv_cache"
    assert decision.level == "critical"


def test_a_window_cap_never_goes_under_a_typical_request():
    """The cap is the larger of its share of the pool and a typical request's size."""
    forecast = fc(0.92)
    state = GuardState()
    for t in (0.0, 0.5, 1.0):
        decision = decide(t, forecast, "long_context", POLICY, state, typical_request_tokens=23_456)
        state = decision.state
    window = next(a for a in decision.plan if a.kind == "tighten_window")
    assert (window.max_prompt_tokens, window.max_tokens) == (23_456, 23_456)
    # Without a typical size, the share of the pool (10% of 100,000) as before.
    decision = run([0.92] * 3, pattern="long_context")[-1]
    assert next(a for a in decision.plan if a.kind == "tighten_window").max_tokens == 10_000


def test_requests_held_at_the_door_mean_the_kv_cache_binds():
    """The proxy's own queue is KV pressure the engine's queue no longer shows."""
    decision = decide(
        0.0, fc(0.6, queued=0.0), "steady", POLICY, GuardState(), admission_waiting=12
    )
    assert decision.binding == "kv_cache"
    assert decision.signals.admission_waiting == 12
    # Admission already holds them to the pool: the ladder does not shed on top of it.
    state = GuardState()
    for t in (0.0, 0.5, 1.0, 1.5):
        decision = decide(t, fc(0.95, queued=0.0), "steady", POLICY, state, admission_waiting=12)
        state = decision.state
    assert decision.binding == "kv_cache"
    assert decision.level == "elevated"
    assert decision.plan == ()
