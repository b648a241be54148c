"""Fakes that kvguard's tests and its users' tests share.

:class:`FakeNvml` stands in for the ``pynvml`` module (the subset
:class:`~kvguard.probes.nvml.NvmlProbe` uses), built from :class:`FakeGpu`
records, with switches for the situations real drivers produce: an old driver
without memory info v2, no driver at all, a GPU that falls off the bus, fields a
GPU does not support, and a call that hangs::

    from kvguard.probes.nvml import NvmlProbe
    from kvguard.testing import FakeGpu, FakeNvml

    nvml = FakeNvml([FakeGpu("NVIDIA H100 80GB HBM3", "GPU-0", total_bytes=80 * 2**30)])
    probe = NvmlProbe(nvml=nvml)
    nvml.set_used(0, 60 * 2**30)

Names, return shapes and error classes mirror ``pynvml`` (nvidia-ml-py), hence
the camelCase below.

:class:`SimulatedAllocator` grows a fake GPU's used memory as PyTorch's CUDA caching
allocator would for one process (segments, a CUDA context, an out-of-memory error
when the GPU is full), and :func:`nvidia_smi_csv` prints the fake GPUs as
``nvidia-smi --query-gpu`` does: together they let the GPU check
(``scripts/gpu-check.sh --fake``) run without a GPU.

One module of ~600 lines on purpose: users import the fakes from one place
(``kvguard.testing``), and the fake driver mirrors a real API surface.
"""

# ruff: noqa: N801, N802, N815, N818 - the fake mirrors pynvml's names on purpose

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# pynvml's error codes (nvml.h), so str() and .value read like the real thing.
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_UNKNOWN = 999

# pynvml.nvmlMemory_v2: the struct version the v2 memory query takes.
NVML_MEMORY_V2 = 0x02000028

# Fields that FakeNvml(not_supported=...) can switch off.
SUPPORTABLE_FIELDS = frozenset({"processes", "name", "memory", "memory_v2"})


class NVMLError(Exception):
    """Base of the fake's NVML errors, as ``pynvml.NVMLError`` (``.value`` is the code)."""

    value: int = NVML_ERROR_UNKNOWN
    message: str = "Unknown Error"

    def __str__(self) -> str:
        return self.message


class NVMLError_Uninitialized(NVMLError):
    """A call before ``nvmlInit`` (or after the last ``nvmlShutdown``)."""

    value = NVML_ERROR_UNINITIALIZED
    message = "Uninitialized"


class NVMLError_InvalidArgument(NVMLError):
    """A bad argument, such as a GPU index past the count."""

    value = NVML_ERROR_INVALID_ARGUMENT
    message = "Invalid Argument"


class NVMLError_NotSupported(NVMLError):
    """The GPU or driver does not offer this query."""

    value = NVML_ERROR_NOT_SUPPORTED
    message = "Not Supported"


class NVMLError_NoPermission(NVMLError):
    """The caller may not make this query."""

    value = NVML_ERROR_NO_PERMISSION
    message = "Insufficient Permissions"


class NVMLError_NotFound(NVMLError):
    """No such device (e.g. an unknown UUID)."""

    value = NVML_ERROR_NOT_FOUND
    message = "Not Found"


class NVMLError_DriverNotLoaded(NVMLError):
    """The library is there but the kernel driver is not."""

    value = NVML_ERROR_DRIVER_NOT_LOADED
    message = "Driver Not Loaded"


class NVMLError_LibraryNotFound(NVMLError):
    """``libnvidia-ml.so.1`` is not installed (no driver on this machine)."""

    value = NVML_ERROR_LIBRARY_NOT_FOUND
    message = "NVML Shared Library Not Found"


class NVMLError_FunctionNotFound(NVMLError):
    """The driver's library lacks the function (an old driver asked for memory info v2)."""

    value = NVML_ERROR_FUNCTION_NOT_FOUND
    message = "Function Not Found"


class NVMLError_GpuIsLost(NVMLError):
    """The GPU fell off the bus or stopped answering."""

    value = NVML_ERROR_GPU_IS_LOST
    message = "GPU is lost"


class NVMLError_ArgumentVersionMismatch(NVMLError):
    """The driver does not know the struct version asked for."""

    value = NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    message = "Argument version mismatch"


class NVMLError_Unknown(NVMLError):
    """NVML's catch-all failure."""

    value = NVML_ERROR_UNKNOWN
    message = "Unknown Error"


