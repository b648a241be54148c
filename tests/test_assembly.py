"""The one assembly (kvguard.runtime.assembly.build_guard): the parts it wires work together."""

from __future__ import annotations

import json

import aiohttp

from kvguard.config.settings import parse_config
from kvguard.probes.engine import EngineProbe
from kvguard.runtime.assembly import build_guard
from kvguard.runtime.probing import Probes


async def _post(http: aiohttp.ClientSession, url: str) -> tuple[int, str | None]:
    """POST a small completion body; (status, kvguard's error code or None)."""
    async with http.post(url, json={"prompt": "hi", "max_tokens": 4}) as resp:
        text = await resp.text()
    try:
        body = json.loads(text)
    except ValueError:  # the engine's own plain-text 404
        return resp.status, None
    code = (body.get("error") or {}).get("code") if isinstance(body, dict) else None
    return resp.status, code


async def test_the_proxy_follows_the_engine_kind_the_probe_detects(sim_engine):
    """Before the first tick every engine's routes pass; once vLLM is detected, only vLLM's."""
    url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048, flavor="vllm")
    config = parse_config({"engine": {"url": url}, "proxy": {"enabled": True}}, env={})
    guard = build_guard(
        config,
        probes=Probes(engine=EngineProbe(url, timeout_s=2.0), nvml=None, host=None),
        serve_api=False,
        engine_actions=False,
    )
    await guard.start(proxy_listen="127.0.0.1:0")
    try:
        proxy_url = guard.proxy_url
        assert guard.proxy is not None
        assert guard.proxy.engine_kind is None  # "auto", nothing read yet
        async with aiohttp.ClientSession() as http:
            # llama.cpp's /completion is some engine's generation route: forwarded (the
            # simulated vLLM has no such route, so the answer is the engine's, not ours).
            status, code = await _post(http, f"{proxy_url}/completion")
            assert code != "path_not_allowed", status
            await guard.daemon.tick()
            assert guard.proxy.engine_kind == "vllm"
            status, code = await _post(http, f"{proxy_url}/completion")
            assert (status, code) == (404, "path_not_allowed")
            status, _ = await _post(http, f"{proxy_url}/v1/completions")
            assert status == 200
    finally:
        await guard.close()


async def test_a_configured_kind_narrows_the_routes_from_the_start(sim_engine):
    """[engine] kind = "vllm": SGLang's /generate is refused before any tick."""
    url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048, flavor="vllm")
    config = parse_config(
        {"engine": {"url": url, "kind": "vllm"}, "proxy": {"enabled": True}}, env={}
    )
    guard = build_guard(
        config,
        probes=Probes(engine=EngineProbe(url, kind="vllm", timeout_s=2.0), nvml=None, host=None),
        serve_api=False,
        engine_actions=False,
    )
    await guard.start(proxy_listen="127.0.0.1:0")
    try:
        async with aiohttp.ClientSession() as http:
            status, code = await _post(http, f"{guard.proxy_url}/generate")
            assert (status, code) == (404, "path_not_allowed")
    finally:
        await guard.close()
