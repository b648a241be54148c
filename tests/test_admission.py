"""kvguard's gateway endpoints over a real sim engine: /admission and /readyz."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aiohttp
import pytest

from kvguard.config.settings import parse_config
from kvguard.runtime.daemon import Daemon
from tests.test_run import start_api

BATCH_KEY = "sk-batch-made-up"
VIP_KEY = "sk-vip-made-up"


@pytest.fixture
async def gateway(sim_engine):
    """Serve kvguard's API for a daemon watching a real sim engine; yields a starter.

    ``await gateway(proxy={...})`` builds the daemon with that ``[proxy]`` table,
    ticks it once (so /readyz has seen the engine) and returns (daemon, API URL).
    """
    engine_url = await sim_engine(kv_capacity_tokens=8192, max_model_len=4096)
    started: list[tuple[Daemon, Any]] = []

    async def start(proxy: Mapping[str, object] | None = None) -> tuple[Daemon, str]:
        table: dict[str, object] = {"engine": {"url": engine_url}, "poll": {"timeout_s": 1.0}}
        if proxy is not None:
            table["proxy"] = dict(proxy)
        daemon = Daemon(parse_config(table, env={}))
        runner, url = await start_api(daemon)
        started.append((daemon, runner))
        # Tick before forcing mitigations: each tick applies the policy's own plan
        # (level "ok" on an idle sim), which would overwrite what the test sets.
        await daemon.tick()
        return daemon, url

    yield start
    for daemon, runner in started:
        await runner.cleanup()
        await daemon.close()


def shed(daemon: Daemon, floor: str, level: str = "critical", retry_after_s: int = 9) -> None:
    """Force a shed decision, as a live plan would put it in force."""
    mitigations = daemon.mitigations
    mitigations.shed_floor = floor  # type: ignore[assignment]
    mitigations.level = level
    mitigations.retry_after_s = retry_after_s


async def ask(
    url: str, method: str = "GET", headers: Mapping[str, str] | None = None
) -> tuple[int, Mapping[str, str], Any]:
    """Call ``/admission``: status, headers and JSON body."""
    async with (
        aiohttp.ClientSession() as http,
        http.request(method, f"{url}/admission", headers=headers or {}) as resp,
    ):
        return resp.status, resp.headers, await resp.json()


async def readyz(url: str) -> tuple[int, Any]:
    """GET ``/readyz``: status and JSON body."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/readyz") as resp:
        return resp.status, await resp.json()


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_admission_allows_everything_when_nothing_is_shed(gateway, method):
    """200 with the request's class and the current level in headers and body."""
    _, url = await gateway()
    for priority in ("sheddable", "standard", "critical"):
        status, headers, body = await ask(url, method, {"X-Priority": priority})
        assert status == 200
        assert headers["X-Kvguard-Priority"] == priority
        assert headers["X-Kvguard-Level"] == "ok"
        assert "Retry-After" not in headers
        assert body == {"allowed": True, "priority": priority, "level": "ok"}


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_admission_denies_at_and_below_the_shed_floor(gateway, method):
    """With standard shed: sheddable and standard get 429 + Retry-After; critical passes."""
    daemon, url = await gateway()
    shed(daemon, "standard", level="critical", retry_after_s=9)
    for priority in ("sheddable", "standard"):
        status, headers, body = await ask(url, method, {"X-Priority": priority})
        assert status == 429, priority
        assert headers["Retry-After"] == "9"
        assert headers["X-Kvguard-Priority"] == priority
        assert headers["X-Kvguard-Level"] == "critical"
        assert body == {"allowed": False, "priority": priority, "level": "critical"}
    status, headers, body = await ask(url, method, {"X-Priority": "critical"})
    assert status == 200
    assert "Retry-After" not in headers
    assert body == {"allowed": True, "priority": "critical", "level": "critical"}


async def test_admission_reads_the_configured_header_and_default(gateway):
    """The class comes from `priority_header`; absent or unknown values get `default_priority`."""
    daemon, url = await gateway({"priority_header": "X-Tier", "default_priority": "sheddable"})
    shed(daemon, "sheddable")
    assert (await ask(url, headers={"X-Tier": "Critical"}))[0] == 200  # case does not matter
    assert (await ask(url, headers={"X-Tier": "standard"}))[0] == 200
    # The proxy's default header is not read when another one is configured.
    status, headers, _ = await ask(url, headers={"X-Priority": "critical"})
    assert (status, headers["X-Kvguard-Priority"]) == (429, "sheddable")
    status, headers, _ = await ask(url, headers={"X-Tier": "urgent"})  # not a class
    assert (status, headers["X-Kvguard-Priority"]) == (429, "sheddable")
    status, headers, _ = await ask(url)
    assert (status, headers["X-Kvguard-Priority"]) == (429, "sheddable")


