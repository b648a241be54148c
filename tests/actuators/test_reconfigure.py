"""The fp8 KV switch against a real simulated engine that kvguard supervises.

The engine runs as a child process (``kvguard sim-engine``), kvguard's proxy sits in
front of it, and the switch drains the proxy, restarts the child with
``--kv-cache-dtype fp8`` and checks what the engine reports afterwards.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp
import pytest

from kvguard.actuators.reconfigure import (
    CommandRestarter,
    SupervisorRestarter,
    SystemdRestarter,
    engine_environment,
)
from tests.actuators.conftest import Rig, streamed, supervised_rig
from tests.helpers import until


@pytest.fixture
async def rig():
    """Start the rig; stop the engine and the proxy afterwards, whatever happened."""
    async with supervised_rig() as setup:
        yield setup


async def test_switch_drains_restarts_with_fp8_and_reverts(rig: Rig):
    """In flight finishes; new requests get 503 meanwhile; the pool doubles, then comes back."""
    capacity = await rig.healthy()
    reconfigurer = rig.switch(drain_timeout_s=20, start_timeout_s=30)
    async with aiohttp.ClientSession() as http:
        running = asyncio.ensure_future(
            http.post(f"{rig.proxy_url}/v1/completions", json=streamed(60))
        )
        await until(lambda: len(rig.proxy.inflight) == 1)
        switch = asyncio.ensure_future(reconfigurer.switch(fp8=True))
        await until(lambda: rig.mitigations.draining)
        async with http.post(
            f"{rig.proxy_url}/v1/completions",
            json=streamed(5),
            headers={"X-Priority": "critical"},
        ) as refused:
            assert refused.status == 503
            assert "Retry-After" in refused.headers
            assert (await refused.json())["error"]["code"] == "kv_cache_reconfigure"
        async with await running as answer:
            assert answer.status == 200
            body = await answer.text()
        assert body.rstrip().endswith("data: [DONE]")  # finished whole within the drain
        result = await switch
    assert result.result == "succeeded", result.detail
    assert result.cancelled == 0
    assert result.cache_dtype == "fp8"
    assert not rig.mitigations.draining  # re-admitting
    assert await rig.healthy() == 2 * capacity
    assert "--kv-cache-dtype" in rig.supervisor.argv

    back = await reconfigurer.switch(fp8=False)
    assert back.result == "succeeded", back.detail
    assert await rig.healthy() == capacity
    assert reconfigurer.results[("kv_fp8", "succeeded")] == 1
    assert reconfigurer.results[("revert_kv_fp8", "succeeded")] == 1
    assert rig.supervisor.restarts == {"reconfigure": 2}


async def test_what_outlasts_the_drain_is_cancelled_with_a_clear_error(rig: Rig):
    """A request still running at drain_timeout_s ends with an error event, and is counted."""
    await rig.healthy()
    reconfigurer = rig.switch(drain_timeout_s=0.3, start_timeout_s=30)
    async with aiohttp.ClientSession() as http:
        running = asyncio.ensure_future(
            http.post(f"{rig.proxy_url}/v1/completions", json=streamed(1500))
        )
        await until(lambda: len(rig.proxy.inflight) == 1)
        result = await reconfigurer.switch(fp8=True)
        async with await running as answer:
            body = await answer.text()
    assert result.result == "succeeded", result.detail
    assert result.cancelled == 1
    error = json.loads(body.strip().splitlines()[-1].removeprefix("data: "))["error"]
    assert error["code"] == "kv_cache_reconfigure"
    assert "drain timeout" in error["message"]
    assert rig.proxy.counters.cancelled["drain"] == 1


async def test_a_whole_answer_still_running_at_the_timeout_gets_the_drain_error(rig: Rig):
    """A non-streaming request (no headers from the engine yet) is cut too, with a 503."""
    await rig.healthy()
    reconfigurer = rig.switch(drain_timeout_s=0.3, start_timeout_s=30)
    async with aiohttp.ClientSession() as http:
        body = {"prompt": "hello " * 20, "max_tokens": 1500}
        running = asyncio.ensure_future(http.post(f"{rig.proxy_url}/v1/completions", json=body))
        await until(lambda: len(rig.proxy.inflight) == 1)
        result = await reconfigurer.switch(fp8=True)
        async with await running as answer:
            assert answer.status == 503
            assert int(answer.headers["Retry-After"]) >= 1
            error = (await answer.json())["error"]
    assert result.result == "succeeded", result.detail
    assert result.cancelled == 1
    assert error["code"] == "kv_cache_reconfigure"
    assert rig.proxy.counters.cancelled["drain"] == 1


async def test_a_failed_restart_rolls_back_to_the_original_command(rig: Rig):
    """fp8 flags the engine rejects: it exits, and again when the supervisor retries it.

    The original command comes back then, not after ``start_timeout_s``: admission stays
    stopped until the rollback, and the flags would fail on every retry.
    """
    capacity = await rig.healthy()
    original = list(rig.supervisor.argv)
    # llama.cpp's flags on a simulated vLLM: the engine refuses to start with them.
    reconfigurer = rig.switch("llamacpp", drain_timeout_s=5, start_timeout_s=300)
    began = time.monotonic()
    result = await reconfigurer.switch(fp8=True)
    assert result.result == "rolled_back", result.detail
    assert "the engine exited 2 times (last with code 2) before it was healthy" in result.detail
    # Two exits 1 s of backoff apart and a healthy rollback: seconds, not the 300 s allowed.
    assert time.monotonic() - began < 30
    assert rig.supervisor.argv == original
    assert await rig.healthy() == capacity
    assert not reconfigurer.fp8
    assert not rig.mitigations.draining
    assert reconfigurer.results[("kv_fp8", "rolled_back")] == 1


async def test_one_switch_at_a_time(rig: Rig):
    """A second switch while one runs is refused, not queued."""
    await rig.healthy()
    reconfigurer = rig.switch(drain_timeout_s=5, start_timeout_s=30)
    first = asyncio.ensure_future(reconfigurer.switch(fp8=True))
    await until(lambda: reconfigurer.busy)
    second = await reconfigurer.switch(fp8=True)
    assert second.result == "failed"
    assert "already running" in second.detail
    assert (await first).result == "succeeded"


# ---------------------------------------------------------------------- other modes
def _recorder(tmp_path: Path) -> list[str]:
    """A stand-in for systemctl / kubectl: records its argv and environment, exits 0."""
    script = tmp_path / "record.py"
    script.write_text(
        "import json, os, sys\n"
        f"with open({str(tmp_path / 'calls.jsonl')!r}, 'a') as f:\n"
        "    env = {k: v for k, v in os.environ.items() if k.startswith('KVGUARD_')}\n"
        "    f.write(json.dumps({'argv': sys.argv[1:], 'env': env}) + '\\n')\n"
    )
    return [sys.executable, str(script)]


def _calls(tmp_path: Path) -> list[dict]:
    lines = (tmp_path / "calls.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


async def test_systemd_mode_writes_a_dropin_and_restarts_the_unit(tmp_path: Path):
    """fp8: a drop-in with the flags, daemon-reload, restart; revert removes it."""
    restarter = SystemdRestarter(
        "vllm.service", "vllm", dropin_dir=str(tmp_path / "units"), systemctl=_recorder(tmp_path)
    )
    await restarter.apply(fp8=True)
    dropin = tmp_path / "units" / "vllm.service.d" / "50-kvguard-kv-cache.conf"
    text = dropin.read_text()
    assert "[Service]" in text
    assert '"KVGUARD_ENGINE_FLAGS=--kv-cache-dtype fp8"' in text
    assert [c["argv"] for c in _calls(tmp_path)] == [
        ["daemon-reload"],
        ["restart", "vllm.service"],
    ]
    await restarter.apply(fp8=False)
    assert not dropin.exists()
    assert len(_calls(tmp_path)) == 4


async def test_command_mode_passes_the_change_in_the_environment(tmp_path: Path):
    """Your argv runs as given (no shell), with KVGUARD_* saying what to do."""
    restarter = CommandRestarter([*_recorder(tmp_path), "patch", "deploy/vllm"], "sglang")
    await restarter.apply(fp8=True)
    await restarter.apply(fp8=False)
    first, second = _calls(tmp_path)
    assert first["argv"] == ["patch", "deploy/vllm"]
    told = engine_environment("sglang", fp8=True)
    # Only what kvguard adds: the environment it runs in may hold KVGUARD_* of its own.
    assert {k: first["env"].get(k) for k in told} == told
    assert first["env"]["KVGUARD_ENGINE_FLAGS"] == "--kv-cache-dtype fp8_e5m2"
    assert second["env"]["KVGUARD_ACTION"] == "revert_kv_fp8"
    assert second["env"]["KVGUARD_KV_CACHE_DTYPE"] == "auto"


async def test_a_failing_command_is_a_clear_error_that_keeps_its_output_in_the_log(
    tmp_path: Path,
):
    """Exit status in the error (which reaches webhooks); the output only in the log."""
    from structlog.testing import capture_logs  # noqa: PLC0415

    from kvguard.actuators.reconfigure import ReconfigureError  # noqa: PLC0415

    fail = [sys.executable, "-c", "import sys; print('token=abc123'); sys.exit(3)", "--key=s"]
    with capture_logs() as logs, pytest.raises(ReconfigureError) as caught:
        await CommandRestarter(fail, "vllm").apply(fp8=True)
    assert "exited 3" in str(caught.value)
    assert "abc123" not in str(caught.value)
    assert "--key=s" not in str(caught.value)
    (event,) = [e for e in logs if e["event"] == "restart_command_failed"]
    assert event["output"] == ["token=abc123"]


class _CountingSupervisor:
    """A supervisor's counters only: what SupervisorRestarter reads."""

    def __init__(self) -> None:
        self.argv = ["vllm", "serve", "m"]
        self.restarts: Counter[str] = Counter()
        self.last_exit_code: int | None = None
        self.exit_during_restart = False

    async def restart(self, argv: list[str]) -> None:
        self.argv = list(argv)
        if self.exit_during_restart:  # the replaced engine's exit, seen mid-spawn
            self.crash(1)

    def crash(self, code: int, reason: str = "crash") -> None:
        self.restarts[reason] += 1
        self.last_exit_code = code


async def test_only_the_restarted_engines_second_exit_ends_the_wait():
    """Exits are counted from the restart on, and one may pass (a retry may come up)."""
    supervisor = _CountingSupervisor()
    restarter = SupervisorRestarter(supervisor, "vllm")  # type: ignore[arg-type]
    supervisor.exit_during_restart = True
    await restarter.apply(fp8=True)
    assert restarter.exited() is None  # the old engine's exit is not the new one's
    supervisor.crash(2)
    assert restarter.exited() is None  # once: the supervisor retries it
    supervisor.crash(3, reason="oom")
    assert (
        restarter.exited() == "the engine exited 2 times (last with code 3) before it was healthy"
    )
    await restarter.apply(fp8=False)  # the rollback counts afresh
    assert restarter.exited() is None


def test_systemd_and_command_restarters_leave_it_to_health(tmp_path):
    """They cannot see the engine's process: only health (or its timeout) decides."""
    assert SystemdRestarter("vllm.service", "vllm", dropin_dir=str(tmp_path)).exited() is None
    assert CommandRestarter(["true"], "vllm").exited() is None
