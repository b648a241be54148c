"""kvguard in this process, in front of one engine: for the demo and the benchmarks.

:func:`start_guard` builds, with :func:`~kvguard.runtime.assembly.build_guard`, what
``kvguard run`` builds with ``[proxy] enabled`` — the daemon (live) and its admission
proxy on a port of 127.0.0.1 the OS picks — without the HTTP API, the engine's admin
actions, signals or systemd, so a caller can run the tick loop and load in one event
loop. :func:`start_watcher` is the same without the proxy: watch-only.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any

from kvguard.config.settings import parse_config
from kvguard.probes.engine import EngineProbe
from kvguard.runtime.assembly import Guard, build_guard
from kvguard.runtime.probing import Probes


def free_port() -> int:
    """A port free on 127.0.0.1 right now (the OS picks it), for a server in another process."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _engine_only(engine_url: str, timeout_s: float) -> Probes:
    """The engine's probe alone: no GPU or host probes in process (the engine is local)."""
    return Probes(engine=EngineProbe(engine_url, timeout_s=timeout_s), nvml=None, host=None)


async def start_guard(
    engine_url: str,
    *,
    poll: Mapping[str, float],
    proxy: Mapping[str, Any] | None = None,
    policy: Mapping[str, Any] | None = None,
) -> Guard:
    """The live guard watching ``engine_url``, its proxy listening (``guard.proxy_url``).

    ``proxy`` and ``policy`` are ``[proxy]`` / ``[policy]`` tables on top of the
    defaults. The caller runs the loop (``guard.run_in_background``) and closes the
    guard.
    """
    config = parse_config(
        {
            "engine": {"url": engine_url},
            "poll": dict(poll),
            "proxy": {**(proxy or {}), "enabled": True},
            "policy": dict(policy or {}),
        },
        env={},
    )
    guard = build_guard(
        config,
        probes=_engine_only(engine_url, config.poll.timeout_s),
        serve_api=False,
        engine_actions=False,
    )
    return await guard.start(proxy_listen="127.0.0.1:0")


async def start_watcher(
    engine_url: str,
    *,
    poll: Mapping[str, float],
    policy: Mapping[str, Any] | None = None,
) -> Guard:
    """A guard watching ``engine_url`` with no proxy: ``kvguard run`` in watch-only mode.

    With ``policy = {"dry_run": True}`` it decides and logs but acts on nothing: what
    the benchmarks use to time kvguard's warnings on traffic it does not touch. The
    caller runs the loop and closes the guard.
    """
    config = parse_config(
        {"engine": {"url": engine_url}, "poll": dict(poll), "policy": dict(policy or {})},
        env={},
    )
    guard = build_guard(
        config,
        probes=_engine_only(engine_url, config.poll.timeout_s),
        serve_api=False,
        engine_actions=False,
    )
    return await guard.start()
