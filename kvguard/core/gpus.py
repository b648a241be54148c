"""GPU presets for ``kvguard budget --gpu NAME``.

Each size is the total memory the CUDA (or ROCm) runtime reports for the board:
``torch.cuda.mem_get_info()[1]``, which vLLM logs as ``total_gpu_memory`` and in
"Free memory on device (free/TOTAL GiB)", and which PyTorch's out-of-memory message
calls "total capacity". vLLM multiplies exactly this figure by
``--gpu-memory-utilization``. It is neither the marketing number ("80GB") nor
nvidia-smi's ``memory.total`` (81,559 MiB on an H100): the driver keeps a few hundred
MiB of the latter for itself, so planning with it overstates the pool by that much.

The figure moves by a few tens of MiB between driver versions and with ECC; each
preset names the public log it was read from. Where no log was found the figure is
marked *derived*: nvidia-smi's MiB total less the reservation a sibling board shows.
For a board at hand, ``--gpu-memory`` with the figure vLLM logs beats any preset.

Each NVIDIA preset also carries the board's CUDA compute capability (NVIDIA's public
tables: A100 8.0; A10, A10G, A40, A6000, RTX 3090 8.6; L4, L40, L40S, RTX 4090 8.9;
H100, H200, H20, GH200 9.0; B200, GB200 10.0). vLLM picks kernels by it, and the MXFP4
mixture-of-experts kernels it picks store their weights padded to different sizes
(see :mod:`kvguard.core.weights`). MI300X runs ROCm, which has no CUDA compute
capability: it carries none, and so does a GPU given only as ``--gpu-memory``; the
weight estimate then takes the kernel that stores the most.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from kvguard.core.units import GiB, MiB
from kvguard.errors import InvalidInputError


@dataclass(frozen=True)
class GpuPreset:
    """A known accelerator: canonical name, runtime-reported total memory, other names.

    ``aliases`` are further names it answers to, such as the name nvidia-smi and
    torch print ("H100 80GB HBM3") or an older kvguard preset name ("H100-80GB").
    ``compute_capability`` is the CUDA (major, minor) version; None where there is
    none (ROCm boards).
    """

    name: str
    memory_bytes: int
    aliases: tuple[str, ...] = ()
    compute_capability: tuple[int, int] | None = None


def _gib(figure: str) -> int:
    """Bytes of a GiB figure as logs print it (two decimals), e.g. ``"79.11"``."""
    return int(Fraction(figure) * GiB)


# H100 SXM and PCIe carry the same 80 GB of HBM (nvidia-smi: 81,559 MiB on both).
_H100_80GB = _gib("79.19")
# The reservation an H100 shows between nvidia-smi (81,559 MiB) and the runtime
# (81,090 MiB, torch.cuda.get_device_properties printouts): used for derived Hopper figures.
_HOPPER_RESERVED_MIB = 81_559 - 81_090

# CUDA compute capabilities (NVIDIA's published tables).
_AMPERE_GA100 = (8, 0)  # A100
_AMPERE = (8, 6)  # A10, A10G, A40, RTX A6000, RTX 3090
_ADA = (8, 9)  # L4, L40, L40S, RTX 4090
_HOPPER = (9, 0)  # H100, H200, H20, GH200
_BLACKWELL = (10, 0)  # B200, GB200

GPU_PRESETS: tuple[GpuPreset, ...] = (
    # 79.19 GiB: vLLM 0.19's total_gpu_memory on H100 in llm-d-planner's start-up logs
    # (github.com/llm-d-incubation/llm-d-planner, accuracy/results/v0.19.0/logs);
    # 79.18 in llm-d-benchmark's, 79.22 in vLLM PR 10511's, 79.11 in vLLM issue 27508's
    # OOM message: drivers differ by a few hundredths of a GiB.
    GpuPreset(
        "H100-SXM", _H100_80GB, ("H100", "H100-80GB", "H100 80GB HBM3", "H100-SXM5-80GB"), _HOPPER
    ),
    # derived: same 80 GB HBM and nvidia-smi total (81,559 MiB) as the SXM board.
    GpuPreset("H100-PCIE", _H100_80GB, ("H100 PCIe", "H100-PCIE-80GB"), _HOPPER),
    # 93.00 GiB: "total capacity of 93.00 GiB" on an "H100 NVL 94GB",
    # https://github.com/ali-vilab/VACE/issues/56
    GpuPreset("H100-NVL", _gib("93.00"), ("H100 NVL", "H100-94GB"), _HOPPER),
    # 139.72 GiB: "Free memory on device (7.34/139.72 GiB)",
    # https://github.com/vllm-project/vllm/issues/23192
    GpuPreset("H200", _gib("139.72"), ("H200-141GB", "H200-SXM", "H200 141GB HBM3e"), _HOPPER),
    # 178.35 GiB: cudaDeviceProp totalGlobalMem of "NVIDIA B200" (printed as "178.35 GB",
    # binary units), https://github.com/pytorch/ao/pull/4002
    GpuPreset("B200", _gib("178.35"), ("B200-180GB",), _BLACKWELL),
    # derived: nvidia-smi 189,471 MiB less the 729 MiB a B200 shows between nvidia-smi
    # (183,359 MiB) and the runtime (178.35 GiB); no public runtime figure found.
    GpuPreset("GB200", (189_471 - 729) * MiB, (), _BLACKWELL),
    # derived: the 96 GB HBM3 GH200 (the "480GB" superchip); nvidia-smi 97,871 MiB less
    # the H100's reservation. The 144 GB HBM3e variant is larger: pass --gpu-memory.
    GpuPreset(
        "GH200", (97_871 - _HOPPER_RESERVED_MIB) * MiB, ("GH200 480GB", "GH200-96GB"), _HOPPER
    ),
    # derived: nvidia-smi 97,871 MiB less the H100's reservation; no public runtime
    # figure found. (The 141 GB H20 variant is larger: pass --gpu-memory.)
    GpuPreset("H20", (97_871 - _HOPPER_RESERVED_MIB) * MiB, ("H20-96GB",), _HOPPER),
    # 42,298,834,944 B (39.39 GiB): deviceQuery "Total amount of global memory" of an
    # "NVIDIA A100-SXM4-40GB", https://github.com/bottlerocket-os/bottlerocket/pull/3873
    GpuPreset("A100-40GB", 42_298_834_944, ("A100-SXM4-40GB", "A100-PCIE-40GB"), _AMPERE_GA100),
    # 79.25 GiB: "79.25 GiB total capacity" on an A100 80GB,
    # https://github.com/levihsu/OOTDiffusion/issues/235
    GpuPreset("A100-80GB", _gib("79.25"), ("A100-SXM4-80GB", "A100 80GB PCIe"), _AMPERE_GA100),
    # 22.18 GiB: "GPU 0 has a total capacity of 22.18 GiB" on one A10,
    # https://github.com/OpenBMB/MiniCPM-V/issues/640
    GpuPreset("A10", _gib("22.18"), (), _AMPERE),
    # derived: the A10's figure; both report 23,028 MiB in nvidia-smi
    # (https://github.com/modal-labs/modal-client/pull/2797 and, for the A10G,
    # https://github.com/AUTOMATIC1111/stable-diffusion-webui/issues/1259).
    GpuPreset("A10G", _gib("22.18"), (), _AMPERE),
    # derived: the L40S's runtime figure; both report 46,068 MiB in nvidia-smi with ECC on.
    GpuPreset("A40", _gib("44.42"), (), _AMPERE),
    # 47.54 GiB: "47.54 GiB total capacity" on an A6000,
    # https://github.com/google-research/semivl/issues/18
    GpuPreset("A6000", _gib("47.54"), ("RTX A6000", "RTX-A6000"), _AMPERE),
    # 44.40 GiB: "total capacity of 44.40 GiB" on an L40,
    # https://github.com/QwenLM/Qwen3-VL/issues/2097
    GpuPreset("L40", _gib("44.40"), (), _ADA),
    # 44.42 GiB: "total capacity of 44.42 GiB" on 8 x L40S,
    # https://github.com/stepfun-ai/Step-Video-T2V/issues/8
    GpuPreset("L40S", _gib("44.42"), (), _ADA),
    # 22.03 GiB: "GPU 0 has a total capacity of 22.03 GiB" on an L4,
    # https://github.com/ArcInstitute/evo2/issues/190
    GpuPreset("L4", _gib("22.03"), (), _ADA),
    # 23.56 GiB: "Free memory on device (22.93/23.56 GiB)" on 8 x RTX 3090,
    # https://github.com/wtdcode/vllm-backport/issues/34 (other logs: 23.58 GiB).
    GpuPreset("RTX-3090", _gib("23.56"), ("GeForce RTX 3090", "3090"), _AMPERE),
    # 23.65 GiB: "total capacty of 23.65 GiB" on 4 x RTX 4090,
    # https://github.com/QwenLM/Qwen3/issues/678
    GpuPreset("RTX-4090", _gib("23.65"), ("GeForce RTX 4090", "4090"), _ADA),
    # derived: 192 GiB of HBM3 as ROCm reports it (191.98 GiB); no public runtime log
    # with the figure was found. ROCm (gfx942): no CUDA compute capability.
    GpuPreset("MI300X", _gib("191.98"), ("AMD Instinct MI300X", "Instinct MI300X"), None),
)

# Names that fit more than one board: refused with the choices rather than guessed,
# since the two differ by 40 GB.
_AMBIGUOUS: dict[str, tuple[str, ...]] = {"a100": ("A100-40GB", "A100-80GB")}


def _key(name: str) -> str:
    """Matching key: lowercase, no ``NVIDIA``/``AMD`` prefix, no spaces, ``-`` or ``_``."""
    key = name.strip().lower()
    key = re.sub(r"^(nvidia|amd)[\s_-]*", "", key)
    return re.sub(r"[\s_-]+", "", key)


_BY_KEY: dict[str, GpuPreset] = {
    _key(alias): preset for preset in GPU_PRESETS for alias in (preset.name, *preset.aliases)
}


def gpu_preset(name: str) -> GpuPreset:
    """Look a preset up by name or alias, as people type it.

    Case, spaces, ``-`` versus ``_`` and a leading ``NVIDIA `` do not matter, so
    ``h100``, ``NVIDIA H100 80GB HBM3`` and ``rtx_4090`` all match. An unknown or
    ambiguous name raises :class:`InvalidInputError` listing the canonical names.
    """
    key = _key(name)
    if key in _AMBIGUOUS:
        raise InvalidInputError(
            "gpu", name, f"is ambiguous: name one of {', '.join(_AMBIGUOUS[key])}"
        )
    preset = _BY_KEY.get(key)
    if preset is None:
        known = ", ".join(p.name for p in GPU_PRESETS)
        raise InvalidInputError("gpu", name, f"must be one of {known} (or give --gpu-memory SIZE)")
    return preset


# Boards with no NVLink at all (NVIDIA's product pages: L4, L40, L40S, A10, A10G and
# the RTX 4090 have no NVLink connector): tensor parallelism on them goes over PCIe.
# Boards a bridge may join in pairs (A40, A6000, RTX 3090, H100 PCIe) are not here:
# whether a given machine has the bridge is not known from the name.
_NO_NVLINK = frozenset({"L4", "L40", "L40S", "A10", "A10G", "RTX-4090"})


def gpu_without_nvlink(name: str | None) -> bool:
    """Whether the preset ``name`` names is a board that has no NVLink at all."""
    if name is None:
        return False
    preset = _BY_KEY.get(_key(name))
    return preset is not None and preset.name in _NO_NVLINK


def gpu_compute_capability(name: str | None) -> tuple[int, int] | None:
    """CUDA compute capability of the preset ``name`` names; None if unknown.

    None for no name, a name no preset answers to (such as ``custom`` for a GPU given
    only by ``--gpu-memory``) and ROCm boards. An ambiguous name answers when its
    boards agree (both A100s are 8.0).
    """
    if name is None:
        return None
    key = _key(name)
    names = _AMBIGUOUS.get(key, (name,))
    found = {p.compute_capability if (p := _BY_KEY.get(_key(n))) else None for n in names}
    return found.pop() if len(found) == 1 else None
