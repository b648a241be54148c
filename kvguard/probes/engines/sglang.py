"""SGLang: ``sglang:*`` series into :class:`EngineStats`.

SGLang reports its KV pool in tokens (``max_total_num_tokens``, ``num_used_tokens``)
and pages of ``page_size`` tokens; it has no ``cache_config_info``. What follows is
read from SGLang 0.5.23 (``srt/observability/metrics_collector.py``,
``SchedulerMetricsCollector``); docs/engines/sglang.md has the line numbers.

Every scheduler process writes its own series, labelled ``model_name``,
``engine_type``, ``tp_rank``, ``pp_rank``, ``moe_ep_rank`` (and ``dp_rank`` with data
parallelism, ``priority`` with priority scheduling). They are not one pool each:

* tensor-parallel ranks split the heads of one pool, so each reports the same tokens;
* pipeline stages hold other layers of the same requests, and SGLang makes their
  token capacity equal (the MIN over ranks), so a stage is the pool, not a part of it;
* data-parallel ranks (``dp_rank``) are separate pools with their own requests.

So the figures of one ``dp_rank`` are taken once — the smallest capacity and the
fullest use, queue and running count any of its ranks reports — and only pools are
added up; usage is the fullest pool's. With priority scheduling the request gauges
carry the total under ``priority=""`` and a breakdown under ``priority="<n>"``; only
the total is read. Each pool is also reported as an :class:`EngineShare`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from kvguard.core.snapshot import EngineAction, EngineKind, EngineShare, EngineStats
from kvguard.probes.engines.base import (
    EngineScrape,
    Labels,
    Samples,
    as_int,
    check_count,
    check_ratio,
    parse_exposition,
)

CAPACITY = "sglang:max_total_num_tokens"
PAGE_SIZE = "sglang:page_size"
USAGE = "sglang:token_usage"
# token_usage is the larger of these two, rounded to 2 decimals (SGLang 0.5.23,
# pool_stats_observer.py): read unrounded where the release writes them.
FULL_USAGE = "sglang:full_token_usage"
SWA_USAGE = "sglang:swa_token_usage"
USED = "sglang:num_used_tokens"
RUNNING = "sglang:num_running_reqs"
QUEUED = "sglang:num_queue_reqs"
ROUNDING = 0.005 + 1e-9  # half of token_usage's last decimal, and float slack
RETRACTED = "sglang:num_retracted_requests_total"
# The retraction counter is labelled, so prometheus_client writes it only after the
# first retraction; this gauge (every release that has the counter) is there from the
# start, so its presence says "none yet" rather than "unknown".
RETRACTED_NOW = "sglang:num_retracted_reqs"
READS = frozenset(
    {
        CAPACITY,
        PAGE_SIZE,
        USAGE,
        FULL_USAGE,
        SWA_USAGE,
        USED,
        RUNNING,
        QUEUED,
        RETRACTED,
        RETRACTED_NOW,
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:num_requests_total",
    }
)

# Pool -> one figure for it (already reduced over its TP/PP/EP ranks).
PerPool = dict[str, float]


class SglangAdapter:
    """SGLang's metrics (served with ``--enable-metrics``)."""

    kind: EngineKind = "sglang"
    actions: frozenset[EngineAction] = frozenset({"evict", "pause", "abort"})
    extra_paths: tuple[str, ...] = ()
    health_path: str = "/health"
    reads: frozenset[str] | None = READS

    def parse(self, scrape: EngineScrape) -> EngineStats:
        """Normalize one SGLang scrape."""
        samples = parse_exposition(scrape.metrics_text, self.reads, scrape.families)
        # Ranks of one pool report the same pool: the smallest capacity is the
        # one every rank can hold; for use, the fullest rank is the safe reading.
        capacity = _per_pool(samples, CAPACITY, min)
        used = _per_pool(samples, USED, max)
        usage = _usage(samples)
        running = _per_pool(samples, RUNNING, max)
        queued = _per_pool(samples, QUEUED, max)
        retracted = _per_pool(samples, RETRACTED, max)
        for pool in _per_pool(samples, RETRACTED_NOW, max):
            retracted.setdefault(pool, 0.0)  # the counter comes with the first retraction
        page_size = as_int(samples.highest(PAGE_SIZE))
        capacity_tokens = as_int(_sum(capacity))
        return EngineStats(
            kind="sglang",
            up=scrape.healthy,
            kv_cache_usage_ratio=max(usage.values()) if usage else None,
            kv_capacity_tokens=capacity_tokens,
            kv_capacity_blocks=(
                capacity_tokens // page_size if capacity_tokens is not None and page_size else None
            ),
            block_size=page_size or None,
            kv_used_tokens=as_int(_sum(used)),
            requests_running=_sum(running),
            requests_waiting=_sum(queued),
            preemptions_total=_sum(retracted),
            # Counters come from the one tokenizer process (labelled per request
            # priority when enabled, with no separate total), so adding is right.
            prompt_tokens_total=samples.total("sglang:prompt_tokens_total"),
            generation_tokens_total=samples.total("sglang:generation_tokens_total"),
            requests_finished_total=samples.total("sglang:num_requests_total"),
            engines=_shares(
                capacity,
                usage=usage,
                running=running,
                queued=queued,
                retracted=retracted,
                page_size=page_size,
            ),
        )


