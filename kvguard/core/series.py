"""One tick reduced to the numbers the forecast and the pattern classifier use.

:func:`tick_sample` flattens a :class:`~kvguard.core.snapshot.Snapshot` into a
:class:`TickSample`; a window of samples (oldest first) is what the forecast and
the classifier read. Counters stay raw (cumulative); consumers take differences
and treat a fall as a restart. ``None`` is "unknown" throughout.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvguard.core.snapshot import Snapshot


@dataclass(frozen=True)
class TickSample:
    """The forecast's and classifier's view of one tick, at monotonic time ``t``."""

    t: float
    kv_used_tokens: float | None = None
    kv_capacity_tokens: float | None = None
    requests_running: float | None = None
    requests_waiting: float | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    requests_finished_total: float | None = None
    preemptions_total: float | None = None
    prompt_tokens_sum: float | None = None  # request_prompt_tokens histogram sum
    prompt_tokens_count: float | None = None  # ... and count (finished requests)
    generation_tokens_sum: float | None = None
    generation_tokens_count: float | None = None
    gpu_used_bytes: float | None = None  # of the fullest watched GPU
    gpu_total_bytes: float | None = None


def tick_sample(snapshot: Snapshot) -> TickSample:
    """Flatten one snapshot; the engine's figures count only while it answers."""
    engine = snapshot.engine
    source = snapshot.sources.get("engine")
    fresh = engine is not None and (source is None or source.ok)
    gpu_used = gpu_total = None
    if snapshot.gpus:
        # The GPU with the least free memory runs out first; it speaks for the rest.
        fullest = min(snapshot.gpus, key=lambda g: g.free_bytes)
        gpu_used, gpu_total = (
            float(fullest.total_bytes - fullest.free_bytes),
            float(fullest.total_bytes),
        )
    if not fresh or engine is None:
        return TickSample(snapshot.taken_at, gpu_used_bytes=gpu_used, gpu_total_bytes=gpu_total)
    prompt, generation = engine.request_prompt_tokens, engine.request_generation_tokens
    return TickSample(
        t=snapshot.taken_at,
        kv_used_tokens=_f(engine.kv_used_tokens),
        kv_capacity_tokens=_f(engine.kv_capacity_tokens),
        requests_running=engine.requests_running,
        requests_waiting=engine.requests_waiting,
        prompt_tokens_total=engine.prompt_tokens_total,
        generation_tokens_total=engine.generation_tokens_total,
        requests_finished_total=engine.requests_finished_total,
        preemptions_total=engine.preemptions_total,
        prompt_tokens_sum=prompt.sum if prompt else None,
        prompt_tokens_count=prompt.count if prompt else None,
        generation_tokens_sum=generation.sum if generation else None,
        generation_tokens_count=generation.count if generation else None,
        gpu_used_bytes=gpu_used,
        gpu_total_bytes=gpu_total,
    )


def _f(value: int | None) -> float | None:
    return None if value is None else float(value)
