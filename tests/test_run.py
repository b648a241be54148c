"""The daemon against a real simulated engine: exporter, HTTP API, CLI, signals."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import re
import signal
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from kvguard.api.app import build_app
from kvguard.config.settings import parse_config
from kvguard.core.units import GiB
from kvguard.probes.engine import EngineProbe
from kvguard.probes.host import HostProbe
from kvguard.probes.nvml import GpuSelector, NvmlProbe
from kvguard.runtime.daemon import Daemon
from kvguard.runtime.probing import Probes
from kvguard.testing import FakeGpu, FakeNvml
from tests.helpers import free_port, strict_json, until

KVGUARD = str(Path(sys.executable).parent / "kvguard")

METRICS = (
    "kvguard_gpu_memory_total_bytes",
    "kvguard_gpu_memory_used_bytes",
    "kvguard_gpu_memory_reserved_bytes",
    "kvguard_gpu_process_memory_bytes",
    "kvguard_host_memory_available_bytes",
    "kvguard_engine_process_resident_bytes",
    "kvguard_kv_cache_usage_ratio",
    "kvguard_kv_cache_capacity_tokens",
    "kvguard_kv_cache_used_tokens",
    "kvguard_kv_bytes_per_token",
    "kvguard_requests_running",
    "kvguard_requests_waiting",
    "kvguard_engine_preemptions_total",
    "kvguard_budget_bytes",
    "kvguard_budget_kv_capacity_tokens",
    "kvguard_engine_kv_capacity_tokens",
    "kvguard_engine_up",
    "kvguard_probe_up",
    "kvguard_probe_duration_seconds",
    "kvguard_probe_errors_total",
    "kvguard_tick_duration_seconds",
    "kvguard_build_info",
)


def samples(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Exposition text parsed with prometheus_client: {name: {labels: value}}."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def one(values: dict, name: str, **labels: str) -> float:
    """The single value of ``name`` with ``labels``."""
    return values[name][tuple(sorted(labels.items()))]


async def get(url: str) -> tuple[int, str]:
    """GET ``url``: status and body."""
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        return resp.status, await resp.text()


async def start_api(daemon: Daemon) -> tuple[web.AppRunner, str]:
    """Serve the daemon's API on a free loopback port."""
    runner = web.AppRunner(build_app(daemon))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@pytest.fixture
async def watched(sim_server):
    """A sim engine sized by the budget, and a daemon watching it with a fake 24 GiB GPU."""
    server = await sim_server(model="llama-3.1-8b", gpu_memory_bytes=24 * GiB, per_token_s=0.0005)
    config = parse_config(
        {
            "engine": {"url": server.url},
            "model": {
                "config": "llama-3.1-8b",
                "max_model_len": 4096,
                "max_num_seqs": 64,
                "max_num_batched_tokens": 2048,
            },
            "poll": {"timeout_s": 1.0},
        },
        env={},
    )
    nvml = FakeNvml(
        [
            FakeGpu(
                "NVIDIA L4 (fake)",
                "GPU-fake-0",
                24 * GiB,
                20 * GiB,
                300 * 2**20,
                {os.getpid(): 19 * GiB},
            )
        ]
    )
    probes = Probes(
        engine=EngineProbe(server.url, timeout_s=1.0),
        nvml=NvmlProbe(GpuSelector(), nvml=nvml, timeout_s=1.0),
        host=HostProbe(pid=os.getpid()),
    )
    daemon = Daemon(config, probes=probes)
    runner, url = await start_api(daemon)
    yield server, daemon, url
    await runner.cleanup()
    await daemon.close()


