"""Fixtures shared by the actuator tests: aiohttp apps served on 127.0.0.1."""

from __future__ import annotations

import pytest
from aiohttp import web


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
