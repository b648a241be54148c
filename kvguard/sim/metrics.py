"""The simulated engine's ``/metrics``, named as vLLM, SGLang or llama.cpp name them.

A prometheus_client collector reads the engine's state at scrape time (no
background updates), so a scrape always sees one consistent step. Names, types
and labels follow the real engines' (docs/engines.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from kvguard.core.histogram import Histogram
from kvguard.sim.engine import SimEngine

Flavor = Literal["vllm", "sglang", "llamacpp"]
FLAVORS: tuple[Flavor, ...] = ("vllm", "sglang", "llamacpp")


@dataclass(frozen=True)
class CacheInfo:
    """Static facts the engine reports about its cache (vLLM's ``cache_config_info``)."""

    cache_dtype: str
    gpu_memory_utilization: float
    kv_bytes_per_token: int


class SimCollector(Collector):
    """Collects one engine's metrics under one flavor's names."""

    def __init__(
        self, engine: SimEngine, flavor: Flavor, model_name: str, cache: CacheInfo
    ) -> None:
        self.engine = engine
        self.flavor = flavor
        self.model_name = model_name
        self.cache = cache

    def collect(self) -> Iterator[Metric]:
        """Yield every family for the configured flavor."""
        if self.flavor == "vllm":
            yield from self._vllm()
        elif self.flavor == "sglang":
            yield from self._sglang()
        else:
            yield from self._llamacpp()

    def _vllm(self) -> Iterator[Metric]:
        e, s, sched = self.engine, self.engine.stats, self.engine.scheduler
        names, values = ["model_name", "engine"], [self.model_name, "0"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            len(sched.running),
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            len(sched.waiting),
        )
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of requests waiting, by reason.",
            labels=[*names, "reason"],
        )
        by_reason.add_metric([*values, "capacity"], len(sched.waiting))
        by_reason.add_metric([*values, "deferred"], 0)
        yield by_reason
        yield gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", sched.usage
        )
        if not sched.config.oom_on_exhaust:
            # An engine that cannot preempt has no preemption counter to show; without
            # it kvguard takes the engine to fail when its pool runs out (as it does).
            yield counter(
                "vllm:num_preemptions",
                "Cumulative number of preemption from the engine.",
                s.preemptions_total,
            )
        yield counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens_total
        )
        yield counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            s.generation_tokens_total,
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*names, "finished_reason"],
        )
        for reason in ("stop", "length", "abort"):
            success.add_metric([*values, reason], s.finished[reason])
        yield success
        for name, doc, hist in (
            ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens),
            (
                "vllm:request_generation_tokens",
                "Number of generation tokens processed.",
                s.generation_tokens,
            ),
            (
                "vllm:request_params_max_tokens",
                "Histogram of the max_tokens request parameter.",
                s.max_tokens_param,
            ),
            (
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                s.ttft,
            ),
            (
                "vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                s.e2e,
            ),
            (
                "vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.",
                s.queue_time,
            ),
            (
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                s.inter_token,
            ),
        ):
            yield _histogram(name, doc, hist, names, values)
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[
                "block_size",
                "cache_dtype",
                "enable_prefix_caching",
                "engine",
                "gpu_memory_utilization",
                "kv_cache_memory_bytes",
                "num_gpu_blocks",
                "sliding_window",
            ],
        )
        config = e.config
        info.add_metric(
            [
                str(config.block_size),
                self.cache.cache_dtype,
                "False",
                "0",
                str(self.cache.gpu_memory_utilization),
                str(config.num_gpu_blocks * config.block_size * self.cache.kv_bytes_per_token),
                str(config.num_gpu_blocks),
                "None",
            ],
            1.0,
        )
        yield info

    def _sglang(self) -> Iterator[Metric]:
        s, sched, config = self.engine.stats, self.engine.scheduler, self.engine.config
        names, values = ["model_name", "tp_rank"], [self.model_name, "0"]
        used = sched.used_blocks * config.block_size
        for name, doc, value in (
            ("sglang:token_usage", "The token usage.", sched.usage),
            ("sglang:num_running_reqs", "The number of running requests.", len(sched.running)),
            (
                "sglang:num_queue_reqs",
                "The number of requests in the waiting queue.",
                len(sched.waiting),
            ),
            ("sglang:num_used_tokens", "The number of used tokens.", used),
            (
                "sglang:max_total_num_tokens",
                "Maximum total number of tokens in the KV pool.",
                config.capacity_tokens,
            ),
            ("sglang:kv_available_tokens", "Available KV tokens.", config.capacity_tokens - used),
            ("sglang:kv_evictable_tokens", "Evictable KV tokens (radix cache).", 0),
            ("sglang:cache_hit_rate", "The prefix cache hit rate.", 0.0),
            (
                "sglang:gen_throughput",
                "The generation throughput (token/s).",
                s.last_step_tokens_per_s,
            ),
            ("sglang:context_len", "The context length.", config.max_model_len),
            ("sglang:page_size", "The KV page size in tokens.", config.block_size),
        ):
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            yield family
        for name, doc, value in (
            ("sglang:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens_total),
            (
                "sglang:generation_tokens",
                "Number of generation tokens processed.",
                s.generation_tokens_total,
            ),
            ("sglang:num_requests", "Number of requests processed.", sum(s.finished.values())),
            (
                "sglang:num_retracted_requests",
                "Number of retracted (preempted) requests.",
                s.preemptions_total,
            ),
        ):
            counter = CounterMetricFamily(name, doc, labels=names)
            counter.add_metric(values, value)
            yield counter
        yield _histogram(
            "sglang:time_to_first_token_seconds", "Time to first token.", s.ttft, names, values
        )
        yield _histogram(
            "sglang:e2e_request_latency_seconds",
            "End-to-end request latency.",
            s.e2e,
            names,
            values,
        )

    def _llamacpp(self) -> Iterator[Metric]:
        s, sched = self.engine.stats, self.engine.scheduler
        for name, doc, value in (
            ("llamacpp:prompt_tokens", "Number of prompt tokens processed.", s.prompt_tokens_total),
            (
                "llamacpp:tokens_predicted",
                "Number of generation tokens processed.",
                s.generation_tokens_total,
            ),
            ("llamacpp:n_decode", "Total number of llama_decode() calls.", s.steps_total),
            ("llamacpp:prompt_tokens_cached", "Number of prompt tokens served from the cache.", 0),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        gauges: tuple[tuple[str, str, float], ...] = (
            ("llamacpp:requests_processing", "Number of requests processing.", len(sched.running)),
            ("llamacpp:requests_deferred", "Number of requests deferred.", len(sched.waiting)),
            (
                "llamacpp:n_busy_slots_per_decode",
                "Average number of busy slots per decode.",
                len(sched.running),
            ),
            ("llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s.", 0.0),
            (
                "llamacpp:predicted_tokens_seconds",
                "Average generation throughput in tokens/s.",
                s.last_step_tokens_per_s,
            ),
        )
        for name, doc, reading in gauges:
            yield GaugeMetricFamily(name, doc, value=reading)


def _histogram(
    name: str, doc: str, hist: Histogram, names: list[str], values: list[str]
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=names)
    family.add_metric(values, hist.cumulative(), sum_value=hist.total)
    return family


def metrics_registry(
    engine: SimEngine, flavor: Flavor, model_name: str, cache: CacheInfo
) -> CollectorRegistry:
    """A fresh registry holding only this engine's collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SimCollector(engine, flavor, model_name, cache))
    return registry
