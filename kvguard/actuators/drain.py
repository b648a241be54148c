"""The drain step of the fp8 switch: stop admitting, count what is in flight, re-admit.

Two ways, the proxy's first:

* :class:`ProxyDrain` — with the admission proxy in the path, kvguard refuses every
  generation request (``503`` + ``Retry-After``, ``code: kv_cache_reconfigure``)
  and counts its own in-flight requests; after the timeout it cuts them (the engine
  aborts a request whose client left) with a clear error to each client.
* :class:`EnginePauseDrain` — without the proxy, the engine's own pause endpoint
  (vLLM ``/pause?mode=wait``, SGLang ``pause_generation``) stops admission, and the
  engine's metrics say what still runs or waits; whatever is left at the timeout is
  ended by the restart itself, and counted.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from kvguard.actuators.engine_admin import EngineAdmin
from kvguard.actuators.mitigations import Mitigations
from kvguard.actuators.proxy import AdmissionProxy
from kvguard.core.snapshot import EngineStats
from kvguard.errors import KvguardError


class ProxyDrain:
    """Drain through the admission proxy."""

    def __init__(self, proxy: AdmissionProxy, mitigations: Mitigations) -> None:
        self.proxy = proxy
        self.mitigations = mitigations

    def can_stop_admitting(self) -> bool:
        """The proxy always can."""
        return True

    async def stop_admitting(self, retry_after_s: int) -> str | None:
        """Refuse every generation request from now on."""
        if not self.mitigations.enforcing:
            return "kvguard runs in dry-run mode"
        self.mitigations.drain_retry_after_s = retry_after_s
        self.mitigations.draining = True
        return None

    async def inflight(self) -> int | None:
        """Requests in flight through the proxy."""
        return len(self.proxy.inflight)

    async def cancel_rest(self) -> int:
        """Cut every request still in flight (counted with ``reason="drain"``)."""
        return self.proxy.cancel_all("drain")

    async def readmit(self) -> None:
        """Admit again."""
        self.mitigations.draining = False


class EnginePauseDrain:
    """Drain through the engine's own pause endpoint."""

    def __init__(
        self, admin: EngineAdmin, engine_stats: Callable[[], Awaitable[EngineStats | None]]
    ) -> None:
        self.admin = admin
        self.engine_stats = engine_stats
        self.cancelled_by_restart = 0

    def can_stop_admitting(self) -> bool:
        """Whether the engine has a pause endpoint that lets running requests finish.

        vLLM's ``mode=wait`` does. SGLang's pause has no such mode: ``in_place`` (the
        least destructive) freezes running requests where they are, so a drain
        through it would only wait out its timeout and then kill them; without the
        proxy, its switch is refused instead.
        """
        return self.admin.supports("pause") and self.admin.kind != "sglang"

    async def stop_admitting(self, retry_after_s: int) -> str | None:
        """Pause the engine: running requests finish, new ones are refused or wait."""
        if not self.admin.supports("pause"):
            return "the engine has no pause endpoint and the proxy is off"
        result = await self.admin.pause()
        return None if result.ok else result.detail

    async def inflight(self) -> int | None:
        """Requests the engine still runs or queues (None while it cannot be read)."""
        try:
            stats = await self.engine_stats()
        except KvguardError:
            return None
        if stats is None or not stats.up:
            return None
        return int((stats.requests_running or 0) + (stats.requests_waiting or 0))

    async def cancel_rest(self) -> int:
        """The restart ends what is left; count it."""
        left = await self.inflight() or 0
        self.cancelled_by_restart += left
        return left

    async def readmit(self) -> None:
        """Resume (a restarted engine starts unpaused; a failed switch must not stay paused)."""
        await self.admin.resume()
