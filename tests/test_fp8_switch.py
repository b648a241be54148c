"""End to end: ``kvguard run -- <engine>`` switches a pressed engine to fp8, then back.

kvguard runs as a real process in supervisor mode, owning a simulated vLLM; clients
talk to kvguard's proxy. Sustained pressure (a pool over-committed by long answers)
makes the ladder decide ``kv_fp8``: the proxy drains, the engine restarts with
``--kv-cache-dtype fp8`` and twice the pool, and after a calm period ``revert_kv_fp8``
restarts it as it was. No request in flight is lost; SIGTERM ends kvguard and the engine.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import free_port, json_log_events, until

# Long wall-clock runs (20 s to minutes): the second stage of scripts/test.sh.
pytestmark = pytest.mark.slow

KVGUARD = str(Path(sys.executable).parent / "kvguard")
POOL_TOKENS = 4096


CONFIG = """
[engine]
url = "http://127.0.0.1:{engine}"
kind = "vllm"

[poll]
interval_s = 0.2
min_interval_s = 0.1
timeout_s = 1.0

[server]
listen = "127.0.0.1:{api}"

[log]
level = "warning"
format = "json"

[proxy]
enabled = true
listen = "127.0.0.1:{proxy}"
# The switch under pressure in the engine itself: admission (the default) would hold
# three of the seven at the door, and a drain refuses what waits there.
admission = "off"

[policy]
confirm_ticks = 1
hold_s = 2.0
fp8_after_s = 1.0
fp8_revert_calm_s = 2.0
max_restarts_per_hour = 4

[policy.cooldowns]
kv_fp8 = 0.0
revert_kv_fp8 = 0.0

[reconfigure]
drain_timeout_s = 60.0  # the answers finish in ~10 s idle: room for a slow CI machine
start_timeout_s = 30.0
"""


async def _get_json(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(url) as resp:
        return await resp.json()


async def _metric(http: aiohttp.ClientSession, api: str, name: str, **labels: str) -> float | None:
    async with http.get(f"{api}/metrics") as resp:
        text = await resp.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


async def test_sustained_pressure_switches_to_fp8_and_calm_reverts(tmp_path: Path):
    """The pool doubles under pressure and comes back when calm; nothing in flight is lost."""
    engine, api, proxy = free_port(), free_port(), free_port()
    config = tmp_path / "kvguard.toml"
    config.write_text(CONFIG.format(engine=engine, api=api, proxy=proxy))
    command = [
        *(sys.executable, "-m", "kvguard.cli.main", "sim-engine", "--port", str(engine)),
        *("--kv-capacity-tokens", str(POOL_TOKENS), "--max-model-len", "2048"),
        *("--step-time", "0.01", "--token-time", "0.00001"),
    ]
    # Its log (JSON: stderr is no terminal) is kept, and every line parsed strictly below:
    # the drain and restart events of a real switch are written by this process only.
    log_path = tmp_path / "kvguard.log"
    with log_path.open("wb") as log_file:  # the child holds its own copy
        kvguard = await asyncio.create_subprocess_exec(
            KVGUARD, "run", "--config", str(config), "--", *command,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=log_file,
        )  # fmt: skip
    api_url, proxy_url = f"http://127.0.0.1:{api}", f"http://127.0.0.1:{proxy}"
    engine_pids: set[int] = set()
    try:
        async with aiohttp.ClientSession() as http:

            async def at(tokens: int) -> bool:
                """Whether the engine's pool is ``tokens`` now (noting the engine's PID)."""
                try:
                    status = await _get_json(http, f"{api_url}/status")
                    supervisor = ((status.get("actions") or {}).get("supervisor")) or {}
                    if supervisor.get("pid"):
                        engine_pids.add(supervisor["pid"])
                    found = await _metric(http, api_url, "kvguard_kv_cache_capacity_tokens")
                except aiohttp.ClientError:
                    return False  # kvguard is still starting
                return found == tokens

            await until(
                lambda: at(POOL_TOKENS), timeout_s=30, interval_s=0.2, what="the engine came up"
            )
            # Seven answers of 800 tokens on a 4,096-token pool: sustained pressure.
            body = {"prompt": "word " * 100, "max_tokens": 800}
            answers = [
                asyncio.ensure_future(
                    http.post(
                        f"{proxy_url}/v1/completions", json=body, headers={"X-Priority": "critical"}
                    )
                )
                for _ in range(7)
            ]
            await until(
                lambda: at(2 * POOL_TOKENS),
                timeout_s=120,
                interval_s=0.2,
                what="fp8: the pool doubled",
            )
            for answer in await asyncio.gather(*answers):
                assert answer.status == 200  # drained, not cut: every one finished
                assert (await answer.json())["usage"]["completion_tokens"] == 800

            async def counted(action: str) -> bool:
                # The pool changes as soon as the new engine answers; the switch is
                # counted after its own health check: wait for the count itself.
                labels = {"action": action, "result": "succeeded"}
                return await _metric(http, api_url, "kvguard_reconfigure_total", **labels) == 1.0

            await until(
                lambda: counted("kv_fp8"), timeout_s=10, interval_s=0.2, what="kv_fp8 counted"
            )
            dtype = await _metric(http, api_url, "kvguard_kv_cache_dtype_info", dtype="fp8")
            assert dtype == 1.0
            await until(
                lambda: at(POOL_TOKENS), timeout_s=60, interval_s=0.2, what="calm: reverted"
            )
            await until(
                lambda: counted("revert_kv_fp8"),
                timeout_s=10,
                interval_s=0.2,
                what="revert counted",
            )
            restarts = await _metric(
                http, api_url, "kvguard_engine_restarts_total", reason="reconfigure"
            )
            assert restarts == 2.0
    finally:
        if kvguard.returncode is None:
            kvguard.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(kvguard.wait(), 30)
    assert code == 0
    said = {event["event"] for event in json_log_events(log_path)}
    assert {"drain_started", "reconfigured", "pressure_level_changed"} <= said, said
    assert len(engine_pids) == 3  # the original, the fp8 one, the reverted one
    for pid in engine_pids:  # the engine never outlives kvguard
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"engine {pid} still runs after kvguard stopped")
