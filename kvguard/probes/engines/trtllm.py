"""TensorRT-LLM: Triton's ``nv_trt_llm_*`` families, or ``trtllm-serve``'s JSON iteration stats.

Two servers front TensorRT-LLM, and each answers its metrics endpoint in its own
format; the body says which one kvguard faces:

- **Triton** with the TensorRT-LLM C++ backend (``tensorrtllm_backend``) serves
  Prometheus text on its metrics port. It packs the batch manager's statistics into
  a few gauge families told apart by one label (``kv_cache_block_type``,
  ``request_type``), each also labelled with the Triton ``model`` and ``version``;
  values are added over those. Its ``request_type="waiting"`` is ``active`` less
  ``scheduled`` (``ModelInstanceState::WaitForStats``), so ``active`` already holds the
  waiting ones: running is ``scheduled``, and running plus waiting is ``active``.
- **trtllm-serve** (``tensorrt_llm/serve/openai_server.py``) answers ``GET /metrics``
  with a JSON list: one object per executor iteration finished since the previous
  read (the server drains its stats queue on each read). kvguard reads the newest
  one. The keys are those of the executor's ``IterationStats`` JSON serialization
  (``cpp/tensorrt_llm/executor/jsonSerialization.cpp``).

An empty list means no iteration was reported since the last read: not an idle or
empty cache. That answer keeps the capacity of the previous reading (it changes only
when the engine restarts) and leaves usage, used tokens and the request counts
unknown. Names and meanings are in docs/engines/tensorrt-llm.md.
"""

from __future__ import annotations

import json
import math
from typing import Any

from kvguard.core.snapshot import EngineAction, EngineKind, EngineStats
from kvguard.errors import ProbeError
from kvguard.probes.engines.base import (
    MAX_COUNT,
    PROBE_NAME,
    EngineScrape,
    Samples,
    as_int,
    parse_exposition,
    ratio,
)

KV_BLOCKS = "nv_trt_llm_kv_cache_block_metrics"
REQUESTS = "nv_trt_llm_request_metrics"
READS = frozenset({KV_BLOCKS, REQUESTS})

# trtllm-serve's liveness route (``OpenAIServer.register_routes``); Triton's is the
# adapter's ``health_path``.
SERVE_HEALTH_PATH = "/health"
# IterationStats keys (jsonSerialization.cpp) read from each iteration object.
KV_CACHE_STATS = "kvCacheStats"
ACTIVE_REQUESTS = "numActiveRequests"
QUEUED_REQUESTS = "numQueuedRequests"
# KvCacheStats keys read from its ``kvCacheStats`` object.
MAX_BLOCKS = "maxNumBlocks"
FREE_BLOCKS = "freeNumBlocks"
USED_BLOCKS = "usedNumBlocks"
TOKENS_PER_BLOCK = "tokensPerBlock"


class TrtllmAdapter:
    """TensorRT-LLM behind Triton or trtllm-serve; neither offers admin actions for the KV cache.

    ``health_path`` is Triton's; a trtllm-serve body is answered by
    :meth:`health_path_for` with trtllm-serve's own ``/health``.
    """

    kind: EngineKind = "trtllm"
    actions: frozenset[EngineAction] = frozenset()
    extra_paths: tuple[str, ...] = ()
    health_path: str = "/v2/health/ready"
    reads: frozenset[str] | None = READS

    def health_path_for(self, metrics_text: str) -> str:
        """The liveness path of the server that answered ``metrics_text``."""
        return SERVE_HEALTH_PATH if is_iteration_stats(metrics_text) else self.health_path

    def parse(self, scrape: EngineScrape) -> EngineStats:
        """Normalize one scrape: trtllm-serve's JSON list, else Triton's exposition text."""
        if is_iteration_stats(scrape.metrics_text):
            return _parse_iteration_stats(scrape)
        return _parse_triton(scrape)


def is_iteration_stats(metrics_text: str) -> bool:
    """Whether a metrics body is trtllm-serve's JSON list rather than exposition text.

    Exposition text never starts with ``[`` (a line is a name, a comment or blank),
    so the first character tells them apart without parsing either.
    """
    return metrics_text.lstrip().startswith("[")


def _parse_triton(scrape: EngineScrape) -> EngineStats:
    """Triton's ``nv_trt_llm_*`` gauges, added over its ``model`` and ``version`` labels."""
    samples = parse_exposition(scrape.metrics_text, READS, scrape.families)
    max_blocks = as_int(samples.total(KV_BLOCKS, kv_cache_block_type="max"))
    used_blocks = as_int(samples.total(KV_BLOCKS, kv_cache_block_type="used"))
    # Every model instance of one engine uses one block size.
    tokens_per = as_int(samples.highest(KV_BLOCKS, kv_cache_block_type="tokens_per"))
    usage = ratio(used_blocks, max_blocks)
    if usage is None:  # Triton's own ratio, when the block counts are missing
        usage = samples.highest_ratio(KV_BLOCKS, kv_cache_block_type="fraction")
    waiting = samples.total(REQUESTS, request_type="waiting")
    return EngineStats(
        kind="trtllm",
        up=scrape.healthy,
        kv_cache_usage_ratio=usage,
        kv_capacity_tokens=_times(max_blocks, tokens_per),
        kv_capacity_blocks=max_blocks,
        block_size=tokens_per or None,
        kv_used_tokens=_times(used_blocks, tokens_per),
        requests_running=_triton_running(samples, waiting),
        requests_waiting=waiting,
    )


