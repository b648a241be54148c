"""kvguard in the request path against the simulator: fewer preemptions; the OOM gap.

The full measurement (5 seeds per pattern, 16 s of each) is bench/proxy_efficacy.py,
with its results in bench/results/proxy_efficacy.json (measured with the engine in the
benchmark's event loop; it now starts the engine in its own process, and the figures
below are from before); this runs seed 1 on every CI run
(shorter, but for ``bursty_short``) and asserts only what the benchmark shows with a
wide margin:

* ``long_context``: without kvguard the growing conversations preempt 45-65 times in
  12 s; through kvguard (critical on time to exhaustion, then standard and sheddable
  traffic shed) the engine preempts at most a third as often. The benchmark measured
  0 on 5 of 5 seeds, but kvguard's margin there is timing: the usage sawtooth of
  conversations between turns can break the 3-tick confirmation, and once critical
  comes after the pool is full, shedding new turns does not stop the running ones
  from preempting (seen once, seed 1 with a 4 s warm-up: 126). Hence a third, not zero.
* ``bursty_short``: kvguard's admission (``observed``, the default) holds each request
  at the door until its reservation fits the pool, so the engine preempts at most half
  as often as without it (the benchmark: never), and an engine that crashes when its
  pool runs out survives the first burst, and at least 85% as many requests meet the
  SLO as without kvguard (a strict xfail while the engine ran in this test's event
  loop, where kvguard's CPU slowed it; it now runs in its own process).
* The crash mode (``oom_on_exhaust``): the first ``bursty_short`` burst crashes the
  engine in about 0.6 s without kvguard (asserted: it is the benchmark's premise).
  With ``[proxy]`` at its defaults kvguard does not prevent that crash (5 of 5 seeds
  crash through it too): the proxy only applies the shed floor the daemon sets once
  per poll, and the burst is in the engine before that. With ``admission =
  "projected"`` the proxy holds each request until its projected footprint fits the
  pool, and the same burst passes with no crash (asserted; seed 1's first burst is
  134 requests). The benchmark's one crash in 5 (seed 5, a burst of 256) came from
  critical requests skipping that check; since then they wait for room like the rest
  (never shed), which closes that path: re-run for the crash mode alone, seeds 1-5
  survive with 0 preemptions.
"""

from __future__ import annotations

import pytest

from bench.proxy_efficacy import measure

# Long wall-clock runs (20 s to minutes): the second stage of scripts/test.sh.
pytestmark = pytest.mark.slow

WARMUP_S = 3.0


async def test_kvguard_cuts_preemptions_for_long_context():
    """Seed 1, 12 s: the same conversations preempt far less through kvguard.

    Admission holds them to the pool; the ladder sees the cache rise and alerts
    (`elevated` at least: while admission guards the pool, the trend alone goes no
    higher).
    """
    direct = await measure("long_context", 1, mode="direct", pattern_s=12.0, warmup_s=WARMUP_S)
    guarded = await measure("long_context", 1, mode="kvguard", pattern_s=12.0, warmup_s=WARMUP_S)
    assert direct.preemptions >= 20, "the load never filled the pool: nothing to compare"
    assert guarded.peak_level in ("elevated", "high", "critical")
    assert guarded.preemptions <= direct.preemptions / 3, (direct.preemptions, guarded.timeline)


async def test_kvguard_cuts_preemptions_for_bursty_short():
    """Seed 1, 16 s (the benchmark's length): kvguard sheds after the first burst.

    The first burst is preempted through kvguard as without it; over 8 s it weighed so
    much that a loaded CI machine (ticks and proxy running late) came to 21 against 41.
    Over 16 s the later bursts, which kvguard does spare, dominate (the benchmark's
    seed 1: 21 against 101).
    """
    direct = await measure("bursty_short", 1, mode="direct", pattern_s=16.0, warmup_s=WARMUP_S)
    guarded = await measure("bursty_short", 1, mode="kvguard", pattern_s=16.0, warmup_s=WARMUP_S)
    assert direct.preemptions >= 40, "the bursts never filled the pool: nothing to compare"
    assert sum(guarded.proxy["shed"].values()) > 0
    assert guarded.preemptions <= 0.5 * direct.preemptions, (direct.preemptions, guarded.timeline)


async def test_shedding_the_excess_costs_no_goodput_for_bursty_short():
    """What is let in is served in time: goodput through kvguard >= 85% of direct's.

    An expected failure while the engine shared the benchmark's event loop (the
    proxy's CPU stretched the engine's steps); with the engine in its own process,
    as a real one runs, it holds (bench/analysis.md, "The engine in its own process").
    """
    direct = await measure("bursty_short", 1, mode="direct", pattern_s=16.0, warmup_s=WARMUP_S)
    guarded = await measure("bursty_short", 1, mode="kvguard", pattern_s=16.0, warmup_s=WARMUP_S)
    assert direct.preemptions >= 40, "the bursts never filled the pool: nothing to compare"
    assert guarded.load["goodput"] >= 0.85 * direct.load["goodput"], (direct.load, guarded.load)


async def test_an_oom_burst_crashes_the_engine_without_kvguard():
    """With ``oom_on_exhaust`` the first burst crashes the engine within a second."""
    run = await measure("bursty_short", 1, mode="direct", oom=True, pattern_s=3.0, warmup_s=2.0)
    assert run.crashed_at_s is not None
    assert run.crashed_at_s < 3.0  # idle: 0.52-0.62 s; the first burst, on a slow machine too


async def test_kvguard_at_its_defaults_keeps_the_oom_engine_alive_through_the_burst():
    """Through kvguard at its defaults (admission ``observed``) the burst crashes nothing."""
    run = await measure("bursty_short", 1, mode="kvguard", oom=True, pattern_s=3.0, warmup_s=2.0)
    assert run.crashed_at_s is None, run.crash_message
    assert run.load["succeeded"] > 0


async def test_projected_admission_keeps_the_oom_engine_alive_through_the_burst():
    """Through kvguard with ``admission = "projected"`` the same burst crashes nothing."""
    run = await measure(
        "bursty_short", 1, mode="kvguard_projected", oom=True, pattern_s=3.0, warmup_s=2.0
    )
    assert run.crashed_at_s is None, run.crash_message
    assert run.load["succeeded"] > 0
