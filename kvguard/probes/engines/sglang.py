"""SGLang: ``sglang:*`` series into :class:`EngineStats`.

SGLang reports its KV pool in tokens (``max_total_num_tokens``, ``num_used_tokens``)
and pages of ``page_size`` tokens; it has no ``cache_config_info``. Series carry
``model_name`` and ``tp_rank`` (and, with data-parallel attention, a rank per
pool): tokens and counts are added over label sets, usage is the highest one.
"""

from __future__ import annotations

from kvguard.core.snapshot import EngineAction, EngineKind, EngineStats
from kvguard.probes.engines.base import EngineScrape, as_int, parse_exposition

READS = frozenset(
    {
        "sglang:max_total_num_tokens",
        "sglang:page_size",
        "sglang:token_usage",
        "sglang:num_used_tokens",
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:num_retracted_requests_total",
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:num_requests_total",
    }
)


class SglangAdapter:
    """SGLang's metrics (served with ``--enable-metrics``)."""

    kind: EngineKind = "sglang"
    actions: frozenset[EngineAction] = frozenset({"evict", "pause", "abort"})
    extra_paths: tuple[str, ...] = ()
    health_path: str = "/health"
    reads: frozenset[str] | None = READS

    def parse(self, scrape: EngineScrape) -> EngineStats:
        """Normalize one SGLang scrape."""
        samples = parse_exposition(scrape.metrics_text, self.reads)
        capacity = as_int(samples.total("sglang:max_total_num_tokens"))
        page_size = as_int(samples.highest("sglang:page_size"))
        return EngineStats(
            kind="sglang",
            up=scrape.healthy,
            kv_cache_usage_ratio=samples.highest_ratio("sglang:token_usage"),
            kv_capacity_tokens=capacity,
            kv_capacity_blocks=(
                capacity // page_size if capacity is not None and page_size else None
            ),
            block_size=page_size or None,
            kv_used_tokens=as_int(samples.total("sglang:num_used_tokens")),
            requests_running=samples.total("sglang:num_running_reqs"),
            requests_waiting=samples.total("sglang:num_queue_reqs"),
            preemptions_total=samples.total("sglang:num_retracted_requests_total"),
            prompt_tokens_total=samples.total("sglang:prompt_tokens_total"),
            generation_tokens_total=samples.total("sglang:generation_tokens_total"),
            requests_finished_total=samples.total("sglang:num_requests_total"),
        )
