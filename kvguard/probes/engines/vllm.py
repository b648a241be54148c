"""vLLM (v1 engine): ``vllm:*`` series into :class:`EngineStats`.

Names and meanings are in docs/engines/vllm.md. Data-parallel deployments label
every series with ``engine="0"``, ``"1"``, …: counts, counters and capacity are
added over engines, and the usage ratio is the highest engine's (the one that
preempts first). Each engine's own figures are kept beside the sums, one
:class:`EngineShare` per ``engine`` index, so an operator can see which one is full.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvguard.core.snapshot import EngineAction, EngineKind, EngineShare, EngineStats
from kvguard.probes.engines.base import (
    EngineScrape,
    Samples,
    count_label,
    histogram_names,
    parse_exposition,
)

CACHE_CONFIG = "vllm:cache_config_info"  # an info series: its labels are the figures
USAGE_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # new name, then old
# The per-engine series an EngineShare is made of (beside usage and cache_config_info).
SHARE_COUNTS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_preemptions_total",
)
READS = frozenset(
    {
        *USAGE_NAMES,
        CACHE_CONFIG,
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        *histogram_names("vllm:request_prompt_tokens", "vllm:request_generation_tokens"),
    }
)


@dataclass(frozen=True)
class _CacheConfig:
    """One engine's ``vllm:cache_config_info`` labels that matter here."""

    num_gpu_blocks: int | None
    block_size: int | None
    cache_dtype: str | None
    # What vLLM itself says the pool holds ("GPU KV cache size", recent versions).
    # For hybrid and sliding-window models it is not blocks x block size: vLLM
    # counts whole requests there (max concurrency x max_model_len).
    size_tokens: int | None = None

    @property
    def hybrid(self) -> bool:
        """Whether vLLM's own token figure differs from blocks x block size."""
        if self.size_tokens is None or self.num_gpu_blocks is None or self.block_size is None:
            return False
        return self.size_tokens != self.num_gpu_blocks * self.block_size


class VllmAdapter:
    """vLLM's metrics: KV usage ratio plus ``cache_config_info`` for capacity."""

    kind: EngineKind = "vllm"
    actions: frozenset[EngineAction] = frozenset({"evict", "pause", "abort"})
    extra_paths: tuple[str, ...] = ()
    health_path: str = "/health"
    reads: frozenset[str] | None = READS

    def parse(self, scrape: EngineScrape) -> EngineStats:
        """Normalize one vLLM scrape."""
        samples = parse_exposition(scrape.metrics_text, self.reads, scrape.families)
        configs = _cache_configs(samples)
        usage_by_engine = _usage_by_engine(samples)
        blocks, capacity_tokens = _capacity(configs)
        block_sizes = {c.block_size for c in configs.values() if c.block_size is not None}
        dtypes = [c.cache_dtype for c in configs.values() if c.cache_dtype]
        return EngineStats(
            kind="vllm",
            up=scrape.healthy,
            kv_cache_usage_ratio=max(usage_by_engine.values()) if usage_by_engine else None,
            kv_capacity_tokens=capacity_tokens,
            kv_capacity_blocks=blocks,
            # Engines of one deployment share a block size; a mix has no single answer.
            block_size=block_sizes.pop() if len(block_sizes) == 1 else None,
            kv_used_tokens=_used_tokens(usage_by_engine, configs),
            cache_dtype=dtypes[0] if dtypes else None,
            requests_running=samples.total("vllm:num_requests_running"),
            requests_waiting=samples.total("vllm:num_requests_waiting"),
            preemptions_total=samples.total("vllm:num_preemptions_total"),
            prompt_tokens_total=samples.total("vllm:prompt_tokens_total"),
            generation_tokens_total=samples.total("vllm:generation_tokens_total"),
            requests_finished_total=samples.total("vllm:request_success_total"),
            request_prompt_tokens=samples.histogram("vllm:request_prompt_tokens"),
            request_generation_tokens=samples.histogram("vllm:request_generation_tokens"),
            engines=_shares(samples, usage_by_engine, configs),
        )


