"""llama.cpp ``llama-server``: ``llamacpp:*`` metrics plus ``/slots`` into :class:`EngineStats`.

llama.cpp no longer exports a KV gauge, so KV use is counted from ``GET /slots``:
each slot reports ``n_ctx`` tokens of context, and a processing slot holds its prompt
plus what it has decoded so far. Without ``/slots`` those fields fall back to
``/props`` for capacity, and are unknown otherwise. llama.cpp does not preempt,
and has no block size.

How the slots' ``n_ctx`` add up depends on the cache layout, which llama-server does
not report (:class:`LlamacppAdapter`): unified, one slot's ``n_ctx`` is the whole
cache; split, the slots' add up. Undeclared, it is read as unified (llama-server's
default launch) unless the slots hold more than a unified cache of that size could
(:func:`shows_split`).
"""

from __future__ import annotations

from typing import Any

from kvguard.core.snapshot import EngineAction, EngineKind, EngineStats
from kvguard.probes.engines.base import MAX_COUNT, EngineScrape, as_int, parse_exposition, ratio

READS = frozenset(
    {
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
        "llamacpp:prompt_tokens_total",
        "llamacpp:tokens_predicted_total",
    }
)


class LlamacppAdapter:
    """llama-server's metrics (``--metrics``), ``/slots`` and ``/props``.

    ``kv_unified`` is how the server holds its context (``[engine] kv_unified``, or
    llama-server's command line): True when all slots share one cache
    (``--kv-unified``, and the default ``-np`` auto), so every slot reports the whole
    context as its ``n_ctx`` and the cache is one of them; False when ``-np N`` splits
    it, each slot owning ``n_ctx`` of it, so they add up. Neither ``/slots`` nor
    ``/props`` says which: unknown (None) is read as unified, llama-server's default
    launch (usage then reads too high on a split cache, never too low), except on a
    scrape whose slots show a split cache (:func:`shows_split`). The adapter keeps no
    state: the engine probe remembers a split once shown (``kv_unified=False``).
    """

    kind: EngineKind = "llamacpp"
    actions: frozenset[EngineAction] = frozenset({"evict"})
    extra_paths: tuple[str, ...] = ("/slots", "/props")
    health_path: str = "/health"
    reads: frozenset[str] | None = READS

    def __init__(self, kv_unified: bool | None = None) -> None:
        self.kv_unified = kv_unified

    def parse(self, scrape: EngineScrape) -> EngineStats:
        """Normalize one llama-server scrape."""
        samples = parse_exposition(scrape.metrics_text, self.reads, scrape.families)
        declared = self.kv_unified
        unified = not shows_split(scrape.slots) if declared is None else declared
        capacity, used = _from_slots(scrape.slots, unified=unified)
        if capacity is None:
            capacity = _capacity_from_props(scrape.props, unified=unified)
        return EngineStats(
            kind="llamacpp",
            up=scrape.healthy,
            kv_cache_usage_ratio=ratio(used, capacity),
            kv_capacity_tokens=capacity,
            kv_used_tokens=used,
            requests_running=samples.total("llamacpp:requests_processing"),
            requests_waiting=samples.total("llamacpp:requests_deferred"),
            prompt_tokens_total=samples.total("llamacpp:prompt_tokens_total"),
            generation_tokens_total=samples.total("llamacpp:tokens_predicted_total"),
        )


def _from_slots(
    slots: list[dict[str, Any]] | None, *, unified: bool
) -> tuple[int | None, int | None]:
    """Context capacity and tokens in use over slots; (None, None) if unreadable.

    Split: the slots' ``n_ctx`` add up to the context (``-c``). Unified: each slot
    reports the whole shared cache, which is the largest of them.
    """
    if not slots:
        return None, None
    capacity = used = 0
    for slot in slots:
        n_ctx = _count(slot.get("n_ctx"))
        if n_ctx is None:
            return None, None
        capacity = max(capacity, n_ctx) if unified else capacity + n_ctx
        if slot.get("is_processing") is True:
            used += _held(slot)
    return capacity, used


def shows_split(slots: list[dict[str, Any]] | None) -> bool:
    """Whether the busy slots hold more tokens together than a unified cache could.

    Unified, every slot reports the whole cache as its ``n_ctx``, so the cells the
    slots hold together cannot exceed it; past the largest ``n_ctx``, the slots must
    each own theirs (split). Only the cells no other slot can share are counted: what
    a slot processed and decoded, not the prompt it took from the cache (a unified
    cache may share a prefix between slots). False when ``/slots`` is unreadable.
    """
    if not slots:
        return False
    largest = own = 0
    for slot in slots:
        n_ctx = _count(slot.get("n_ctx"))
        if n_ctx is None:
            return False
        largest = max(largest, n_ctx)
        if slot.get("is_processing") is True:
            own += _own(slot)
    return own > largest


def _own(slot: dict[str, Any]) -> int:
    """Cells a busy slot wrote itself: its processed prompt and its output."""
    processed = _count(slot.get("n_prompt_tokens_processed"))
    if processed is not None:
        return processed + _decoded(slot)
    # Older llama.cpp: n_prompt_tokens is the prompt alone, of which n_prompt_tokens_cache
    # came from the cache. Without that breakdown only the output is surely the slot's
    # own (a split wrongly inferred would read capacity too high).
    prompt = _count(slot.get("n_prompt_tokens"))
    cached = _count(slot.get("n_prompt_tokens_cache"))
    if prompt is not None and cached is not None:
        return max(prompt - cached, 0) + _decoded(slot)
    return _decoded(slot)


def _held(slot: dict[str, Any]) -> int:
    """Tokens a busy slot holds in the cache: its prompt (cached + processed) and output."""
    processed = _count(slot.get("n_prompt_tokens_processed"))
    if processed is not None:
        # Newer llama.cpp: n_prompt_tokens is the slot's whole token list, generated
        # tokens included; the prompt is what came from the cache plus what was processed.
        return processed + (_count(slot.get("n_prompt_tokens_cache")) or 0) + _decoded(slot)
    # Older llama.cpp (docs/engines/llamacpp.md): n_prompt_tokens is the prompt alone.
    return (_count(slot.get("n_prompt_tokens")) or 0) + _decoded(slot)


def _decoded(slot: dict[str, Any]) -> int:
    next_token = slot.get("next_token")
    if isinstance(next_token, list) and next_token and isinstance(next_token[0], dict):
        return _count(next_token[0].get("n_decoded")) or 0
    return 0


def _capacity_from_props(props: dict[str, Any] | None, *, unified: bool) -> int | None:
    if not props:
        return None
    slots = _count(props.get("total_slots"))
    settings = props.get("default_generation_settings")
    n_ctx = _count(settings.get("n_ctx")) if isinstance(settings, dict) else None
    if unified:
        return n_ctx
    return slots * n_ctx if slots is not None and n_ctx is not None else None


def _count(value: object) -> int | None:
    """A JSON count as an int; None for anything else (bools, negatives, past MAX_COUNT).

    ``/slots`` and ``/props`` are extras: garbage there leaves the fields they feed
    unknown rather than failing the tick. The cap keeps a 1e308 from becoming an int
    that no later float conversion survives.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    # A JSON integer is a Python int of any size: compared as is, never through float().
    number = value if isinstance(value, int) else as_int(value)
    return number if number is not None and 0 <= number <= MAX_COUNT else None