async def test_every_metric_tracks_the_engine_under_load(watched):
    """With requests frozen mid-flight, each kvguard_* figure equals the sim's own state."""
    server, daemon, url = watched
    body = {"prompt": "word " * 500, "max_tokens": 2000}
    async with aiohttp.ClientSession() as http:
        inflight = [
            asyncio.ensure_future(http.post(f"{server.url}/v1/completions", json=body))
            for _ in range(5)
        ]
        await until(
            lambda: (
                len(server.engine.scheduler.running) == 5
                and server.engine.stats.generation_tokens_total >= 20
            )
        )
        server.engine.pause("keep")  # freeze: the truth stops moving while we compare
        await daemon.tick()
        status, text = await get(f"{url}/metrics")
        sched = server.engine.scheduler
        usage, used_blocks = sched.usage, sched.used_blocks
        server.engine.pause("abort")
        for task in inflight:
            (await task).close()
    assert status == 200
    values = samples(text)
    for name in METRICS:
        assert name in values, name
    config = server.engine.config
    assert usage > 0
    assert one(values, "kvguard_kv_cache_usage_ratio") == pytest.approx(usage)
    assert one(values, "kvguard_kv_cache_used_tokens") == used_blocks * config.block_size
    assert (
        one(values, "kvguard_kv_cache_capacity_tokens") == config.num_gpu_blocks * config.block_size
    )
    assert one(values, "kvguard_requests_running") == 5
    assert one(values, "kvguard_requests_waiting") == 0
    assert one(values, "kvguard_engine_up") == 1
    budget = daemon.state.budget.budget
    assert one(values, "kvguard_budget_kv_capacity_tokens") == budget.kv_capacity_tokens
    assert one(values, "kvguard_engine_kv_capacity_tokens") == budget.kv_capacity_tokens
    assert one(values, "kvguard_budget_bytes", component="weights") == budget.weights_bytes_per_gpu
    assert one(values, "kvguard_kv_bytes_per_token") == 131_072
    assert one(values, "kvguard_gpu_memory_total_bytes", gpu="0") == 24 * GiB
    assert one(values, "kvguard_gpu_memory_used_bytes", gpu="0") == 20 * GiB
    assert one(values, "kvguard_gpu_memory_reserved_bytes", gpu="0") == 300 * 2**20
    assert (
        one(values, "kvguard_gpu_process_memory_bytes", gpu="0", pid=str(os.getpid())) == 19 * GiB
    )
    assert one(values, "kvguard_engine_process_resident_bytes") > 0
    assert one(values, "kvguard_probe_up", probe="nvml") == 1
    assert one(values, "kvguard_build_info", version=daemon.version) == 1


async def test_api_endpoints_tell_the_truth(watched):
    """/healthz and /readyz answer 200 after a tick; /status carries budget and reconciliation."""
    _, daemon, url = watched
    assert (await get(f"{url}/healthz"))[0] == 503  # no tick yet
    await daemon.tick()
    assert (await get(f"{url}/healthz"))[0] == 200
    assert (await get(f"{url}/readyz"))[0] == 200
    status, text = await get(f"{url}/status")
    doc = json.loads(text)
    assert status == 200
    assert doc["engine"]["kind"] == "vllm"
    assert doc["engine"]["actions"] == ["abort", "evict", "pause"]
    assert doc["reconciliation"]["difference_tokens"] == 0
    assert doc["budget"]["kv_bytes_per_token"] == 131_072
    assert doc["sources"]["engine"]["ok"] is True
    assert doc["config"]["engine"]["token"] is None
    # The level holds since kvguard's first tick, never longer than kvguard has run.
    assert 0 <= doc["pressure"]["level_for_s"] <= doc["uptime_s"]


