"""Admin routes stay refused unless [proxy] allowed_paths names the very path (issue 23)."""

from __future__ import annotations

import aiohttp
import pytest

from kvguard.actuators.mitigations import Mitigations
from kvguard.actuators.proxy import AdmissionProxy, ProxySettings
from kvguard.actuators.proxy.screen import check_path

# Admin routes the blocked_paths prefixes cannot name (a model name in the middle):
# Triton's per-model load, unload and trace settings (routes.py, Triton 2.71.0).
PER_MODEL_ADMIN = [
    ("POST", "/v1/models/my-model/load"),
    ("POST", "/v1/models/my-model/unload"),
    ("GET", "/v2/models/my-model/trace/setting"),
    ("POST", "/v2/models/my-model/trace/setting"),
]


@pytest.mark.parametrize(("method", "path"), PER_MODEL_ADMIN)
@pytest.mark.parametrize("kind", [None, "trtllm", "vllm"])
def test_allowed_paths_never_opens_an_admin_route(method, path, kind):
    """allowed_paths = ["/"] (every path) still refuses them with 403."""
    settings = ProxySettings(upstream="http://127.0.0.1:1", allowed_paths=("/",))
    refusal, _ = check_path(method, path, settings, kind)
    assert refusal is not None
    assert refusal[:2] == (403, "path_blocked")
    # Another path under the same prefix is what allowed_paths does open,
    assert check_path("POST", "/v1/something-else", settings, kind)[0] is None
    # and an entry that names the admin route itself is an operator's explicit choice.
    named = ProxySettings(upstream="http://127.0.0.1:1", allowed_paths=(path,))
    assert check_path(method, path, named, kind)[0] is None


async def test_an_admin_route_never_reaches_the_engine_through_an_open_allowlist(aiohttp_echo):
    """End to end: the upstream sees nothing of it."""
    upstream, seen = aiohttp_echo
    proxy = AdmissionProxy(ProxySettings(upstream=upstream, allowed_paths=("/",)), Mitigations())
    runner = aiohttp.web.AppRunner(proxy.app(), handler_cancellation=True)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/models/my-model/load", json={}) as resp:
                assert resp.status == 403
            async with http.post(f"{url}/v1/other", json={}) as resp:
                assert resp.status == 200  # the open allowlist forwards the rest
    finally:
        await runner.cleanup()
    assert seen == ["/v1/other"]


@pytest.fixture
async def aiohttp_echo():
    """An upstream on 127.0.0.1 that records the paths it is asked for."""
    seen: list[str] = []

    async def record(request: aiohttp.web.Request) -> aiohttp.web.Response:
        seen.append(request.path)
        return aiohttp.web.json_response({})

    app = aiohttp.web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", seen
    await runner.cleanup()
