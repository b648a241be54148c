"""A request's class from its API key, however the client spells the key's header.

The engines accept a key as ``Authorization: Bearer <key>`` with the scheme in any
case (vLLM), bare in ``Authorization`` or in ``X-Api-Key`` (llama-server). A client
whose key is mapped to ``sheddable`` must not escape that class by choosing a
spelling the map misses; the proxy and ``/admission`` must agree on every one.
"""

from __future__ import annotations

import aiohttp
import pytest
from multidict import CIMultiDict

from kvguard.actuators.mitigations import Mitigations, request_priority
from kvguard.actuators.proxy import AdmissionProxy, ProxySettings
from kvguard.config.settings import parse_config
from kvguard.runtime.daemon import Daemon
from tests.test_run import start_api

BATCH_KEY = "sk-batch-made-up-7781"
VIP_KEY = "sk-vip-made-up-7782"
KEYS = {BATCH_KEY: "sheddable", VIP_KEY: "critical"}

# Every way a client may present BATCH_KEY that some engine accepts (or that RFC 7235
# allows: the scheme is case-insensitive, blanks separate it from the credentials).
SPELLINGS: list[list[tuple[str, str]]] = [
    [("Authorization", f"Bearer {BATCH_KEY}")],
    [("Authorization", f"bearer {BATCH_KEY}")],
    [("Authorization", f"BEARER {BATCH_KEY}")],
    [("Authorization", f"BeArEr {BATCH_KEY}")],
    [("Authorization", f"Bearer   {BATCH_KEY}")],
    [("Authorization", f"Bearer\t{BATCH_KEY}")],
    [("Authorization", f"Bearer {BATCH_KEY}  ")],
    [("authorization", f"Bearer {BATCH_KEY}")],
    [("AUTHORIZATION", f"bearer {BATCH_KEY}")],
    [("Authorization", BATCH_KEY)],  # llama-server: the key without a scheme
    [("X-Api-Key", BATCH_KEY)],
    [("x-api-key", BATCH_KEY)],
    [("X-API-KEY", f" {BATCH_KEY} ")],
    # A second copy of the header: an engine may read either one.
    [("Authorization", "Bearer sk-not-mapped"), ("Authorization", f"Bearer {BATCH_KEY}")],
    # Two mapped keys: the lower class wins, so adding a header never lifts a request.
    [("Authorization", f"Bearer {VIP_KEY}"), ("X-Api-Key", BATCH_KEY)],
    [("X-Api-Key", VIP_KEY), ("Authorization", f"bearer {BATCH_KEY}")],
]

# Not a key presented the way any engine reads it: the header decides (critical here).
NOT_KEYS: list[list[tuple[str, str]]] = [
    [("Authorization", f"Basic {BATCH_KEY}")],
    [("Authorization", f"Bearer {BATCH_KEY} extra")],
    [("Authorization", f"Bearer{BATCH_KEY}")],
    [("Authorization", f"Token {BATCH_KEY}")],
    [("X-Other-Key", BATCH_KEY)],
]


def _ids(cases: list[list[tuple[str, str]]]) -> list[str]:
    return [" + ".join(f"{name}: {value!r}" for name, value in case) for case in cases]


@pytest.mark.parametrize("case", SPELLINGS, ids=_ids(SPELLINGS))
def test_every_spelling_of_a_mapped_key_gives_its_class(case):
    """The key's class wins over X-Priority: critical, in a multidict and in a plain dict."""
    headers = CIMultiDict([*case, ("X-Priority", "critical")])
    assert request_priority(headers, "X-Priority", KEYS, "standard") == "sheddable"
    if len({name.lower() for name, _ in case}) == len(case):  # a dict holds one copy each
        plain = {**dict(case), "X-Priority": "critical"}
        assert request_priority(plain, "X-Priority", KEYS, "standard") == "sheddable"
    # Not trusting the header changes nothing for a mapped key.
    assert request_priority(headers, "X-Priority", KEYS, "standard", trust_header=False) == (
        "sheddable"
    )


@pytest.mark.parametrize("case", NOT_KEYS, ids=_ids(NOT_KEYS))
def test_other_credentials_fall_back_to_the_header(case):
    """A scheme other than Bearer, extra words, or another header: not a key."""
    headers = CIMultiDict([*case, ("X-Priority", "critical")])
    assert request_priority(headers, "X-Priority", KEYS, "standard") == "critical"
    assert request_priority(headers, "X-Priority", KEYS, "standard", trust_header=False) == (
        "standard"
    )


def test_a_critical_key_alone_is_critical():
    """The lowest-class rule only lowers: a VIP key on its own keeps its class."""
    for header in ("Authorization", "X-Api-Key"):
        value = f"bearer {VIP_KEY}" if header == "Authorization" else VIP_KEY
        headers = CIMultiDict([(header, value), ("X-Priority", "sheddable")])
        assert request_priority(headers, "X-Priority", KEYS, "standard") == "critical"


@pytest.mark.parametrize("case", SPELLINGS, ids=_ids(SPELLINGS))
async def test_proxy_and_admission_agree_on_every_spelling(sim_engine, case):
    """Over real HTTP: the proxy sheds the request, /admission answers 429 sheddable."""
    upstream = await sim_engine(kv_capacity_tokens=8192, max_model_len=2048)
    proxy = AdmissionProxy(
        ProxySettings(upstream=upstream, api_key_priorities=KEYS),
        Mitigations(shed_floor="sheddable"),
    )
    daemon = Daemon(
        parse_config({"engine": {"url": upstream}, "proxy": {"api_key_priorities": KEYS}}, env={})
    )
    daemon.mitigations.shed_floor = "sheddable"
    api_runner, api = await start_api(daemon)
    proxy_runner, proxy_url = await _serve(proxy)
    headers = CIMultiDict([*case, ("X-Priority", "critical")])
    body = {"prompt": "word word word", "max_tokens": 2}
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{proxy_url}/v1/completions", json=body, headers=headers) as resp:
                assert resp.status == 503
            async with http.post(f"{api}/admission", headers=headers) as resp:
                assert resp.status == 429
                assert resp.headers["X-Kvguard-Priority"] == "sheddable"
            # The control: an unmapped key with the same header is admitted by both.
            other = CIMultiDict([("Authorization", "Bearer sk-else"), ("X-Priority", "critical")])
            async with http.post(f"{proxy_url}/v1/completions", json=body, headers=other) as resp:
                assert resp.status == 200
            async with http.post(f"{api}/admission", headers=other) as resp:
                assert resp.headers["X-Kvguard-Priority"] == "critical"
    finally:
        await proxy_runner.cleanup()
        await api_runner.cleanup()
        await daemon.close()


async def _serve(proxy: AdmissionProxy) -> tuple[aiohttp.web.AppRunner, str]:
    runner = aiohttp.web.AppRunner(proxy.app(), handler_cancellation=True)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"
