"""Fixtures shared by the actuator tests: aiohttp apps served on 127.0.0.1, and a rig.

The rig is a simulated engine kvguard supervises (a child process), a probe on it and
kvguard's proxy in front: what the fp8 switch drains and restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import sys
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from kvguard.actuators.drain import ProxyDrain
from kvguard.actuators.mitigations import Mitigations
from kvguard.actuators.proxy import AdmissionProxy, ProxySettings
from kvguard.actuators.reconfigure import Reconfigurer, ReconfigureTimes, SupervisorRestarter
from kvguard.actuators.supervisor import Supervisor
from kvguard.probes.engine import EngineProbe
from kvguard.runtime.assembly import listen
from tests.helpers import free_port

POOL_TOKENS = 4096


def sim_command(port: int, flavor: str = "vllm") -> list[str]:
    """``kvguard sim-engine`` as a child process: a small pool, slow steps."""
    return [
        *(sys.executable, "-m", "kvguard.cli.main", "sim-engine", "--port", str(port)),
        *("--flavor", flavor),
        *("--kv-capacity-tokens", str(POOL_TOKENS), "--max-model-len", "2048"),
        *("--step-time", "0.01", "--token-time", "0.00001"),
    ]


def streamed(max_tokens: int) -> dict:
    """A streamed completion of ``max_tokens`` tokens."""
    return {"prompt": "hello " * 20, "max_tokens": max_tokens, "stream": True}


class Rig:
    """A supervised sim engine, a probe on it, and kvguard's proxy in front."""

    def __init__(self, supervisor: Supervisor, probe: EngineProbe, proxy: AdmissionProxy) -> None:
        self.supervisor = supervisor
        self.probe = probe
        self.proxy = proxy
        self.proxy_url = ""
        self.mitigations = proxy.mitigations

    def switch(self, kind: str = "vllm", **times: float) -> Reconfigurer:
        """The fp8 switch on this rig: the proxy drains, the supervisor restarts."""
        return Reconfigurer(
            SupervisorRestarter(self.supervisor, kind),
            ProxyDrain(self.proxy, self.mitigations),
            engine_stats=self.probe.sample,
            times=ReconfigureTimes(**times),
        )

    async def healthy(self, limit_s: float = 30.0) -> int:
        """Wait until the engine answers; its KV capacity in tokens."""
        for _ in range(int(limit_s / 0.1)):
            try:
                stats = await self.probe.sample()
            except Exception:  # noqa: BLE001 - starting up: not answering yet
                stats = None
            if stats is not None and stats.up and stats.kv_capacity_tokens:
                return stats.kv_capacity_tokens
            await asyncio.sleep(0.1)
        raise AssertionError("the engine never became healthy")


@contextlib.asynccontextmanager
async def supervised_rig(flavor: str = "vllm") -> AsyncIterator[Rig]:
    """Start a rig; stop the engine and the proxy afterwards, whatever happened."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    supervisor = Supervisor(sim_command(port, flavor), output=io.StringIO(), stop_timeout_s=5)
    probe = EngineProbe(url, timeout_s=2.0)
    proxy = AdmissionProxy(ProxySettings(upstream=url), Mitigations())
    runner = None
    await supervisor.start()
    try:
        runner = await listen(proxy.app(), "127.0.0.1:0", cancel=True)
        setup = Rig(supervisor, probe, proxy)
        setup.proxy_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        yield setup
    finally:
        if runner is not None:
            await runner.cleanup()
        await probe.close()
        await supervisor.stop()


@pytest.fixture
async def serve():
    """Serve aiohttp apps on free loopback ports; clean up after the test."""
    runners = []

    async def start(app: web.Application, *, cancel: bool = False) -> str:
        runner = web.AppRunner(app, handler_cancellation=cancel)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner in reversed(runners):
        await runner.cleanup()
