"""One adapter per engine: metric names -> normalized :class:`~kvguard.core.snapshot.EngineStats`.

``ADAPTERS`` maps each :data:`~kvguard.core.snapshot.EngineKind` to its adapter;
:func:`detect_kind` tells the engine from its metric names. Adapters are pure;
:class:`kvguard.probes.engine.EngineProbe` does the HTTP.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from kvguard.core.snapshot import EngineKind
from kvguard.probes.engines.base import (
    EngineAdapter,
    EngineScrape,
    Samples,
    detect_kind,
    detect_kind_in,
    parse_exposition,
)
from kvguard.probes.engines.llamacpp import LlamacppAdapter
from kvguard.probes.engines.sglang import SglangAdapter
from kvguard.probes.engines.tgi import TgiAdapter
from kvguard.probes.engines.trtllm import TrtllmAdapter
from kvguard.probes.engines.vllm import VllmAdapter

ADAPTERS: Mapping[EngineKind, EngineAdapter] = MappingProxyType(
    {
        "vllm": VllmAdapter(),
        "sglang": SglangAdapter(),
        "tgi": TgiAdapter(),
        "llamacpp": LlamacppAdapter(),
        "trtllm": TrtllmAdapter(),
    }
)

__all__ = [
    "ADAPTERS",
    "EngineAdapter",
    "EngineScrape",
    "LlamacppAdapter",
    "Samples",
    "SglangAdapter",
    "TgiAdapter",
    "TrtllmAdapter",
    "VllmAdapter",
    "detect_kind",
    "detect_kind_in",
    "parse_exposition",
]
