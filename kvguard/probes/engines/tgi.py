"""TGI (text-generation-inference): ``tgi_*`` series into :class:`EngineStats`.

TGI exports a token budget rather than a KV pool: ``tgi_batch_max_total_tokens``
(set after warm-up) is what all running sequences may hold together, and
``tgi_batch_current_max_tokens`` is what the running batch may grow to. There is
no preemption counter. TGI's Rust exporter names counters without ``_total``
(the parser adds it when a ``# TYPE`` line says counter); both spellings are read.
"""

from __future__ import annotations

from kvguard.core.snapshot import EngineAction, EngineKind, EngineStats
from kvguard.probes.engines.base import (
    EngineScrape,
    Samples,
    as_int,
    histogram_names,
    parse_exposition,
    ratio,
)

READS = frozenset(
    {
        "tgi_batch_max_total_tokens",
        "tgi_batch_current_max_tokens",
        "tgi_batch_current_size",
        "tgi_queue_size",
        "tgi_request_success_total",
        "tgi_request_success",
        "tgi_request_failure_total",
        "tgi_request_failure",
        "tgi_request_count_total",
        "tgi_request_count",
        *histogram_names("tgi_request_input_length", "tgi_request_generated_tokens"),
    }
)


class TgiAdapter:
    """TGI's metrics; TGI offers no admin actions."""

    kind: EngineKind = "tgi"
    actions: frozenset[EngineAction] = frozenset()
    extra_paths: tuple[str, ...] = ()
    health_path: str = "/health"
    reads: frozenset[str] | None = READS

    def parse(self, scrape: EngineScrape) -> EngineStats:
        """Normalize one TGI scrape."""
        samples = parse_exposition(scrape.metrics_text, self.reads, scrape.families)
        capacity = as_int(samples.total("tgi_batch_max_total_tokens"))
        used = as_int(samples.total("tgi_batch_current_max_tokens"))
        return EngineStats(
            kind="tgi",
            up=scrape.healthy,
            kv_cache_usage_ratio=ratio(used, capacity),
            kv_capacity_tokens=capacity,
            kv_used_tokens=used,
            requests_running=samples.total("tgi_batch_current_size"),
            requests_waiting=samples.total("tgi_queue_size"),
            requests_finished_total=_finished(samples),
            request_prompt_tokens=samples.histogram("tgi_request_input_length"),
            request_generation_tokens=samples.histogram("tgi_request_generated_tokens"),
            # The batch's reservation (num_blocks x BLOCK_SIZE), not tokens written.
            kv_used_is_reserved=used is not None,
        )


def _finished(samples: Samples) -> float | None:
    """Requests that ended, successful or failed.

    ``tgi_request_count`` goes up when a request *arrives* (router/src/server.rs),
    so it is only the fallback when success/failure counters are absent.
    """
    success = samples.total("tgi_request_success_total", "tgi_request_success")
    if success is None:
        return samples.total("tgi_request_count_total", "tgi_request_count")
    return success + (samples.total("tgi_request_failure_total", "tgi_request_failure") or 0.0)