def _pool_of(labels: Labels) -> str:
    # Without data parallelism there is no dp_rank label: one pool, "".
    return labels.get("dp_rank", "")


def _usage(samples: Samples) -> PerPool:
    """Each pool's usage: unrounded full/SWA usage where written, else ``token_usage``."""
    rounded = _per_pool(samples, USAGE, max, ratio=True)
    full = _per_pool(samples, FULL_USAGE, max, ratio=True)
    swa = _per_pool(samples, SWA_USAGE, max, ratio=True)
    usage = dict(rounded)
    for pool, value in full.items():
        exact = max(value, swa.get(pool, 0.0))
        # token_usage is this figure rounded to 2 decimals; where it is not (another
        # release's meaning), SGLang's own figure stays.
        if pool not in rounded or abs(exact - rounded[pool]) <= ROUNDING:
            usage[pool] = exact
    return usage


def _is_priority_breakdown(labels: Labels) -> bool:
    """A per-priority copy of a request gauge; the total sits under ``priority=""``."""
    return labels.get("priority", "") != ""


def _per_pool(
    samples: Samples, name: str, reduce: Callable[[Iterable[float]], float], *, ratio: bool = False
) -> PerPool:
    """``name``'s figure per data-parallel pool, reduced over that pool's ranks."""
    check = check_ratio if ratio else check_count
    pools: dict[str, list[float]] = {}
    for labels, value in samples.series(name):
        if _is_priority_breakdown(labels):
            continue
        pools.setdefault(_pool_of(labels), []).append(check(name, labels, value))
    return {pool: reduce(values) for pool, values in pools.items()}


def _sum(per_pool: PerPool) -> float | None:
    return math.fsum(per_pool.values()) if per_pool else None


def _rank(label: str) -> int | None:
    """The data-parallel rank a ``dp_rank`` value names ("0", "1", …); else None."""
    if not (label.isascii() and label.isdigit()) or str(int(label)) != label:
        return None
    return int(label)


def _shares(
    capacity: PerPool,
    *,
    usage: PerPool,
    running: PerPool,
    queued: PerPool,
    retracted: PerPool,
    page_size: int | None,
) -> tuple[EngineShare, ...]:
    """One share per data-parallel pool, by ``dp_rank``; none unless two or more report."""
    labels = set(capacity) | set(usage) | set(running) | set(queued)
    indices = {label: rank for label in labels if (rank := _rank(label)) is not None}
    if len(indices) < 2:
        return ()
    shares = []
    for label, index in sorted(indices.items(), key=lambda item: item[1]):
        tokens = as_int(capacity.get(label))
        shares.append(
            EngineShare(
                index=index,
                kv_cache_usage_ratio=usage.get(label),
                kv_capacity_blocks=tokens // page_size
                if tokens is not None and page_size
                else None,
                requests_running=running.get(label),
                requests_waiting=queued.get(label),
                preemptions_total=retracted.get(label),
            )
        )
    return tuple(shares)
