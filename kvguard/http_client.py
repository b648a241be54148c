"""HTTP client sessions for kvguard's outbound requests (engine, admin API, webhooks).

Two rules live here. No state is shared between requests (no cookie jar, no proxy from
the environment). And a pooled connection is reused only while it is surely still open.
Engine API servers close an idle keep-alive connection on their own timer (uvicorn,
under vLLM, SGLang and TensorRT-LLM's server, after 5 s; llama-server after 5 s). A
request sent on a connection the server closes in that same instant is lost: the server
read none of it, and the client sees "server disconnected". aiohttp resends that only for
idempotent methods, and a completion is a POST, so the client would get a 502 for a
request the engine never saw. Dropping pooled connections idle for longer than
``keepalive_s`` (below the engine's timer) closes that window.
"""

from __future__ import annotations

import aiohttp
from aiohttp.client import DEFAULT_TIMEOUT

# Under the 5 s of uvicorn's and llama-server's keep-alive timers, with a second of slack
# for a loaded event loop on either side.
DEFAULT_KEEPALIVE_S = 4.0


def client_session(
    *,
    keepalive_s: float = DEFAULT_KEEPALIVE_S,
    timeout: aiohttp.ClientTimeout | None = None,
    auto_decompress: bool = True,
) -> aiohttp.ClientSession:
    """A ClientSession whose pool keeps idle connections at most ``keepalive_s``.

    ``keepalive_s`` 0: a new connection for every request. The pool has no size cap (a
    cap would queue requests inside kvguard, unseen by its metrics; the engine queues
    them itself and reports it). Never takes an HTTP proxy from the environment, and
    keeps no cookies.
    ``timeout`` and ``auto_decompress`` are aiohttp's (its defaults when not given).
    Call it inside the running event loop.
    """
    if keepalive_s <= 0:
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
    else:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=keepalive_s)
    return aiohttp.ClientSession(
        connector=connector,
        trust_env=False,
        # No cookie jar: the proxy's session serves every client, and a Set-Cookie
        # from the upstream (a hostname, e.g. a gateway's sticky session) would go
        # out on the next client's requests. Each client's own Cookie header passes.
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=timeout if timeout is not None else DEFAULT_TIMEOUT,
        auto_decompress=auto_decompress,
    )


def describe_client_error(exc: BaseException) -> str:
    """An outbound request's failure in an operator's words.

    A refused connection reads "nothing answers there (Connect call failed …)", not
    aiohttp's "Cannot connect to host … ssl:default [...]" (no TLS was involved);
    anything else is its type and message.
    """
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"nothing answers there ({exc.strerror})"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
