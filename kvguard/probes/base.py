"""The shapes probes have: what the daemon, /status and /metrics use of them.

:class:`Probe` is every probe; :class:`FollowingProbe` one that watches a process
and can be pointed at another (the host and GPU probes, in supervisor mode);
:class:`EngineSource` the engine's probe, which also says what the engine is and
which admin actions it offers; :class:`GpuSource` the GPUs' probe, which also says
which driver it reads.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from kvguard.core.snapshot import EngineAction, EngineKind, EngineStats, GpuMemory

T_co = TypeVar("T_co", covariant=True)


class Probe(Protocol[T_co]):
    """A source of one kind of reading.

    ``name`` labels its metrics (``kvguard_probe_up{probe=name}``). ``sample``
    returns the reading or raises :class:`~kvguard.errors.ProbeError` only.
    """

    name: str

    @property
    def available(self) -> bool:
        """False while the source is not there at all (no NVIDIA driver).

        Such a source is down but not failing: its errors are not counted. True for
        a source that can always be asked (an engine, the host).
        """
        ...

    async def sample(self) -> T_co:
        """Read the source once."""
        ...

    async def close(self) -> None:
        """Release what the probe holds (sessions, library handles)."""
        ...


class FollowingProbe(Probe[T_co], Protocol[T_co]):
    """A probe that watches one process and can be moved to another."""

    def follow(self, pid: int | None) -> None:
        """Watch ``pid`` from the next sample on (supervisor mode: the engine kvguard started).

        None, and a probe configured to watch something else, changes nothing.
        """
        ...


class EngineSource(Probe[EngineStats], Protocol):
    """The engine's probe: its readings, and what the engine is."""

    @property
    def kind(self) -> EngineKind | None:
        """The engine's kind: as configured, or as detected (None until then)."""
        ...

    @property
    def actions(self) -> frozenset[EngineAction]:
        """Admin actions the engine offers; empty while its kind is unknown."""
        ...


class GpuSource(FollowingProbe[tuple[GpuMemory, ...]], Protocol):
    """The GPUs' probe: memory per selected GPU, and the driver it reads it from."""

    def driver_info(self) -> dict[str, str | None]:
        """Driver and NVML versions, and why NVML is unavailable if it is (no call made)."""
        ...
