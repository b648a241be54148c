"""The shape every probe has."""

from __future__ import annotations

from typing import Protocol, TypeVar

T_co = TypeVar("T_co", covariant=True)


class Probe(Protocol[T_co]):
    """A source of one kind of reading.

    ``name`` labels its metrics (``kvguard_probe_up{probe=name}``). ``sample``
    returns the reading or raises :class:`~kvguard.errors.ProbeError` only.
    """

    name: str

    async def sample(self) -> T_co:
        """Read the source once."""
        ...

    async def close(self) -> None:
        """Release what the probe holds (sessions, library handles)."""
        ...
