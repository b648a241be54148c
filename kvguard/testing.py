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