async def test_admission_maps_api_keys_before_the_header(gateway):
    """A mapped `Authorization: Bearer` key decides the class, whatever the header claims."""
    daemon, url = await gateway(
        {"api_key_priorities": {BATCH_KEY: "sheddable", VIP_KEY: "critical"}}
    )
    shed(daemon, "standard")
    batch = {"Authorization": f"Bearer {BATCH_KEY}", "X-Priority": "critical"}
    status, headers, _ = await ask(url, "POST", batch)
    assert (status, headers["X-Kvguard-Priority"]) == (429, "sheddable")
    vip = {"Authorization": f"Bearer {VIP_KEY}", "X-Priority": "sheddable"}
    status, headers, _ = await ask(url, "POST", vip)
    assert (status, headers["X-Kvguard-Priority"]) == (200, "critical")
    # An unmapped key falls back to the header, then to the default class.
    other = {"Authorization": "Bearer sk-unknown", "X-Priority": "critical"}
    assert (await ask(url, "POST", other))[0] == 200
    status, headers, _ = await ask(url, "POST", {"Authorization": "Bearer sk-unknown"})
    assert (status, headers["X-Kvguard-Priority"]) == (429, "standard")


async def test_admission_allows_everything_in_dry_run(gateway):
    """Not enforcing: even the lowest class is admitted while a shed is recorded."""
    daemon, url = await gateway()
    shed(daemon, "critical")
    daemon.mitigations.enforcing = False
    for priority in ("sheddable", "standard", "critical"):
        status, headers, body = await ask(url, "POST", {"X-Priority": priority})
        assert status == 200
        assert "Retry-After" not in headers
        assert body["allowed"] is True


async def test_readyz_fails_while_shedding_at_critical(gateway):
    """Default `fail_readiness_at = critical`: 503 with a reason, 200 again once released."""
    daemon, url = await gateway()
    assert await readyz(url) == (200, {"status": "ready"})
    shed(daemon, "sheddable", level="critical")
    status, body = await readyz(url)
    assert status == 503
    assert body["status"] == "not ready"
    assert "shedding at critical" in body["reason"]
    daemon.mitigations.shed_floor = None
    assert (await readyz(url))[0] == 200


async def test_readyz_stays_ready_while_shedding_below_the_readiness_level(gateway):
    """Shedding at `high` keeps readiness; so does shedding while not enforcing (dry-run)."""
    daemon, url = await gateway()
    shed(daemon, "sheddable", level="high")
    assert (await readyz(url))[0] == 200
    shed(daemon, "standard", level="critical")
    daemon.mitigations.enforcing = False
    assert (await readyz(url))[0] == 200


async def test_readyz_at_high_fails_from_high(gateway):
    """`fail_readiness_at = high` takes the replica out of rotation from `high` up."""
    daemon, url = await gateway({"fail_readiness_at": "high"})
    shed(daemon, "sheddable", level="elevated")
    assert (await readyz(url))[0] == 200
    shed(daemon, "sheddable", level="high")
    status, body = await readyz(url)
    assert status == 503
    assert "shedding at high" in body["reason"]


async def test_readyz_never_fails_for_shedding_when_configured_never(gateway):
    """`fail_readiness_at = never`: shedding at critical leaves the replica ready."""
    daemon, url = await gateway({"fail_readiness_at": "never"})
    shed(daemon, "standard", level="critical")
    assert await readyz(url) == (200, {"status": "ready"})
    assert (await ask(url, headers={"X-Priority": "standard"}))[0] == 429  # still shedding


async def test_admission_answers_under_envoys_path_prefix(gateway):
    """Envoy appends the client's path to `path_prefix`: /admission/<path> decides the same."""
    daemon, url = await gateway()
    shed(daemon, "sheddable")
    async with aiohttp.ClientSession() as http:
        for priority, expected in (("sheddable", 429), ("critical", 200)):
            async with http.post(
                f"{url}/admission/v1/chat/completions", headers={"X-Priority": priority}
            ) as resp:
                assert resp.status == expected, priority
