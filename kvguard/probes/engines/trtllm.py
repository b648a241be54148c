"""TensorRT-LLM behind Triton: ``nv_trt_llm_*`` families into :class:`EngineStats`.

Triton packs the batch manager's statistics into a few gauge families told apart
by one label (``kv_cache_block_type``, ``request_type``), each also labelled with
the Triton ``model`` and ``version``; values are added over those.
"""

from __future__ import annotations

from kvguard.core.snapshot import EngineAction, EngineKind, EngineStats
from kvguard.probes.engines.base import EngineScrape, as_int, parse_exposition, ratio

KV_BLOCKS = "nv_trt_llm_kv_cache_block_metrics"
REQUESTS = "nv_trt_llm_request_metrics"
READS = frozenset({KV_BLOCKS, REQUESTS})


class TrtllmAdapter:
    """TensorRT-LLM's Triton metrics; Triton offers no admin actions for the KV cache."""

    kind: EngineKind = "trtllm"
    actions: frozenset[EngineAction] = frozenset()
    extra_paths: tuple[str, ...] = ()
    health_path: str = "/v2/health/ready"
    reads: frozenset[str] | None = READS

    def parse(self, scrape: EngineScrape) -> EngineStats:
        """Normalize one Triton scrape."""
        samples = parse_exposition(scrape.metrics_text, self.reads)
        max_blocks = as_int(samples.total(KV_BLOCKS, kv_cache_block_type="max"))
        used_blocks = as_int(samples.total(KV_BLOCKS, kv_cache_block_type="used"))
        # Every model instance of one engine uses one block size.
        tokens_per = as_int(samples.highest(KV_BLOCKS, kv_cache_block_type="tokens_per"))
        usage = ratio(used_blocks, max_blocks)
        if usage is None:  # Triton's own ratio, when the block counts are missing
            usage = samples.highest_ratio(KV_BLOCKS, kv_cache_block_type="fraction")
        return EngineStats(
            kind="trtllm",
            up=scrape.healthy,
            kv_cache_usage_ratio=usage,
            kv_capacity_tokens=_times(max_blocks, tokens_per),
            kv_capacity_blocks=max_blocks,
            block_size=tokens_per or None,
            kv_used_tokens=_times(used_blocks, tokens_per),
            requests_running=samples.total(REQUESTS, request_type="active"),
            requests_waiting=samples.total(REQUESTS, request_type="waiting"),
        )


def _times(blocks: int | None, tokens_per_block: int | None) -> int | None:
    if blocks is None or not tokens_per_block:
        return None
    return blocks * tokens_per_block