class NVMLLibraryMismatchError(Exception):
    """pynvml's error for an unversioned call the driver's library cannot serve.

    Not an ``NVMLError``, as in pynvml.
    """


@dataclass
class FakeGpu:
    """One fake GPU.

    ``used_bytes`` is what processes hold, without the driver's reservation
    (memory info v2's ``used``); v1 reports ``used_bytes + reserved_bytes``, as
    real drivers do. ``processes`` maps PID to bytes (None: the driver hides it).
    """

    name: str
    uuid: str
    total_bytes: int
    used_bytes: int = 0
    reserved_bytes: int = 0
    processes: dict[int, int | None] = field(default_factory=dict)

    @property
    def free_bytes(self) -> int:
        """What is left after processes and the driver's reservation."""
        return self.total_bytes - self.used_bytes - self.reserved_bytes


@dataclass(frozen=True)
class FakeHandle:
    """A device handle as ``nvmlDeviceGetHandleByIndex`` returns it."""

    index: int


@dataclass(frozen=True)
class FakeMemory:
    """``nvmlDeviceGetMemoryInfo(handle)``: pynvml's ``c_nvmlMemory_t`` (no ``reserved``)."""

    total: int
    free: int
    used: int


@dataclass(frozen=True)
class FakeMemoryV2:
    """``nvmlDeviceGetMemoryInfo(handle, version=nvmlMemory_v2)``: ``c_nvmlMemory_v2_t``."""

    version: int
    total: int
    reserved: int
    free: int
    used: int


@dataclass(frozen=True)
class FakeProcessInfo:
    """One entry of ``nvmlDeviceGetComputeRunningProcesses`` (``usedGpuMemory`` may be None)."""

    pid: int
    usedGpuMemory: int | None
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


