"""GPU presets for ``kvguard budget --gpu NAME``.

Each size is the total memory the driver reports for that board (``nvidia-smi
--query-gpu=memory.total``, or ROCm's figure for AMD), not the marketing number:
an "80GB" H100 reports 81,559 MiB, and planning with 80e9 bytes would be wrong by 7%.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvguard.core.units import GiB, MiB
from kvguard.errors import InvalidInputError


@dataclass(frozen=True)
class GpuPreset:
    """A known accelerator: its canonical name and total memory in bytes."""

    name: str
    memory_bytes: int


GPU_PRESETS: tuple[GpuPreset, ...] = (
    GpuPreset("H100-80GB", 81_559 * MiB),
    GpuPreset("H200-141GB", 143_771 * MiB),
    GpuPreset("A100-40GB", 40_960 * MiB),
    GpuPreset("A100-80GB", 81_920 * MiB),
    GpuPreset("L4", 23_034 * MiB),
    GpuPreset("L40S", 46_068 * MiB),
    GpuPreset("A10G", 23_028 * MiB),
    GpuPreset("RTX-4090", 24_564 * MiB),
    GpuPreset("MI300X", 192 * GiB),
)


def gpu_preset(name: str) -> GpuPreset:
    """Look a preset up by name, ignoring case; the error lists every known name."""
    wanted = name.strip().lower()
    for preset in GPU_PRESETS:
        if preset.name.lower() == wanted:
            return preset
    known = ", ".join(p.name for p in GPU_PRESETS)
    raise InvalidInputError("gpu", name, f"must be one of {known}")