def _engine_of(labels: dict[str, str]) -> str:
    # Versions before data parallelism have no `engine` label: one engine, "".
    return labels.get("engine", "")


def _usage_by_engine(samples: Samples) -> dict[str, float]:
    name = samples.first_present(*USAGE_NAMES)
    usage: dict[str, float] = {}
    if name is None:
        return usage
    for labels, value in samples.ratios(name):
        engine = _engine_of(labels)
        usage[engine] = max(value, usage.get(engine, value))
    return usage


def _shares(
    samples: Samples, usage: dict[str, float], configs: dict[str, _CacheConfig]
) -> tuple[EngineShare, ...]:
    """One share per data-parallel engine, by index; none unless two or more report."""
    labels = set(usage) | set(configs)
    for name in SHARE_COUNTS:
        labels.update(_engine_of(series_labels) for series_labels, _ in samples.series(name))
    indices = {label: rank for label in labels if (rank := _rank(label)) is not None}
    if len(indices) < 2:
        return ()
    shares = []
    for label, index in sorted(indices.items(), key=lambda item: item[1]):
        config = configs.get(label)
        running, waiting, preemptions = (samples.total(name, engine=label) for name in SHARE_COUNTS)
        shares.append(
            EngineShare(
                index=index,
                kv_cache_usage_ratio=usage.get(label),
                kv_capacity_blocks=config.num_gpu_blocks if config else None,
                requests_running=running,
                requests_waiting=waiting,
                preemptions_total=preemptions,
            )
        )
    return tuple(shares)


def _rank(label: str) -> int | None:
    """The data-parallel rank an ``engine`` value names, as vLLM writes it ("0", "1", …).

    Anything else (absent, not a number, "01") names no rank, so two labels never
    give one rank twice.
    """
    if not (label.isascii() and label.isdigit()) or str(int(label)) != label:
        return None
    return int(label)


def _cache_configs(samples: Samples) -> dict[str, _CacheConfig]:
    # The label set changes between versions: read whichever labels are there.
    configs: dict[str, _CacheConfig] = {}
    for labels, _ in samples.series(CACHE_CONFIG):
        configs[_engine_of(labels)] = _CacheConfig(
            num_gpu_blocks=count_label(CACHE_CONFIG, labels, "num_gpu_blocks"),
            block_size=count_label(CACHE_CONFIG, labels, "block_size"),
            cache_dtype=labels.get("cache_dtype") or None,
            size_tokens=count_label(CACHE_CONFIG, labels, "kv_cache_size_tokens"),
        )
    return configs


def _used_tokens(usage: dict[str, float], configs: dict[str, _CacheConfig]) -> int | None:
    """Tokens in use: each engine's usage of its blocks minus vLLM's one reserved null block."""
    if len(usage) == 1 and len(configs) == 1:
        # One engine each, even if only one side carries an `engine` label.
        pairs = [(next(iter(usage.values())), next(iter(configs.values())))]
    else:
        if not usage or set(usage) - set(configs):
            return None
        pairs = [(value, configs[engine]) for engine, value in usage.items()]
    used = 0
    for value, config in pairs:
        if config.hybrid and config.size_tokens is not None:
            used += round(value * config.size_tokens)
            continue
        if config.num_gpu_blocks is None or config.block_size is None:
            return None
        used += round(value * max(config.num_gpu_blocks - 1, 0) * config.block_size)
    return used


def _capacity(configs: dict[str, _CacheConfig]) -> tuple[int | None, int | None]:
    """Blocks and tokens over all engines; unknown if any engine's figure is unknown."""
    if not configs:
        return None, None
    blocks, tokens, tokens_known = 0, 0, True
    for config in configs.values():
        if config.num_gpu_blocks is None:
            return None, None
        blocks += config.num_gpu_blocks
        if config.size_tokens is not None:
            tokens += config.size_tokens  # vLLM's own figure wins (hybrid models)
        elif config.block_size is None:
            tokens_known = False
        else:
            tokens += config.num_gpu_blocks * config.block_size
    return blocks, tokens if tokens_known else None