class FakeNvml:
    """A drop-in for the ``pynvml`` module, over a list of :class:`FakeGpu`.

    Scenario switches (all may be changed while a probe runs):

    - ``v1_only``: a driver older than R510. Memory info v2 raises
      ``NVMLError_FunctionNotFound`` (v1 counts the reservation as used), and the
      unversioned process query raises ``NVMLLibraryMismatchError`` as pynvml does
      when the library lacks its ``_v3``; ``..._v2`` still answers.
    - ``library_missing`` / ``driver_not_loaded``: ``nvmlInit`` fails as it does on a
      machine without the driver library / with the library but no kernel driver.
    - ``not_supported``: names from :data:`SUPPORTABLE_FIELDS` whose queries raise
      ``NVMLError_NotSupported`` (``memory`` covers v1 and v2).
    - :meth:`lose_gpu` / :meth:`restore_gpu`: calls on that GPU raise
      ``NVMLError_GpuIsLost``.
    - ``hang``: while it is an unset :class:`threading.Event`, every call blocks
      until it is set (set it in teardown so no thread is left waiting);
      ``blocked_calls`` counts the calls waiting on it now.

    ``calls`` counts calls by function name; ``initialized`` follows pynvml's
    init/shutdown reference count. Device queries before ``nvmlInit`` raise
    ``NVMLError_Uninitialized``, as the real library does.
    """

    NVMLError = NVMLError
    NVMLError_Uninitialized = NVMLError_Uninitialized
    NVMLError_InvalidArgument = NVMLError_InvalidArgument
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_NoPermission = NVMLError_NoPermission
    NVMLError_NotFound = NVMLError_NotFound
    NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVMLError_FunctionNotFound = NVMLError_FunctionNotFound
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    NVMLError_ArgumentVersionMismatch = NVMLError_ArgumentVersionMismatch
    NVMLError_Unknown = NVMLError_Unknown
    NVMLLibraryMismatchError = NVMLLibraryMismatchError
    nvmlMemory_v2 = NVML_MEMORY_V2

    def __init__(
        self,
        gpus: Sequence[FakeGpu] = (),
        *,
        v1_only: bool = False,
        library_missing: bool = False,
        driver_not_loaded: bool = False,
        not_supported: Iterable[str] = (),
        hang: threading.Event | None = None,
        driver_version: str = "550.54.15",
        nvml_version: str = "12.550.54.15",
    ) -> None:
        self.gpus = list(gpus)
        self.v1_only = v1_only
        self.library_missing = library_missing
        self.driver_not_loaded = driver_not_loaded
        self.not_supported = set(not_supported)
        unknown = self.not_supported - SUPPORTABLE_FIELDS
        if unknown:
            raise ValueError(f"not_supported: unknown field(s) {sorted(unknown)}")
        self.hang = hang
        self.driver_version = driver_version
        self.nvml_version = nvml_version
        self.calls: Counter[str] = Counter()
        self.blocked_calls = 0
        self._refcount = 0
        self._lost: set[int] = set()
        self._lock = threading.Lock()

    # -- scenario controls ---------------------------------------------------------

    @property
    def initialized(self) -> bool:
        """True between ``nvmlInit`` and the matching ``nvmlShutdown``."""
        return self._refcount > 0

    def set_used(self, index: int, used_bytes: int) -> None:
        """Change what processes hold on GPU ``index`` (v2 ``used``)."""
        self.gpus[index].used_bytes = used_bytes

    def set_processes(self, index: int, processes: dict[int, int | None]) -> None:
        """Replace the compute processes listed on GPU ``index``."""
        self.gpus[index].processes = dict(processes)

    def lose_gpu(self, index: int) -> None:
        """Make every call on GPU ``index`` raise ``NVMLError_GpuIsLost``."""
        self._lost.add(index)

    def restore_gpu(self, index: int) -> None:
        """Let GPU ``index`` answer again."""
        self._lost.discard(index)

    # -- the pynvml surface --------------------------------------------------------

    def nvmlInit(self) -> None:
        """Start the library, or fail as a machine without the driver does."""
        self._enter("nvmlInit")
        if self.library_missing:
            raise NVMLError_LibraryNotFound
        if self.driver_not_loaded:
            raise NVMLError_DriverNotLoaded
        self._refcount += 1

    def nvmlShutdown(self) -> None:
        """Release one ``nvmlInit``."""
        self._enter("nvmlShutdown", needs_init=True)
        self._refcount -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        """The driver version, e.g. ``550.54.15``."""
        self._enter("nvmlSystemGetDriverVersion", needs_init=True)
        return self.driver_version

    def nvmlSystemGetNVMLVersion(self) -> str:
        """The NVML library version, e.g. ``12.550.54.15``."""
        self._enter("nvmlSystemGetNVMLVersion", needs_init=True)
        return self.nvml_version

    def nvmlDeviceGetCount(self) -> int:
        """How many GPUs there are (lost ones included, as with the real driver)."""
        self._enter("nvmlDeviceGetCount", needs_init=True)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        """A handle for GPU ``index``."""
        self._enter("nvmlDeviceGetHandleByIndex", needs_init=True)
        if not 0 <= index < len(self.gpus):
            raise NVMLError_InvalidArgument
        self._check_lost(index)
        return FakeHandle(index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> FakeHandle:
        """A handle for the GPU with this UUID."""
        self._enter("nvmlDeviceGetHandleByUUID", needs_init=True)
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        for index, gpu in enumerate(self.gpus):
            if gpu.uuid == text:
                self._check_lost(index)
                return FakeHandle(index)
        raise NVMLError_NotFound

    def nvmlDeviceGetIndex(self, handle: FakeHandle) -> int:
        """The index of the GPU behind ``handle``."""
        self._device("nvmlDeviceGetIndex", handle)
        return handle.index

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        """The GPU's product name."""
        gpu = self._device("nvmlDeviceGetName", handle)
        self._check_supported("name")
        return gpu.name

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        """The GPU's UUID (``GPU-…``)."""
        return self._device("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetMemoryInfo(
        self, handle: FakeHandle, version: int | None = None
    ) -> FakeMemory | FakeMemoryV2:
        """Memory info v1 (``version`` None) or v2 (``version=nvmlMemory_v2``)."""
        gpu = self._device("nvmlDeviceGetMemoryInfo", handle)
        self._check_supported("memory")
        if not version:
            # v1 has no reservation field: the driver counts it as used.
            return FakeMemory(
                total=gpu.total_bytes,
                free=gpu.free_bytes,
                used=gpu.used_bytes + gpu.reserved_bytes,
            )
        if self.v1_only:
            raise NVMLError_FunctionNotFound
        if version != NVML_MEMORY_V2:
            raise NVMLError_ArgumentVersionMismatch
        self._check_supported("memory_v2")
        return FakeMemoryV2(
            version=version,
            total=gpu.total_bytes,
            reserved=gpu.reserved_bytes,
            free=gpu.free_bytes,
            used=gpu.used_bytes,
        )

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeHandle) -> list[FakeProcessInfo]:
        """The compute processes on the GPU and their memory (pynvml's ``_v3`` underneath)."""
        gpu = self._device("nvmlDeviceGetComputeRunningProcesses", handle)
        if self.v1_only:
            raise NVMLLibraryMismatchError("Unversioned function called (fake old driver)")
        self._check_supported("processes")
        return [FakeProcessInfo(pid, used) for pid, used in gpu.processes.items()]

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: FakeHandle) -> list[FakeProcessInfo]:
        """The same through the older query, which old drivers still have."""
        gpu = self._device("nvmlDeviceGetComputeRunningProcesses_v2", handle)
        self._check_supported("processes")
        return [FakeProcessInfo(pid, used) for pid, used in gpu.processes.items()]

    # -- internals -----------------------------------------------------------------

    def _enter(self, call: str, *, needs_init: bool = False) -> None:
        self.calls[call] += 1
        hang = self.hang
        if hang is not None and not hang.is_set():
            with self._lock:
                self.blocked_calls += 1
            try:
                hang.wait()
            finally:
                with self._lock:
                    self.blocked_calls -= 1
        if needs_init and not self.initialized:
            raise NVMLError_Uninitialized

    def _device(self, call: str, handle: FakeHandle) -> FakeGpu:
        self._enter(call, needs_init=True)
        self._check_lost(handle.index)
        return self.gpus[handle.index]

    def _check_lost(self, index: int) -> None:
        if index in self._lost:
            raise NVMLError_GpuIsLost

    def _check_supported(self, field_name: str) -> None:
        if field_name in self.not_supported:
            raise NVMLError_NotSupported


