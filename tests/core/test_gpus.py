"""GPU presets: runtime-reported totals, and names as people type them."""

from __future__ import annotations

import pytest

from kvguard.core.gpus import GPU_PRESETS, gpu_preset, gpu_without_nvlink
from kvguard.core.units import GiB, MiB
from kvguard.errors import InvalidInputError

# nvidia-smi's memory.total (MiB) of boards whose figure is known: the runtime total
# a preset holds must sit a little below it (the driver's reservation), never above.
NVIDIA_SMI_MIB = {
    "H100-SXM": 81_559,
    "H100-PCIE": 81_559,
    "A100-40GB": 40_960,
    "A100-80GB": 81_920,
    "A10": 23_028,
    "A10G": 23_028,
    "L40S": 46_068,
    "L4": 23_034,
    "RTX-4090": 24_564,
    "RTX-3090": 24_576,
    "H200": 143_771,
}


@pytest.mark.parametrize(
    ("typed", "canonical"),
    [
        ("H100", "H100-SXM"),
        ("h100", "H100-SXM"),
        ("H100-80GB", "H100-SXM"),  # the former preset name still works
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),  # as torch and nvidia-smi print it
        ("h100_sxm", "H100-SXM"),
        ("H100 PCIe", "H100-PCIE"),
        ("nvidia h100 nvl", "H100-NVL"),
        ("H200-141GB", "H200"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("a100 80gb", "A100-80GB"),
        ("RTX A6000", "A6000"),
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),
        ("rtx_3090", "RTX-3090"),
        ("RTX 3090", "RTX-3090"),
        ("l40s", "L40S"),
        ("L40", "L40"),
        ("L4", "L4"),
        ("A10G", "A10G"),
        ("A10", "A10"),
        ("AMD Instinct MI300X", "MI300X"),
        ("  gh200  ", "GH200"),
    ],
)
def test_names_match_ignoring_case_spaces_separators_and_vendor(typed, canonical):
    """Case, spaces, - versus _ and a leading NVIDIA do not matter."""
    assert gpu_preset(typed).name == canonical


def test_every_name_and_alias_points_to_one_board():
    """No alias is shared by two presets (the first would silently win)."""
    keys: dict[str, str] = {}
    for preset in GPU_PRESETS:
        for alias in (preset.name, *preset.aliases):
            key = "".join(alias.lower().replace("nvidia", "").split()).replace("-", "")
            key = key.replace("_", "")
            assert keys.setdefault(key, preset.name) == preset.name, alias
            assert gpu_preset(alias) is preset


@pytest.mark.parametrize(("name", "smi_mib"), sorted(NVIDIA_SMI_MIB.items()))
def test_presets_are_runtime_totals_below_nvidia_smi(name, smi_mib):
    """A preset is what torch reports: below nvidia-smi's total, by under 1 GiB."""
    memory = gpu_preset(name).memory_bytes
    assert smi_mib * MiB - GiB < memory < smi_mib * MiB


def test_published_figures():
    """Spot checks against the figures the presets cite."""
    assert round(gpu_preset("H100").memory_bytes / GiB, 2) == 79.19
    assert gpu_preset("A100-40GB").memory_bytes == 42_298_834_944
    assert round(gpu_preset("A100-80GB").memory_bytes / GiB, 2) == 79.25
    assert round(gpu_preset("B200").memory_bytes / GiB, 2) == 178.35
    assert round(gpu_preset("RTX-3090").memory_bytes / GiB, 2) == 23.56


def test_bare_a100_is_ambiguous_not_guessed():
    """An A100 comes in 40 and 80 GB: the error names both instead of picking one."""
    with pytest.raises(InvalidInputError, match="ambiguous: name one of A100-40GB, A100-80GB"):
        gpu_preset("A100")


def test_unknown_name_lists_canonical_names_only():
    """The error lists each board once, by its canonical name, and the way out."""
    with pytest.raises(InvalidInputError) as info:
        gpu_preset("H300")
    allowed = info.value.allowed
    assert info.value.field == "gpu"
    assert info.value.value == "H300"
    for preset in GPU_PRESETS:
        assert preset.name in allowed
    assert "H100-80GB" not in allowed  # aliases stay out of the list
    assert "--gpu-memory" in allowed


def test_boards_without_nvlink_are_known_by_any_of_their_names():
    """L4, L40(S), A10(G) and RTX 4090 have no NVLink; bridgeable or SXM boards are not listed."""
    for name in ("L40S", "l40s", "L4", "A10G", "GeForce RTX 4090", "4090"):
        assert gpu_without_nvlink(name), name
    # Same memory as the L40S, but a bridge may join two A40s: not known to lack it.
    for name in ("A40", "A6000", "RTX-3090", "H100", "H100-PCIE", "A100-80GB", "custom", None):
        assert not gpu_without_nvlink(name), name
