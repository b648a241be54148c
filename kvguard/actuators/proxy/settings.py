"""The proxy's settings and counters: the two value types other layers build or read.

``cli`` builds :class:`ProxySettings` from ``[proxy]``; ``api`` exports
:class:`ProxyCounters`. They live apart from the aiohttp machinery so the screen,
the counting, the forwarding and the admission modules can all name them without
importing one another.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvguard.config.settings import ProxyConfig

# Each default is [proxy]'s own, declared once on ProxyConfig's field (the dataclass
# keeps it as the class attribute): a proxy built without a config file (tests, the
# benchmarks) behaves as one built from an empty [proxy].
_DEFAULTS = ProxyConfig


@dataclass(frozen=True)
class ProxySettings:
    """``[proxy]``: where to listen, where to forward, how to classify and limit."""

    upstream: str
    listen: str = _DEFAULTS.listen
    priority_header: str = _DEFAULTS.priority_header
    trust_priority_header: bool = (
        _DEFAULTS.trust_priority_header
    )  # False: only the API-key map or the default decide
    default_priority: str = _DEFAULTS.default_priority
    api_key_priorities: Mapping[str, str] | None = field(default=None, repr=False)  # secrets
    # Request bodies: their size, their JSON values, the memory those being read and
    # admitted hold at once, and how fast they must arrive (docs/proxy.md, Limits).
    max_body_bytes: int = _DEFAULTS.max_body_bytes
    max_body_values: int = _DEFAULTS.max_body_values
    max_body_memory: int = _DEFAULTS.max_body_memory
    client_body_timeout_s: float = _DEFAULTS.client_body_timeout_s
    client_body_min_rate: int = (
        _DEFAULTS.client_body_min_rate
    )  # bytes per second, after client_body_timeout_s
    connect_timeout_s: float = _DEFAULTS.connect_timeout_s
    read_timeout_s: float = _DEFAULTS.read_timeout_s
    upstream_keepalive_s: float = (
        _DEFAULTS.upstream_keepalive_s
    )  # under the engine's keep-alive timer
    min_completion_tokens: int = _DEFAULTS.min_completion_tokens
    # Admit against the engine's pool (see admit.Admission.make_room): "observed"
    # reserves each answer at what recent answers of its kind used (the quantile
    # below), "projected" at max_tokens.
    admission: str = _DEFAULTS.admission
    reserve_quantile: float = _DEFAULTS.reserve_quantile
    reserve_min_samples: int = _DEFAULTS.reserve_min_samples
    reserve_window: int = _DEFAULTS.reserve_window
    admission_ratio: float = _DEFAULTS.admission_ratio
    admission_wait_s: float = _DEFAULTS.admission_wait_s
    # Once requests have waited for room without a break for longer than
    # admission_wait_s, the queue is overload rather than a burst being absorbed: a
    # request then waits overload_wait_s at most (critical ones aside).
    overload_wait_s: float = _DEFAULTS.overload_wait_s
    # While shedding, a request of a shed class is held until the in-flight projections
    # plus its own fit within shed_ratio of the pool, for up to shed_wait_s: only the
    # excess is shed. shed_ratio 0 (or an unknown pool) sheds the whole class at once.
    shed_ratio: float = _DEFAULTS.shed_ratio
    shed_wait_s: float = _DEFAULTS.shed_wait_s
    # Path prefixes (whole segments, case-insensitive) forwarded besides the engine's own
    # client routes (routes.py), as they are: never admitted; and prefixes refused
    # whatever allows them (an entry may name one method: "POST /props").
    allowed_paths: tuple[str, ...] = _DEFAULTS.allowed_paths
    blocked_paths: tuple[str, ...] = _DEFAULTS.blocked_paths


@dataclass(frozen=True)
class ShedNote:
    """The last request the proxy shed: when, its class, why (the 503's code), the figures."""

    at: float  # monotonic seconds
    priority: str
    reason: str  # kv_pool_full, kv_cache_pressure, draining
    detail: str  # what its 503 said, in figures a person can check


class ProxyCounters:
    """What the proxy did, for the exporter, ``/status`` and the log."""

    def __init__(self) -> None:
        self.shed: Counter[tuple[str, str]] = Counter()  # (priority, reason)
        self.last_shed: ShedNote | None = None
        self.clamped = 0
        self.rejected: Counter[str] = Counter()  # reason (window caps, malformed requests)
        # reason: largest, overrun, drain (present from the start: 0 is not absent)
        self.cancelled: Counter[str] = Counter({"largest": 0, "overrun": 0, "drain": 0})
        self.upstream_errors: Counter[str] = Counter()  # 408/413/503 (body), 502/504

    def note_shed(self, priority: str, reason: str, detail: str) -> None:
        """Count one shed request and keep it as the last, with why (``detail``)."""
        self.shed[(priority, reason)] += 1
        self.last_shed = ShedNote(time.monotonic(), priority, reason, detail)