# -- a simulated CUDA caching allocator on a fake GPU ----------------------------------

MiB = 2**20
# PyTorch's caching allocator (c10/cuda/CUDACachingAllocator.cpp): requests are
# rounded to 512 B; up to 1 MiB they come from 2 MiB segments, up to 10 MiB from
# 20 MiB segments, and larger ones get their own segment rounded up to 2 MiB.
ALLOCATION_ROUND_BYTES = 512
SMALL_ALLOCATION_BYTES = 1 * MiB
SMALL_SEGMENT_BYTES = 2 * MiB
LARGE_SEGMENT_BYTES = 20 * MiB
MIN_LARGE_ALLOCATION_BYTES = 10 * MiB
DEFAULT_CONTEXT_BYTES = 500 * MiB  # what a CUDA context costs on a recent GPU


class FakeOutOfMemoryError(RuntimeError):
    """No room on the fake GPU for a new segment: ``torch.cuda.OutOfMemoryError``'s stand-in."""


@dataclass(eq=False)  # segments are told apart by identity, not by their sizes
class _Segment:
    size: int
    used: int = 0
    small: bool = False


class SimulatedAllocator:
    """PyTorch's CUDA caching allocator in miniature, for one fake process on one fake GPU.

    Each allocation is rounded as PyTorch rounds it and carved from a cached
    segment; a new segment is taken from the GPU (``FakeGpu.used_bytes`` and the
    process's entry in ``FakeGpu.processes`` grow by its size) only when no cached
    one has room, and fails with :class:`FakeOutOfMemoryError` when the GPU's free
    memory is smaller than the segment — as ``cudaMalloc`` fails. Freed blocks stay
    cached (reserved) until :meth:`empty_cache`, as in PyTorch. Fragmentation is
    modelled only roughly: a segment's free space is one run, and a segment too full
    for a request is not offered to later ones until something in it is freed (exact
    for a load of one block size, and what keeps a long run linear in time).

    ``memory_allocated`` / ``memory_reserved`` mirror ``torch.cuda.memory_allocated``
    / ``memory_reserved``; :meth:`start` creates the CUDA context (``context_bytes``
    on the GPU, not counted as reserved) and :meth:`shutdown` gives everything back.
    """

    def __init__(
        self,
        nvml: FakeNvml,
        index: int = 0,
        *,
        pid: int = 4242,
        context_bytes: int = DEFAULT_CONTEXT_BYTES,
    ) -> None:
        if not 0 <= index < len(nvml.gpus):
            raise ValueError(f"index: no fake GPU {index} (there are {len(nvml.gpus)})")
        if pid <= 0:
            raise ValueError(f"pid: a positive process id, got {pid}")
        if context_bytes < 0:
            raise ValueError(f"context_bytes: 0 or more, got {context_bytes}")
        self.nvml = nvml
        self.index = index
        self.pid = pid
        self.context_bytes = context_bytes
        self._segments: list[_Segment] = []
        self._open: list[_Segment] = []  # segments that may still have room
        self._blocks: dict[int, tuple[_Segment, int]] = {}
        self._next_handle = 1
        self._started = False

    @property
    def gpu(self) -> FakeGpu:
        """The fake GPU this allocator takes its memory from."""
        return self.nvml.gpus[self.index]

    def memory_allocated(self) -> int:
        """Bytes held by live allocations (``torch.cuda.memory_allocated``)."""
        return sum(size for _, size in self._blocks.values())

    def memory_reserved(self) -> int:
        """Bytes in cached segments (``torch.cuda.memory_reserved``)."""
        return sum(s.size for s in self._segments)

    def start(self) -> None:
        """Create the CUDA context: the process appears on the GPU with ``context_bytes``."""
        if self._started:
            return
        if self.context_bytes > self.gpu.free_bytes:
            raise FakeOutOfMemoryError("CUDA error: out of memory (creating the context)")
        self._started = True
        self._charge(self.context_bytes)

    def allocate(self, nbytes: int) -> int:
        """Allocate ``nbytes``; returns a handle for :meth:`free`."""
        if nbytes <= 0:
            raise ValueError(f"nbytes: a positive number of bytes, got {nbytes}")
        self.start()
        size = -(-nbytes // ALLOCATION_ROUND_BYTES) * ALLOCATION_ROUND_BYTES
        small = size <= SMALL_ALLOCATION_BYTES
        segment = next(
            (s for s in self._open if s.small == small and s.size - s.used >= size), None
        )
        if segment is None:
            segment = _Segment(self._segment_size(size), small=small)
            if segment.size > self.gpu.free_bytes:
                raise FakeOutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate {size / MiB:.2f} MiB. GPU"
                    f" {self.index} has a total capacity of {self.gpu.total_bytes / 2**30:.2f}"
                    f" GiB of which {self.gpu.free_bytes / MiB:.2f} MiB is free."
                )
            self._segments.append(segment)
            self._open.append(segment)
            self._charge(segment.size)
        segment.used += size
        # Drop what could not take this request again (so the search stays short).
        self._open = [s for s in self._open if s.size - s.used >= size or s.small != small]
        handle = self._next_handle
        self._next_handle += 1
        self._blocks[handle] = (segment, size)
        return handle

    def free(self, handle: int) -> None:
        """Free an allocation; its segment stays cached."""
        segment, size = self._blocks.pop(handle)
        segment.used -= size
        if segment not in self._open:
            self._open.append(segment)

    def empty_cache(self) -> None:
        """Give unused cached segments back to the GPU (``torch.cuda.empty_cache``)."""
        idle = [s for s in self._segments if s.used == 0]
        self._segments = [s for s in self._segments if s.used > 0]
        self._open = [s for s in self._open if s.used > 0]
        self._charge(-sum(s.size for s in idle))

    def shutdown(self) -> None:
        """Free everything and end the context: the process leaves the GPU."""
        for handle in list(self._blocks):
            self.free(handle)
        self.empty_cache()
        if self._started:
            self._charge(-self.context_bytes)
            self._started = False
            processes = dict(self.gpu.processes)
            processes.pop(self.pid, None)
            self.nvml.set_processes(self.index, processes)

    @staticmethod
    def _segment_size(size: int) -> int:
        if size <= SMALL_ALLOCATION_BYTES:
            return SMALL_SEGMENT_BYTES
        if size < MIN_LARGE_ALLOCATION_BYTES:
            return LARGE_SEGMENT_BYTES
        return -(-size // SMALL_SEGMENT_BYTES) * SMALL_SEGMENT_BYTES

    def _charge(self, nbytes: int) -> None:
        """Move the GPU's and this process's used bytes by ``nbytes`` (may be negative)."""
        gpu = self.gpu
        self.nvml.set_used(self.index, gpu.used_bytes + nbytes)
        processes = dict(gpu.processes)
        processes[self.pid] = (processes.get(self.pid) or 0) + nbytes
        # One assignment: a probe thread iterating the old dict never sees it change.
        self.nvml.set_processes(self.index, processes)


def nvidia_smi_csv(nvml: FakeNvml) -> str:
    """What ``nvidia-smi --query-gpu=index,memory.total,memory.used --format=csv`` prints.

    Figures in whole MiB, rounded down, as nvidia-smi prints them; ``memory.used``
    leaves out the driver's reservation, as drivers with memory info v2 report it.
    """
    lines = ["index, memory.total [MiB], memory.used [MiB]"]
    lines += [
        f"{i}, {gpu.total_bytes // MiB} MiB, {gpu.used_bytes // MiB} MiB"
        for i, gpu in enumerate(nvml.gpus)
    ]
    return "\n".join(lines) + "\n"
