"""vLLM's own token figure (``kv_cache_size_tokens``) wins for hybrid and sliding models.

vLLM 0.19+ writes every CacheConfig field into ``vllm:cache_config_info``, including
``kv_cache_size_tokens``: "GPU KV cache size", which for a model with sliding-window
layers is max concurrency x max_model_len, not blocks x block size. The scrape here is
the real CPU capture with that series' figures set to those vLLM 0.19 printed for
Gemma-3-27B on an H100 (llm-d-planner's start-up log, tests/fixtures/budget/logs/
planner-gemma3-27b-it-h100.log: 15,997 blocks of 16, 36,560 tokens).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvguard.probes.engines import ADAPTERS
from kvguard.probes.engines.base import EngineScrape

CAPTURE = Path(__file__).parent.parent / "fixtures" / "engines" / "vllm-cpu-busy.txt"


def with_labels(**labels: str) -> str:
    """The real capture with ``vllm:cache_config_info``'s labels changed as given."""
    text = CAPTURE.read_text()
    for key, value in labels.items():
        text, count = re.subn(
            rf'(cache_config_info\{{[^}}]*\b{key}=)"[^"]*"', rf'\1"{value}"', text
        )
        assert count == 1, key
    return text


def test_a_sliding_window_pool_is_what_vllm_says_it_holds():
    """Capacity is vLLM's 36,560 tokens, not 15,997 x 16 = 255,952."""
    text = with_labels(num_gpu_blocks="15997", block_size="16", kv_cache_size_tokens="36560")
    stats = ADAPTERS["vllm"].parse(EngineScrape(text))
    assert stats.kv_capacity_tokens == 36_560
    assert stats.kv_capacity_blocks == 15_997
    assert stats.kv_used_tokens == round(stats.kv_cache_usage_ratio * 36_560)


def test_a_uniform_pool_reads_as_before():
    """Where vLLM's figure equals blocks x block size, nothing changes (the real capture)."""
    stats = ADAPTERS["vllm"].parse(EngineScrape(CAPTURE.read_text()))
    assert stats.kv_capacity_tokens == 16 * 128
    usage = stats.kv_cache_usage_ratio
    assert usage is not None
    # The null block vLLM keeps is not counted as usable.
    assert stats.kv_used_tokens == round(usage * 15 * 128)


@pytest.mark.parametrize("value", ["None", ""])
def test_an_unset_size_falls_back_to_blocks(value):
    """Before vLLM profiles, the label reads "None": blocks x block size, as before."""
    stats = ADAPTERS["vllm"].parse(EngineScrape(with_labels(kv_cache_size_tokens=value)))
    assert stats.kv_capacity_tokens == 16 * 128
