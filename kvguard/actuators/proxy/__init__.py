"""The admission proxy: kvguard in the request path, in front of one engine.

Every request to ``listen`` for a route the engine serves its clients (an allowlist
per engine, :mod:`.routes`) is forwarded to the one configured upstream — same
method, path, query, body and headers (hop-by-hop ones excepted, and the client's
``X-Forwarded-*``/``Forwarded`` replaced by the connection's own address and scheme),
with an ``X-Request-Id`` added when missing — and the answer comes back unchanged,
streams chunk by chunk. Generation requests (every engine's generation routes, their
bodies read by :mod:`.shapes`) are also accounted (their KV footprint, over all their
sequences) and subject to the mitigations in force: shed by priority (503 + ``Retry-After``), capped
(``max_tokens`` clamped, or 400 when even the minimum does not fit), or cancelled
when the largest. Client routes (health, metrics, model lists, tokenize) and model
routes (embeddings, scoring) pass untouched; admin routes get 403, the rest 404. The proxy
never talks to any host but its upstream: the target is always ``upstream + path``,
and redirects are not followed. It is no open proxy and forwards nothing malformed
(see :mod:`.screen`).

One module per stage a request goes through, so each can be read on its own:

* :mod:`.settings` — :class:`ProxySettings` and :class:`ProxyCounters`;
* :mod:`.screen` — what may reach the engine at all (targets, methods, paths,
  headers, generation bodies);
* :mod:`.routes` — the routes of each engine, and what each one is;
* :mod:`.shapes` — how each generation route's body reads: prompts, sequences, length;
* :mod:`.counting` — prompt token counts (``/tokenize``, ``usage``, the cache);
* :mod:`.admit` — shed, refuse, clamp, hold or admit a generation request (its
  arithmetic is :mod:`kvguard.core.admission`);
* :mod:`.forward` — forwarding to the engine and relaying its answer;
* :mod:`.answers` — the OpenAI-shaped errors kvguard answers with;
* :mod:`.app` — :class:`AdmissionProxy`, which wires them into an aiohttp app.

Names with a leading underscore are shared between these modules only.
"""

from kvguard.actuators.proxy.answers import CANCEL_MESSAGE, DRAIN_MESSAGE
from kvguard.actuators.proxy.app import AdmissionProxy
from kvguard.actuators.proxy.counting import (
    MAX_BACKGROUND_COUNTS,
    PROMPT_SHAPING_FIELDS,
    TOKENIZE_TIMEOUT_S,
)
from kvguard.actuators.proxy.forward import FORWARDING_HEADERS, HOP_BY_HOP, USAGE_SCAN_BYTES
from kvguard.actuators.proxy.screen import (
    ALLOWED_METHODS,
    GENERATION_PATHS,
    MAX_TOKENS_LIMIT,
    normal_path,
    screen_request,
)
from kvguard.actuators.proxy.settings import ProxyCounters, ProxySettings
from kvguard.core.admission import HELD_POOLS, UNKNOWN_MAX_TOKENS

__all__ = [
    "ALLOWED_METHODS",
    "CANCEL_MESSAGE",
    "DRAIN_MESSAGE",
    "FORWARDING_HEADERS",
    "GENERATION_PATHS",
    "HELD_POOLS",
    "HOP_BY_HOP",
    "MAX_BACKGROUND_COUNTS",
    "MAX_TOKENS_LIMIT",
    "PROMPT_SHAPING_FIELDS",
    "TOKENIZE_TIMEOUT_S",
    "UNKNOWN_MAX_TOKENS",
    "USAGE_SCAN_BYTES",
    "AdmissionProxy",
    "ProxyCounters",
    "ProxySettings",
    "normal_path",
    "screen_request",
]