def _triton_running(samples: Samples, waiting: float | None) -> float | None:
    """Requests in this iteration's batch: ``scheduled``, else ``active`` less ``waiting``.

    The backend writes ``waiting`` as ``active - scheduled``: ``active`` counts every
    request the executor holds, the waiting (and paused) ones included, so reading it
    as running would count those twice (running + waiting is what is in flight).
    """
    scheduled = samples.total(REQUESTS, request_type="scheduled")
    if scheduled is not None:
        return scheduled
    active = samples.total(REQUESTS, request_type="active")
    if active is None:
        return None
    return max(active - (waiting or 0.0), 0.0)


def _parse_iteration_stats(scrape: EngineScrape) -> EngineStats:
    """The newest iteration of trtllm-serve's list; capacity kept over an empty one."""
    iterations = _iterations(scrape.metrics_text)
    if not iterations:
        return _no_new_iteration(scrape)
    # The list is in the order the executor finished the iterations: the last is now.
    latest = iterations[-1]
    kv = latest.get(KV_CACHE_STATS)
    if kv is not None and not isinstance(kv, dict):
        raise ProbeError(PROBE_NAME, f"trtllm-serve {KV_CACHE_STATS} is not an object: {kv!r:.60}")
    # null when the executor has no KV cache manager (the C++ optional left empty).
    kv = kv or {}
    max_blocks = _count(kv, MAX_BLOCKS)
    tokens_per = _count(kv, TOKENS_PER_BLOCK)
    used_blocks = _count(kv, USED_BLOCKS)
    if used_blocks is None:
        free_blocks = _count(kv, FREE_BLOCKS)
        if max_blocks is not None and free_blocks is not None and free_blocks <= max_blocks:
            used_blocks = max_blocks - free_blocks
    if used_blocks is not None and max_blocks is not None and used_blocks > max_blocks:
        raise ProbeError(
            PROBE_NAME,
            f"trtllm-serve {KV_CACHE_STATS}.{USED_BLOCKS} is {used_blocks}, over"
            f" {MAX_BLOCKS} {max_blocks}",
        )
    return EngineStats(
        kind="trtllm",
        up=scrape.healthy,
        kv_cache_usage_ratio=ratio(used_blocks, max_blocks),
        kv_capacity_tokens=_times(max_blocks, tokens_per),
        kv_capacity_blocks=max_blocks,
        block_size=tokens_per or None,
        kv_used_tokens=_times(used_blocks, tokens_per),
        requests_running=_as_float(_count(latest, ACTIVE_REQUESTS)),
        requests_waiting=_as_float(_count(latest, QUEUED_REQUESTS)),
    )


def _no_new_iteration(scrape: EngineScrape) -> EngineStats:
    """An empty list: the previous reading's capacity, nothing about the present.

    trtllm-serve answers ``[]`` before the first request and whenever no iteration
    was reported since the last read; the latter also happens while requests are
    being served (its stats reader stops after a quiet wait, until a new request
    arrives). So the list says nothing about what the cache holds now: usage, used
    tokens and the counts are unknown, never 0. The pool's size changes only when
    the engine restarts, so the previous reading's capacity stands.
    """
    previous = scrape.previous
    if previous is None or previous.kind != "trtllm":
        return EngineStats(kind="trtllm", up=scrape.healthy)
    return EngineStats(
        kind="trtllm",
        up=scrape.healthy,
        kv_capacity_tokens=previous.kv_capacity_tokens,
        kv_capacity_blocks=previous.kv_capacity_blocks,
        block_size=previous.block_size,
    )


def _iterations(text: str) -> list[dict[str, Any]]:
    """The body as a list of iteration objects; :class:`ProbeError` when it is not one."""
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as exc:  # not JSON, absurd nesting
        raise ProbeError(PROBE_NAME, f"malformed trtllm-serve iteration stats: {exc}") from exc
    if not isinstance(body, list) or not all(isinstance(item, dict) for item in body):
        raise ProbeError(
            PROBE_NAME, "malformed trtllm-serve iteration stats: not a list of objects"
        )
    return body


def _count(stats: dict[str, Any], key: str) -> int | None:
    """A count from an iteration object: None when absent or null; ProbeError when garbage.

    The engine writes these as JSON integers (C++ ``SizeType32``). A value that is no
    count (negative, fractional, a string, a boolean, past :data:`MAX_COUNT`) fails
    the probe naming the key, as a garbage series does in exposition text.
    """
    value = stats.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProbeError(PROBE_NAME, f"trtllm-serve {key} is {value!r:.40}: not a number")
    if isinstance(value, float) and (not math.isfinite(value) or not value.is_integer()):
        raise ProbeError(PROBE_NAME, f"trtllm-serve {key} is {value!r}: not a whole count")
    # Compared as a Python int: a huge JSON integer never goes through float().
    number = int(value)
    if not 0 <= number <= MAX_COUNT:
        raise ProbeError(
            PROBE_NAME,
            f"trtllm-serve {key} is {number}: a count must be from 0 to {MAX_COUNT:.0f}",
        )
    return number


def _as_float(count: int | None) -> float | None:
    # EngineStats carries request counts as floats (they come from gauges elsewhere).
    return None if count is None else float(count)


def _times(blocks: int | None, tokens_per_block: int | None) -> int | None:
    if blocks is None or not tokens_per_block:
        return None
    return blocks * tokens_per_block
