"""The dry-run brain against the simulator under load: high before the first preemption.

The full measurement (10 seeds per pattern) is bench/lead_time.py, whose results are
in docs/how-it-works.md; this runs two seeds of each pattern on every CI run.
"""

from __future__ import annotations

import pytest

from bench.lead_time import measure

# Long wall-clock runs (20 s to minutes): the second stage of scripts/test.sh.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("seed", [1, 2])
async def test_long_context_reaches_high_before_the_first_preemption(seed):
    """Growing conversations: kvguard reaches high well before the pool fills."""
    run = await measure("long_context", seed, max_s=30.0)
    assert run.first_preemption_at_s is not None, "the load never filled the pool"
    assert run.lead_s is not None
    assert run.lead_s > 0.5


@pytest.mark.parametrize("seed", [1, 2])
async def test_bursty_short_reaches_high_within_one_poll_of_the_burst(seed):
    """A burst fills the pool in ~0.5 s; kvguard escalates on the first tick after it lands.

    On an idle machine that is before the first preemption (bench: 10 of 10 seeds);
    the assertion allows the one-poll blind spot (0.5 s) and as much again for a tick
    slowed by a loaded CI machine. The run goes on for 1.5 s after a preemption that
    came first, so a late ``high`` is timed rather than lost.
    """
    run = await measure("bursty_short", seed, max_s=30.0)
    assert run.first_preemption_at_s is not None, "the burst never filled the pool"
    assert run.peak_level in ("high", "critical")
    assert run.lead_s is not None
    assert run.lead_s > -1.0
