"""Which engines' pause can drain for the fp8 switch without the proxy."""

from __future__ import annotations

import pytest

from kvguard.actuators.drain import EnginePauseDrain
from kvguard.actuators.engine_admin import EngineAdmin


async def _no_stats() -> None:
    return None


@pytest.mark.parametrize(("kind", "drains"), [("vllm", True), ("sglang", False), ("tgi", False)])
def test_only_a_pause_that_lets_requests_finish_can_drain(kind, drains):
    """Mode=wait (vLLM) lets running requests finish; in_place (SGLang) freezes them."""
    admin = EngineAdmin("http://127.0.0.1:9", kind)
    assert EnginePauseDrain(admin, _no_stats).can_stop_admitting() is drains
