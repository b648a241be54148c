"""What kvguard observed in one tick: GPU, host and engine, normalized.

Probes (in ``kvguard/probes/``) translate NVML, psutil and each engine's metrics
into these value types; the daemon bundles one tick's results into a
:class:`Snapshot`. ``None`` always means "unknown" (the source does not expose it,
or it was not reachable), never zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

EngineKind = Literal["vllm", "sglang", "tgi", "llamacpp", "trtllm"]
ENGINE_KINDS: tuple[EngineKind, ...] = ("vllm", "sglang", "tgi", "llamacpp", "trtllm")

# Admin actions an engine may offer; adapters declare which ones they support.
EngineAction = Literal["evict", "pause", "abort"]


@dataclass(frozen=True)
class GpuProcess:
    """One process's memory on one GPU (``used_bytes`` None when the driver hides it)."""

    pid: int
    used_bytes: int | None


@dataclass(frozen=True)
class GpuMemory:
    """Memory of one GPU as NVML reports it.

    ``reserved_bytes`` is the driver's own reservation (NVML memory info v2); it is
    None on drivers with only v1, where it is counted in ``used_bytes``.
    """

    index: int
    uuid: str
    name: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    reserved_bytes: int | None
    processes: tuple[GpuProcess, ...] = ()


@dataclass(frozen=True)
class HostStats:
    """Host memory and, when configured, the engine process's footprint."""

    memory_total_bytes: int
    memory_available_bytes: int
    engine_pid: int | None = None
    engine_resident_bytes: int | None = None
    engine_cpu_ratio: float | None = None  # share of one core over the last interval
    engine_cpu_seconds_total: float | None = None  # user + system CPU time since it started


@dataclass(frozen=True)
class HistogramSummary:
    """Sum and count of a histogram (enough for a mean)."""

    sum: float
    count: float

    @property
    def mean(self) -> float | None:
        """Mean observation, None before the first one."""
        return self.sum / self.count if self.count else None


@dataclass(frozen=True)
class EngineShare:
    """One data-parallel engine of a deployment, as its own series report it.

    ``index`` is the engine's data-parallel rank (vLLM's ``engine`` label). The
    deployment's :class:`EngineStats` adds these up and takes the fullest usage;
    a share keeps each engine's own figures, so an operator sees which rank is full.
    """

    index: int
    kv_cache_usage_ratio: float | None = None
    kv_capacity_blocks: int | None = None
    requests_running: float | None = None
    requests_waiting: float | None = None
    preemptions_total: float | None = None


@dataclass(frozen=True)
class EngineStats:
    """One engine's cache and queue, normalized across engines.

    Counters (``*_total``) are the engine's raw cumulative values; rates are the
    forecast's business. ``kv_used_tokens`` is derived where the engine gives a
    usage ratio and a capacity, or counted directly (llama.cpp ``/slots``);
    ``kv_used_is_reserved`` says it is space reserved rather than tokens written
    (TGI reports what the running batch may grow to: an upper bound of use).

    ``engines`` holds one :class:`EngineShare` per data-parallel engine, by index,
    when the engine reports two or more; it is empty for a single engine (and for
    engines without a data-parallel notion), where the figures above say it all.
    ``context_tokens`` is the longest sequence (prompt + answer) the engine serves, as
    it says itself (vLLM's and SGLang's ``max_model_len`` in ``/v1/models``); None
    where it does not say.
    """

    kind: EngineKind
    up: bool
    kv_cache_usage_ratio: float | None = None
    kv_capacity_tokens: int | None = None
    kv_capacity_blocks: int | None = None
    block_size: int | None = None
    kv_used_tokens: int | None = None
    cache_dtype: str | None = None
    requests_running: float | None = None
    requests_waiting: float | None = None
    preemptions_total: float | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    requests_finished_total: float | None = None
    request_prompt_tokens: HistogramSummary | None = None
    request_generation_tokens: HistogramSummary | None = None
    engines: tuple[EngineShare, ...] = ()
    kv_used_is_reserved: bool = False
    context_tokens: int | None = None


@dataclass(frozen=True)
class SourceReading:
    """One probe's latest result and how old it is.

    ``ok`` is false when the last attempt failed (``error`` says why); the value is
    then the last good one, if any, and ``age_s`` grows: that is staleness. A source
    that is not there at all (``available`` false) is not failing, only absent.
    """

    ok: bool
    age_s: float | None  # seconds since the value was read; None: never read
    error: str | None = None
    available: bool = True  # False: the source is not there at all (no NVIDIA driver)


@dataclass(frozen=True)
class Snapshot:
    """Everything observed in one tick, at monotonic time ``taken_at``."""

    taken_at: float
    gpus: tuple[GpuMemory, ...] | None = None
    host: HostStats | None = None
    engine: EngineStats | None = None
    sources: dict[str, SourceReading] = field(default_factory=dict)
