"""The proxy's settings and counters: the two value types other layers build or read.

``cli`` builds :class:`ProxySettings` from ``[proxy]``; ``api`` exports
:class:`ProxyCounters`. They live apart from the aiohttp machinery so the screen,
the counting, the forwarding and the admission modules can all name them without
importing one another.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvguard.config.settings import ENGINE_ADMIN_PATHS
from kvguard.http_client import DEFAULT_KEEPALIVE_S


@dataclass(frozen=True)
class ProxySettings:
    """``[proxy]``: where to listen, where to forward, how to classify and limit."""

    upstream: str
    listen: str = "127.0.0.1:9000"
    priority_header: str = "X-Priority"
    trust_priority_header: bool = True  # False: only the API-key map or the default decide
    default_priority: str = "standard"
    api_key_priorities: Mapping[str, str] | None = field(default=None, repr=False)  # secrets
    # Request bodies: their size, their JSON values, the memory those being read and
    # admitted hold at once, and how fast they must arrive (docs/proxy.md, Limits).
    max_body_bytes: int = 4 * 1024 * 1024
    max_body_values: int = 32_768
    max_body_memory: int = 48 * 1024 * 1024
    client_body_timeout_s: float = 10.0
    client_body_min_rate: int = 32 * 1024  # bytes per second, after client_body_timeout_s
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    upstream_keepalive_s: float = DEFAULT_KEEPALIVE_S  # under the engine's keep-alive timer
    min_completion_tokens: int = 16
    # "projected": admit against the engine's pool (see admit.Admission.make_room)
    admission: str = "off"
    admission_ratio: float = 0.95
    admission_wait_s: float = 5.0
    # While shedding, a request of a shed class is held until the in-flight projections
    # plus its own fit within shed_ratio of the pool, for up to shed_wait_s: only the
    # excess is shed. shed_ratio 0 (or an unknown pool) sheds the whole class at once.
    shed_ratio: float = 0.8
    shed_wait_s: float = 2.0
    # Path prefixes (whole segments, case-insensitive) forwarded besides the engine's own
    # client routes (routes.py), as they are: never admitted; and prefixes refused
    # whatever allows them (an entry may name one method: "POST /props").
    allowed_paths: tuple[str, ...] = ()
    blocked_paths: tuple[str, ...] = ENGINE_ADMIN_PATHS


class ProxyCounters:
    """What the proxy did, for the exporter."""

    def __init__(self) -> None:
        self.shed: Counter[tuple[str, str]] = Counter()  # (priority, reason)
        self.clamped = 0
        self.rejected: Counter[str] = Counter()  # reason (window caps, malformed requests)
        # reason: largest, drain (both present from the start: 0 is not absent)
        self.cancelled: Counter[str] = Counter({"largest": 0, "drain": 0})
        self.upstream_errors: Counter[str] = Counter()  # 408/413/503 (body), 502/504
