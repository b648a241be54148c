"""Adapters that read the outside world into :mod:`kvguard.core.snapshot` types.

Each probe has one method, ``async sample()``, that returns its reading or raises
:class:`~kvguard.errors.ProbeError`; foreign exceptions (NVML, psutil, aiohttp,
parse errors) are translated inside the probe. The daemon runs them concurrently
with per-probe timeouts.
"""
