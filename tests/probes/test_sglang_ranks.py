"""SGLang across tensor-, pipeline- and data-parallel ranks, and with priority scheduling.

The fixtures (``tests/fixtures/engines/sglang-0.5.23-*.txt``) are written from SGLang
0.5.23's metrics collector, rank by rank as that source writes them; each file's header
names the lines it follows. Every scheduler writes ``max_total_num_tokens`` under its own
``tp_rank``/``pp_rank``, so adding the series over label sets counts one pool once per
rank; these tests pin one pool per ``dp_rank``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvguard.core.snapshot import EngineShare
from kvguard.probes.engines import ADAPTERS, EngineScrape

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "engines"


def parse(name: str):
    """The SGLang adapter's reading of one fixture."""
    return ADAPTERS["sglang"].parse(EngineScrape((FIXTURES / name).read_text()))


def test_tensor_parallel_ranks_are_one_pool():
    """TP=2: both ranks report the pool's capacity; it is counted once, not twice."""
    stats = parse("sglang-0.5.23-tp2.txt")
    assert stats.kv_capacity_tokens == 120_000
    assert stats.kv_capacity_blocks == 120_000  # page_size 1
    assert stats.kv_used_tokens == 30_000
    assert stats.kv_cache_usage_ratio == pytest.approx(0.25)
    assert (stats.requests_running, stats.requests_waiting) == (7, 2)
    assert stats.preemptions_total == 1
    assert stats.engines == ()


def test_pipeline_stages_hold_the_same_pool_and_requests():
    """TP=2 x PP=2: four capacity series and two stats series, all of one pool."""
    stats = parse("sglang-0.5.23-tp2-pp2.txt")
    assert stats.kv_capacity_tokens == 200_000
    # The stages hold the same requests a micro-batch apart: the fuller one counts.
    assert stats.kv_used_tokens == 150_000
    assert stats.kv_cache_usage_ratio == pytest.approx(0.75)
    assert (stats.requests_running, stats.requests_waiting) == (20, 5)
    assert stats.preemptions_total == 2
    assert stats.engines == ()


def test_data_parallel_pools_are_added():
    """DP=2 (attention DP, TP=4): two pools, each counted once; usage is the fuller pool's."""
    stats = parse("sglang-0.5.23-dp2.txt")
    assert stats.kv_capacity_tokens == 160_000
    assert stats.kv_used_tokens == 80_000
    assert stats.kv_cache_usage_ratio == pytest.approx(0.75)
    assert (stats.requests_running, stats.requests_waiting) == (14, 2)
    assert stats.preemptions_total == 3
    assert stats.engines == (
        EngineShare(
            index=0,
            kv_cache_usage_ratio=pytest.approx(0.75),
            kv_capacity_blocks=80_000,
            requests_running=10,
            requests_waiting=2,
            preemptions_total=3,
        ),
        EngineShare(
            index=1,
            kv_cache_usage_ratio=pytest.approx(0.25),
            kv_capacity_blocks=80_000,
            requests_running=4,
            requests_waiting=0,
            preemptions_total=0,
        ),
    )


def test_priority_breakdown_is_not_counted_twice():
    """Priority scheduling: the total under priority="" is read, the per-priority copies not."""
    stats = parse("sglang-0.5.23-priority.txt")
    assert (stats.requests_running, stats.requests_waiting) == (6, 4)
    assert stats.kv_capacity_tokens == 100_000
    assert stats.kv_used_tokens == 40_000
    assert stats.kv_cache_usage_ratio == pytest.approx(0.4)


def test_pipeline_stages_with_priorities_read_one_pool_and_each_request_once():
    """TP=2 x PP=2 with priority scheduling: one pool, and each request counted once.

    Four capacity series (priority=""), the stats of two stages for the same requests,
    and on each stage the request gauges three times over: the total (priority="") and
    per priority (0, 10). Read: 200,000 tokens, the fuller stage's 150,000 in use (0.75),
    20 running and 5 queued, not 2 x 2 x that.
    """
    stats = parse("sglang-0.5.23-tp2-pp2-priority.txt")
    assert stats.kv_capacity_tokens == 200_000
    assert stats.kv_capacity_blocks == 200_000  # page_size 1
    assert stats.kv_used_tokens == 150_000
    assert stats.kv_cache_usage_ratio == pytest.approx(0.75)
    assert (stats.requests_running, stats.requests_waiting) == (20, 5)
    assert stats.preemptions_total == 2
    assert stats.engines == ()
    # The same deployment without priorities reads the same.
    plain = parse("sglang-0.5.23-tp2-pp2.txt")
    for field in ("kv_capacity_tokens", "kv_used_tokens", "requests_running", "requests_waiting"):
        assert getattr(stats, field) == getattr(plain, field), field
