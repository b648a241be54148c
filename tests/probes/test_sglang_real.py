"""SGLang's adapter on a real SGLang 0.5.23 page, captured on this CPU-only machine.

``sglang-0.5.23-cpu-real.txt``: tp 1, ``--max-total-tokens 4096``, after two requests
(5 prompt and 13 generated tokens), 3 tokens still held in the pool. It shows two things
the pages written from source did not: ``token_usage`` is rounded to 2 decimals (0.0
while 3 of 4,096 tokens are used), and the retraction counter is absent until the
first retraction (only its gauge twin is written).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvguard.probes.engines import ADAPTERS, EngineScrape, detect_kind

PAGE = (Path(__file__).parent.parent / "fixtures/engines/sglang-0.5.23-cpu-real.txt").read_text()


def parse(text: str):
    """The SGLang adapter's reading of ``text``."""
    return ADAPTERS["sglang"].parse(EngineScrape(text))


def test_the_real_page_is_read_whole():
    """Kind, capacity, tokens in use, queue and counters, as the page says them."""
    assert detect_kind(PAGE) == "sglang"
    stats = parse(PAGE)
    assert (stats.kv_capacity_tokens, stats.kv_used_tokens, stats.block_size) == (4096, 3, 1)
    assert (stats.requests_running, stats.requests_waiting) == (0, 0)
    assert (stats.prompt_tokens_total, stats.generation_tokens_total) == (5, 13)
    assert stats.requests_finished_total == 2


def test_usage_is_the_unrounded_full_usage_not_the_rounded_token_usage():
    """token_usage says 0.0; full_token_usage says 3/4096, which is what is in use."""
    assert 'token_usage{engine_type="unified"' in PAGE  # the rounded one is there
    assert parse(PAGE).kv_cache_usage_ratio == pytest.approx(3 / 4096)
    # A release without the unrounded gauges: token_usage as written.
    lines = [line for line in PAGE.splitlines() if "full_token_usage" not in line]
    without = [line for line in lines if "swa_token_usage" not in line]
    assert parse("\n".join(without) + "\n").kv_cache_usage_ratio == 0.0


def test_no_retraction_yet_reads_zero_not_unknown():
    """The counter is written from the first retraction on; before it, its gauge says 0."""
    assert "num_retracted_requests_total" not in PAGE
    assert parse(PAGE).preemptions_total == 0
    # Neither family (an older release): unknown, not 0.
    older = "\n".join(line for line in PAGE.splitlines() if "retracted_reqs" not in line)
    assert parse(older + "\n").preemptions_total is None


def test_a_full_usage_that_is_not_token_usage_unrounded_is_not_used():
    """If token_usage is not the full/SWA figure rounded (another meaning), it stays."""
    text = PAGE.replace(
        'sglang:token_usage{engine_type="unified",model_name="tiny-llama",moe_ep_rank="0",'
        'pp_rank="0",tp_rank="0"} 0.0',
        'sglang:token_usage{engine_type="unified",model_name="tiny-llama",moe_ep_rank="0",'
        'pp_rank="0",tp_rank="0"} 0.25',
    )
    assert text != PAGE
    assert parse(text).kv_cache_usage_ratio == 0.25