async def test_status_is_strict_json_once_a_decision_is_recorded(sim_server):
    """/status after a level change: a strict parser reads it; +Inf is null there too.

    The engine is frozen with its cache past `elevated`'s usage and the (fake) GPU's
    memory never moves: the recorded decision's signals hold the GPU's time to
    exhaustion as +Inf (not rising), which /status writes as null, like the forecast's.
    """
    server = await sim_server(kv_capacity_tokens=4096, max_model_len=2048)
    config = parse_config({"engine": {"url": server.url}, "poll": {"timeout_s": 1.0}}, env={})
    nvml = FakeNvml([FakeGpu("NVIDIA L4 (fake)", "GPU-fake-0", 24 * GiB, 20 * GiB)])
    probes = Probes(
        engine=EngineProbe(server.url, timeout_s=1.0),
        nvml=NvmlProbe(GpuSelector(), nvml=nvml, timeout_s=1.0),
        host=None,
    )
    daemon = Daemon(config, probes=probes)
    runner, url = await start_api(daemon)
    body = {"prompt": "word " * 1000, "max_tokens": 1000}
    try:
        async with aiohttp.ClientSession() as http:
            inflight = [
                asyncio.ensure_future(http.post(f"{server.url}/v1/completions", json=body))
                for _ in range(4)
            ]
            await until(lambda: server.engine.scheduler.usage >= 0.85)
            server.engine.pause("keep")  # usage stays put: the trend is flat
            for _ in range(config.policy.confirm_ticks):
                await daemon.tick()
            status, text = await get(f"{url}/status")
            server.engine.pause("abort")
            for task in inflight:
                (await task).close()
    finally:
        await runner.cleanup()
        await daemon.close()
    assert status == 200
    doc = strict_json(text)
    assert isinstance(doc, dict)
    pressure = doc["pressure"]
    assert pressure["level"] != "ok"
    # The GPU's memory does not move: its time to exhaustion is +Inf, written null.
    assert pressure["forecast"]["gpu_time_to_exhaustion_s"] is None
    decision = pressure["decisions"][-1]  # the oldest: the change from ok
    assert (decision["previous_level"], decision["level"]) == ("ok", pressure["level"])
    assert decision["signals"]["gpu_time_to_exhaustion_s"] is None
    assert decision["signals"]["kv_usage"] >= 0.85


async def test_metrics_negotiate_openmetrics_and_gzip(watched):
    """/metrics: OpenMetrics when asked for (Prometheus asks), gzip when accepted, else text.

    The same series either way: OpenMetrics parses cleanly (prometheus_client's strict
    parser) and names the same samples as the text format.
    """
    _, daemon, url = watched
    await daemon.tick()
    openmetrics = "application/openmetrics-text; version=1.0.0"
    async with aiohttp.ClientSession(auto_decompress=False) as http:
        plain_headers = {"Accept": "text/plain", "Accept-Encoding": "identity"}
        async with http.get(f"{url}/metrics", headers=plain_headers) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            assert "Content-Encoding" not in resp.headers
            text = await resp.text()
        om_headers = {"Accept": openmetrics, "Accept-Encoding": "identity"}
        async with http.get(f"{url}/metrics", headers=om_headers) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
            om = await resp.text()
        gzip_headers = {"Accept": openmetrics, "Accept-Encoding": "gzip"}
        async with http.get(f"{url}/metrics", headers=gzip_headers) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Encoding"] == "gzip"
            assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
            zipped = gzip.decompress(await resp.read()).decode()
    assert om.endswith("# EOF\n")
    assert zipped.endswith("# EOF\n")

    def keys(families) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
        return {(s.name, tuple(sorted(s.labels.items()))) for f in families for s in f.samples}

    om_keys = keys(openmetrics_families(om))
    assert om_keys == keys(text_string_to_metric_families(text))
    assert om_keys == keys(openmetrics_families(zipped))
    assert {name for name, _ in om_keys} >= set(METRICS)


async def test_a_dead_engine_keeps_the_loop_ticking(watched):
    """When the engine goes away: engine_up 0, /readyz 503, errors counted, ticks go on."""
    server, daemon, url = watched
    await daemon.tick()
    await server.stop()
    for _ in range(3):
        await daemon.tick()
    values = samples((await get(f"{url}/metrics"))[1])
    assert one(values, "kvguard_engine_up") == 0
    assert one(values, "kvguard_probe_up", probe="engine") == 0
    assert one(values, "kvguard_probe_errors_total", probe="engine") == 3
    assert one(values, "kvguard_ticks_total") == 4
    assert "kvguard_kv_cache_usage_ratio" not in values  # stale figures are not exported as live
    assert "kvguard_requests_running" not in values
    assert one(values, "kvguard_probe_age_seconds", probe="engine") >= 0
    status, text = await get(f"{url}/readyz")
    assert status == 503
    assert "engine unreachable" in text
    assert (await get(f"{url}/healthz"))[0] == 200


