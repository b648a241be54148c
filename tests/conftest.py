"""Shared fixtures: bundled model configs, and simulated engines on 127.0.0.1."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
import structlog

from kvguard.api.logs import log_processors, strict_json
from kvguard.config.model_files import load_model_files
from kvguard.core.budget import BudgetInputs, BudgetReport, plan_budget
from kvguard.sim.engine import TimeModel
from kvguard.sim.runner import PoolSpec, SimServer, size_pool, start_sim_server


@pytest.fixture(autouse=True)
def _state_in_tmp(tmp_path_factory, monkeypatch):
    """The state file (kvguard/actuators/state.py) goes to a temp folder, never ~/.local/state.

    Set in the environment, so a `kvguard run` a test starts inherits it too.
    """
    monkeypatch.setenv("KVGUARD_STATE_DIR", str(tmp_path_factory.mktemp("state")))


def _refuse_constant(name: str) -> Any:
    raise AssertionError(f"a log line holds {name}: strict JSON parsers drop the line")


def strict_log_line(logger: Any, method: str, event_dict: Any) -> Any:
    """Render ``event_dict`` as kvguard's JSON log line and parse it back strictly.

    The chain kvguard runs in production (non-finite numbers as null, the severity as
    ``level``, the time, strict JSON), on a copy. An event that sets ``level`` itself
    would lose it to the severity (a pressure level must be ``pressure_level`` …); a
    line a strict parser (Loki, Vector, ``json.loads`` refusing constants) rejects is
    a test failure wherever it is logged.
    """
    assert "level" not in event_dict, f"{event_dict.get('event')}: 'level' is the severity's key"
    line: Any = dict(event_dict)
    for processor in log_processors(structlog.processors.JSONRenderer(serializer=strict_json)):
        line = processor(logger, method, line)
    parsed = json.loads(line, parse_constant=_refuse_constant)
    assert parsed["event"] == event_dict["event"]
    return event_dict


@pytest.fixture(autouse=True, scope="session")
def _every_log_line_is_strict_json() -> Iterator[None]:
    """Every event kvguard logs in the test suite is checked by :func:`strict_log_line`.

    Events captured by ``structlog.testing.capture_logs`` (most tests) and events
    logged under the default configuration alike; a test that configures kvguard's
    own logging renders with the same strict serializer.
    """
    with pytest.MonkeyPatch.context() as patch:
        captured = structlog.testing.LogCapture.__call__

        def capture(self: Any, logger: Any, method: str, event_dict: Any) -> Any:
            strict_log_line(logger, method, event_dict)
            return captured(self, logger, method, event_dict)

        patch.setattr(structlog.testing.LogCapture, "__call__", capture)
        saved = structlog.get_config()
        structlog.configure(processors=[strict_log_line, *saved["processors"]])
        yield
        structlog.configure(**saved)


@pytest.fixture(autouse=True)
def _root_logger_restored() -> Iterator[None]:
    """A test that configures kvguard's logging leaves the root logger as it found it.

    configure_logging puts a bridge on the root logger and sets its level (aiohttp's
    and asyncio's records go through structlog): left there, it would change what
    every later test in the session logs. structlog's own configuration is restored
    too: a level filter left by ``kvguard run`` in-process (its usage-error tests)
    would hide every later test's captured events.
    """
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture
def budget_of():
    """Budget a bundled (or on-disk) model the way `kvguard budget` does."""

    def run(model: str, **inputs: object) -> BudgetReport:
        files = load_model_files(model)
        return plan_budget(
            files.config,
            BudgetInputs(**inputs),  # type: ignore[arg-type]
            index_total_size=files.index_total_size,
            source=files.source,
        )

    return run


POOL_FIELDS = set(PoolSpec.__dataclass_fields__)


@pytest.fixture
async def sim_server() -> AsyncIterator[Callable[..., Awaitable[SimServer]]]:
    """Start simulated engines on 127.0.0.1 and stop them after the test.

    Use as ``server = await sim_server(kv_capacity_tokens=...)``.

    Keyword arguments are :class:`PoolSpec` fields, plus ``flavor``, ``seed``,
    ``dev_endpoints``, ``step_fixed_s`` and ``per_token_s`` (fast defaults for tests).
    """
    servers: list[SimServer] = []

    async def start(**kwargs: Any) -> SimServer:
        pool = size_pool(PoolSpec(**{k: v for k, v in kwargs.items() if k in POOL_FIELDS}))
        timing = TimeModel(
            step_fixed_s=kwargs.get("step_fixed_s", 0.002),
            per_token_s=kwargs.get("per_token_s", 0.00002),
        )
        server = await start_sim_server(
            pool,
            flavor=kwargs.get("flavor", "vllm"),
            dev_endpoints=kwargs.get("dev_endpoints", True),
            time_model=timing,
            seed=kwargs.get("seed", 0),
        )
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop()


@pytest.fixture
async def sim_engine(sim_server) -> Callable[..., Awaitable[str]]:
    """Factory like ``sim_server`` that returns only the base URL."""

    async def start(**kwargs: Any) -> str:
        return (await sim_server(**kwargs)).url

    return start