async def test_probe_command_prints_the_normalized_engine(sim_engine):
    """`kvguard probe --json` reports the engine's normalized figures, null where unknown."""
    url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048)
    proc = await asyncio.create_subprocess_exec(
        KVGUARD, "probe", "--engine-url", url, "--json", stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 0
    engine = json.loads(out)["engine"]
    assert engine["kind"] == "vllm"
    assert engine["up"] is True
    assert (engine["kv_capacity_blocks"], engine["block_size"]) == (256, 16)
    for key in (
        "kv_cache_usage_ratio",
        "requests_running",
        "requests_waiting",
        "preemptions_total",
        "prompt_tokens_total",
        "generation_tokens_total",
    ):
        assert engine[key] == 0, key


async def test_probe_says_when_llamacpps_layout_is_assumed(sim_engine, tmp_path):
    """llama.cpp undeclared: the table shows kv_layout "unified (assumed)" and how to set it."""
    url = await sim_engine(
        flavor="llamacpp", kv_capacity_tokens=4096, max_model_len=1000, max_num_seqs=4
    )
    path = tmp_path / "kvguard.toml"
    path.write_text(f'[engine]\nurl = "{url}"\nkv_unified = true\n')
    outputs = []
    for args in (("--engine-url", url), ("--config", str(path))):
        proc = await asyncio.create_subprocess_exec(
            KVGUARD, "probe", *args, stdout=asyncio.subprocess.PIPE
        )
        out, _ = await proc.communicate()
        assert proc.returncode == 0
        outputs.append(out.decode())
    assumed, declared = outputs
    assert re.search(r"kv_layout\s+unified \(assumed\)", assumed)
    assert "set [engine] kv_unified = false" in assumed
    assert re.search(r"kv_layout\s+unified\n", declared)
    assert "note:" not in declared


async def test_probe_and_status_read_the_config_file(sim_engine, tmp_path):
    """`probe --config` probes [engine] url; without an engine at all it is a usage error."""
    url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048)
    path = tmp_path / "kvguard.toml"
    path.write_text(f'[engine]\nurl = "{url}"\n')
    proc = await asyncio.create_subprocess_exec(
        KVGUARD, "probe", "--config", str(path), "--json", stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 0
    assert json.loads(out)["engine"]["kv_capacity_blocks"] == 256
    env = {k: v for k, v in os.environ.items() if k != "KVGUARD_CONFIG"}
    proc = await asyncio.create_subprocess_exec(
        KVGUARD, "probe", stderr=asyncio.subprocess.PIPE, env=env
    )
    _, err = await proc.communicate()
    assert proc.returncode == 2
    assert "--engine-url: needed without --config" in err.decode()
    # status finds kvguard where the config says it listens (nothing there: exit 1).
    port = free_port()
    path.write_text(f'[engine]\nurl = "{url}"\n[server]\nlisten = "0.0.0.0:{port}"\n')
    proc = await asyncio.create_subprocess_exec(
        KVGUARD, "status", "--config", str(path), stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate()
    assert proc.returncode == 1
    assert f"cannot read http://127.0.0.1:{port}/status" in err.decode()


async def test_probe_command_exits_1_when_the_engine_is_unreachable():
    """An unreachable engine is reported, with exit code 1."""
    proc = await asyncio.create_subprocess_exec(
        KVGUARD,
        "probe",
        "--engine-url",
        f"http://127.0.0.1:{free_port()}",
        "--json",
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await proc.communicate()
    doc = json.loads(out)
    assert proc.returncode == 1
    assert doc["engine"]["up"] is False
    assert doc["engine"]["kv_cache_usage_ratio"] is None
    assert doc["sources"]["engine"]["ok"] is False


async def test_run_reloads_on_sighup_keeps_old_on_bad_config_and_stops_on_sigterm(
    sim_engine, tmp_path
):
    """The real command: serves, rejects a bad reload, adopts a good one, exits 0 on SIGTERM."""
    engine_url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048)
    port = free_port()
    (tmp_path / "token").write_text("tok-3f9a-secret")
    (tmp_path / "token").chmod(0o600)  # readable by others would log secret_file_exposed first
    path = tmp_path / "kvguard.toml"
    path.write_text(
        f'[engine]\nurl = "{engine_url}"\ntoken_file = "token"\n'
        f'[server]\nlisten = "127.0.0.1:{port}"\n'
        '[poll]\ninterval_s = 0.2\n[log]\nformat = "json"\n'
    )
    proc = await asyncio.create_subprocess_exec(
        KVGUARD, "run", "--config", str(path), stderr=asyncio.subprocess.PIPE
    )
    api = f"http://127.0.0.1:{port}"
    try:
        events = await read_events(proc, until="started")
        assert (await get(f"{api}/readyz"))[0] == 200

        path.write_text('[engine]\nurl = "not a url"\n')
        proc.send_signal(signal.SIGHUP)
        rejected = (await read_events(proc, until="config_reload_rejected"))[-1]
        assert rejected["problems"] == [
            "engine.url: must be an http(s) URL with a host, e.g."
            " http://127.0.0.1:8000, got 'not a url'"
        ]
        status_text = (await get(f"{api}/status"))[1]
        doc = json.loads(status_text)
        assert doc["config"]["engine"]["url"] == engine_url
        assert doc["config"]["poll"]["interval_s"] == 0.2
        assert doc["config"]["engine"]["token"] == "***"
        assert "tok-3f9a-secret" not in status_text
        assert "tok-3f9a-secret" not in json.dumps([*events, rejected])

        path.write_text(
            f'[engine]\nurl = "{engine_url}"\n[server]\nlisten = "127.0.0.1:{port}"\n'
            "[poll]\ninterval_s = 0.3\n"
        )
        proc.send_signal(signal.SIGHUP)
        await read_events(proc, until="config_reloaded")
        doc = json.loads((await get(f"{api}/status"))[1])
        assert doc["config"]["poll"]["interval_s"] == 0.3

        status_out = await asyncio.create_subprocess_exec(
            KVGUARD, "status", "--url", api, stdout=asyncio.subprocess.PIPE
        )
        text = (await status_out.communicate())[0].decode()
        assert f"Engine   {engine_url}  kind vllm  up True" in text
    finally:
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 10)
    assert code == 0
    assert events[0]["event"] in ("nvml_unavailable", "started", "probe_failed")


async def read_events(
    proc: asyncio.subprocess.Process, until: str, timeout: float = 15
) -> list[dict]:
    """JSON log events from the process's stderr, up to the first ``until`` event."""
    assert proc.stderr is not None
    events = []
    async with asyncio.timeout(timeout):
        while True:
            line = await proc.stderr.readline()
            assert line, f"process exited before {until!r}: {events}"
            event = strict_json(line)
            assert isinstance(event, dict), line
            events.append(event)
            if event["event"] == until:
                return events


async def test_status_watch_redraws_until_interrupted(watched):
    """`kvguard status --watch` redraws the view in place and exits 0 on Ctrl-C."""
    _, daemon, url = watched
    await daemon.tick()
    # A test run started in the background (`nohup pytest &`) ignores SIGINT, and an
    # ignored signal stays ignored across exec: the child would never see the Ctrl-C.
    # A handler (not SIG_IGN) in this process is reset to the default in the child.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = await asyncio.create_subprocess_exec(
            KVGUARD,
            "status",
            "--url",
            url,
            "--watch",
            "--interval",
            "0.05",
            stdout=asyncio.subprocess.PIPE,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    assert proc.stdout is not None
    seen = b""
    async with asyncio.timeout(15):
        while seen.count(b"\x1b[H\x1b[2J") < 2:
            seen += await proc.stdout.read(4096)
    proc.send_signal(signal.SIGINT)
    # Read on to the end: a watch still drawing must not block on a full pipe.
    rest, _ = await asyncio.wait_for(proc.communicate(), 10)
    assert proc.returncode == 0, rest[-2000:]
    assert b"kind vllm  up True" in seen


async def test_status_says_when_kvguard_is_not_there():
    """An unreachable kvguard is one plain error line and exit 1 (2 is for usage)."""
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        KVGUARD, "status", "--url", f"127.0.0.1:{port}/", stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate()
    assert proc.returncode == 1
    text = err.decode()
    assert text.startswith(f"kvguard status: cannot read http://127.0.0.1:{port}/status:")
    assert "nothing answers there" in text
    assert "ssl:default" not in text


async def test_status_shows_the_pressure_and_takes_a_bare_address(watched):
    """One kvguard: level, binding resource, what exhausts first, pattern, mitigations."""
    _, daemon, url = watched
    await daemon.tick()
    bare = url.removeprefix("http://") + "/"
    proc = await asyncio.create_subprocess_exec(
        KVGUARD, "status", "--url", bare, "--url", url, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0
    text = out.decode()
    assert text.startswith("kvguard ")  # one kvguard (both spellings), not a fleet table
    (pressure,) = [line for line in text.splitlines() if line.startswith("Pressure ")]
    assert pressure.startswith("Pressure ok for ")
    # What binds is /status's pressure.binding_resource; nothing fills an idle engine.
    binds = json.loads((await get(f"{url}/status"))[1])["pressure"]["binding_resource"]
    assert f"  binding {binds}  exhausts first nothing (not rising)  pattern " in pressure
    assert "Active   no mitigation in force" in text


async def _status_watch(address: str) -> asyncio.subprocess.Process:
    """``kvguard status --url ADDRESS --watch`` every 0.05 s, its stdout piped.

    A test run in the background ignores SIGINT, and an ignored signal stays ignored
    across exec: with a handler set here meanwhile, the child gets the default one and
    the test's Ctrl-C (send_signal) stops it as a user's would.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return await asyncio.create_subprocess_exec(
            KVGUARD,
            *("status", "--url", address, "--watch", "--interval", "0.05"),
            stdout=asyncio.subprocess.PIPE,
        )
    finally:
        signal.signal(signal.SIGINT, previous)


async def test_status_watch_keeps_going_while_kvguard_is_away():
    """--watch on an address nothing answers: it redraws "unreachable since", never exits."""
    proc = await _status_watch(f"127.0.0.1:{free_port()}")
    assert proc.stdout is not None
    seen = b""
    async with asyncio.timeout(15):
        while seen.count(b"unreachable since") < 3:
            seen += await proc.stdout.read(4096)
    assert proc.returncode is None  # still running after three failed reads
    proc.send_signal(signal.SIGINT)
    await asyncio.wait_for(proc.communicate(), 10)
    assert proc.returncode == 1  # the last read failed


async def test_status_watch_shows_kvguard_again_once_it_is_back(watched):
    """--watch through a restart: "unreachable since …" while away, the view once back.

    /status is served from a loopback server stopped and started again on the same
    port; the watch never exits meanwhile, and Ctrl-C after the return exits 0 (the
    last read succeeded).
    """
    _, daemon, url = watched
    await daemon.tick()
    doc = json.loads((await get(f"{url}/status"))[1])
    port = free_port()

    async def serve() -> web.AppRunner:
        async def status(_: web.Request) -> web.Response:
            return web.json_response(doc)

        app = web.Application()
        app.router.add_get("/status", status)
        runner = web.AppRunner(app, shutdown_timeout=1.0)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    runner: web.AppRunner | None = await serve()
    proc = await _status_watch(f"127.0.0.1:{port}")
    assert proc.stdout is not None
    stdout = proc.stdout
    seen = b""

    async def read_until(marker: bytes, times: int = 1) -> None:
        """Read the watch's output until ``marker`` shows ``times`` more times."""
        nonlocal seen
        start = len(seen)
        async with asyncio.timeout(15):
            while seen[start:].count(marker) < times:
                chunk = await stdout.read(4096)
                assert chunk, f"the watch exited: {seen[-2000:]!r}"
                seen += chunk

    try:
        await read_until(b"kind vllm  up True")
        await runner.cleanup()  # kvguard goes away
        runner = None
        await read_until(b"unreachable since", times=3)
        assert proc.returncode is None
        runner = await serve()  # and comes back, same address
        await read_until(b"kind vllm  up True")
        assert proc.returncode is None
        proc.send_signal(signal.SIGINT)
        await asyncio.wait_for(proc.communicate(), 10)
        assert proc.returncode == 0  # the last read succeeded
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if runner is not None:
            await runner.cleanup()


@pytest.fixture
async def bad_engine():
    """A loopback server whose /metrics hangs, fails with 500, or answers garbage."""
    mode = {"now": "ok"}

    async def metrics(_: web.Request) -> web.Response:
        if mode["now"] == "hang":
            await asyncio.sleep(30)
        if mode["now"] == "500":
            return web.Response(status=500, text="boom")
        if mode["now"] == "garbage":
            return web.Response(text="vllm:num_requests_running{engine= 3\n\x00\x01")
        return web.Response(text='vllm:num_requests_running{engine="0",model_name="m"} 2.0\n')

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}", mode
    await runner.cleanup()


async def test_engine_and_nvml_faults_leave_the_loop_ticking(bad_engine):
    """Hung, failing, garbage engine answers and a lost GPU: right *_up values, ticks go on."""
    url, mode = bad_engine
    config = parse_config({"engine": {"url": url}, "poll": {"timeout_s": 0.3}}, env={})
    nvml = FakeNvml([FakeGpu("fake", "GPU-0", 80 * GiB, 10 * GiB)])
    probes = Probes(
        engine=EngineProbe(url, timeout_s=0.3),
        nvml=NvmlProbe(GpuSelector(), nvml=nvml, timeout_s=0.3),
        host=None,
    )
    daemon = Daemon(config, probes=probes)
    runner, api = await start_api(daemon)
    try:
        expectations = {"ok": 1, "hang": 0, "500": 0, "garbage": 0}
        for ticks, (now, engine_up) in enumerate(expectations.items(), start=1):
            mode["now"] = now
            await asyncio.wait_for(daemon.tick(), 2)
            values = samples((await get(f"{api}/metrics"))[1])
            assert one(values, "kvguard_engine_up") == engine_up, now
            assert one(values, "kvguard_probe_up", probe="engine") == engine_up, now
            assert one(values, "kvguard_ticks_total") == ticks
        assert one(values, "kvguard_probe_errors_total", probe="engine") == 3
        nvml.lose_gpu(0)
        mode["now"] = "ok"
        await daemon.tick()
        values = samples((await get(f"{api}/metrics"))[1])
        assert one(values, "kvguard_probe_up", probe="nvml") == 0
        assert one(values, "kvguard_engine_up") == 1
        nvml.restore_gpu(0)
        await daemon.tick()
        values = samples((await get(f"{api}/metrics"))[1])
        assert one(values, "kvguard_probe_up", probe="nvml") == 1
    finally:
        await runner.cleanup()
        await daemon.close()


async def test_status_says_the_pressure_is_unknown_while_the_engine_is_not_read(bad_engine):
    """An engine that stops answering: no "ok … not rising … steady" headline.

    `kvguard status` says the level is no measurement, and how old the last good read
    is; before the first good read it says the engine was never read. A refused
    connection reads "nothing answers there", not aiohttp's "ssl:default".
    """
    url, mode = bad_engine
    dead = f"http://127.0.0.1:{free_port()}"
    for engine_url in (dead, url):
        config = parse_config({"engine": {"url": engine_url}, "poll": {"timeout_s": 0.3}}, env={})
        probes = Probes(engine=EngineProbe(engine_url, timeout_s=0.3), nvml=None, host=None)
        daemon = Daemon(config, probes=probes)
        runner, api = await start_api(daemon)
        try:
            mode["now"] = "ok"
            if engine_url == url:
                await daemon.tick()  # one good read, then the engine fails
                mode["now"] = "500"
            await daemon.tick()
            proc = await asyncio.create_subprocess_exec(
                KVGUARD, "status", "--url", api, stdout=asyncio.subprocess.PIPE
            )
            out, _ = await asyncio.wait_for(proc.communicate(), 30)
        finally:
            await runner.cleanup()
            await daemon.close()
        assert proc.returncode == 0  # kvguard itself was read
        text = out.decode()
        (pressure,) = [line for line in text.splitlines() if line.startswith("Pressure ")]
        assert "binding" not in pressure
        assert "not rising" not in pressure
        if engine_url == dead:
            assert pressure.startswith(
                "Pressure UNKNOWN: the engine has not been read since kvguard started;"
            )
            assert "nothing answers there (" in text
            assert "ssl:default" not in text
        else:
            unread = r"Pressure UNKNOWN: the engine's last good read is \d+ s old;"
            assert re.match(unread, pressure)
        assert "kvguard's level is ok for " in pressure


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
async def test_run_serves_the_proxy_when_enabled(sim_engine, tmp_path, loop):
    """`kvguard run` with [proxy] enabled forwards to the engine and accounts the requests.

    On either event loop (KVGUARD_EVENT_LOOP; uvloop from the ``fast`` extra, which
    the test install includes), and the ``started`` event says which one runs.
    """
    engine_url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048)
    api_port, proxy_port = free_port(), free_port()
    path = tmp_path / "kvguard.toml"
    path.write_text(
        f'[engine]\nurl = "{engine_url}"\n[server]\nlisten = "127.0.0.1:{api_port}"\n'
        f'[proxy]\nenabled = true\nlisten = "127.0.0.1:{proxy_port}"\n[log]\nformat = "json"\n'
    )
    proc = await asyncio.create_subprocess_exec(
        KVGUARD,
        "run",
        "--config",
        str(path),
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "KVGUARD_EVENT_LOOP": loop},
    )
    try:
        started = (await read_events(proc, until="started"))[-1]
        assert started["event_loop"] == loop
        assert started["proxy"] == f"127.0.0.1:{proxy_port}"
        body = {"prompt": "word " * 20, "max_tokens": 5}
        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"http://127.0.0.1:{proxy_port}/v1/completions", json=body
            ) as resp:
                assert resp.status == 200
                assert (await resp.json())["usage"] == {
                    "prompt_tokens": 20,
                    "completion_tokens": 5,
                    "total_tokens": 25,
                }
            async with http.get(f"http://127.0.0.1:{proxy_port}/v1/models") as resp:
                assert resp.status == 200
        values = samples((await get(f"http://127.0.0.1:{api_port}/metrics"))[1])
        assert one(values, "kvguard_request_prompt_tokens_count") == 1
        assert one(values, "kvguard_inflight_requests") == 0
        assert one(values, "kvguard_event_loop_tasks") >= 2  # the ticks, this handler, ...
        doc = json.loads((await get(f"http://127.0.0.1:{api_port}/status"))[1])
        assert doc["proxy"]["upstream"] == engine_url
        assert doc["mitigations"]["enforcing"] is True
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
