"""GPU memory from NVML: the only module in kvguard that imports ``pynvml``.

:class:`NvmlProbe` reads, per selected GPU, total/used/free bytes, the driver's
reservation (memory info v2; ``None`` on drivers with only v1, where it counts as
used) and each compute process's memory. Every NVML call runs in a worker thread
with a timeout, so a hung driver costs one failed sample, never the event loop.

Failures become :class:`~kvguard.errors.ProbeError`, never ``NVMLError``:

- no library, no driver, no GPU: the probe is unavailable (:attr:`NvmlProbe.available`),
  logs ``nvml_unavailable`` once, and retries ``nvmlInit`` at most once a minute;
- a GPU lost mid-run: that sample fails, ``gpu_lost`` is logged once, the next retries;
- a field the GPU does not support (processes, v2 memory info): reported as unknown,
  the rest of the reading still comes back.

``pynvml`` is imported lazily, so kvguard runs where ``nvidia-ml-py`` is missing.

One module of ~600 lines on purpose: it is the only place that touches ``pynvml``
(the pure-core contract bans it everywhere else), and its thread, timeout and
failure rules apply to every NVML call alike.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, TypeAlias, TypeVar

import structlog

from kvguard.core.snapshot import GpuMemory, GpuProcess
from kvguard.errors import InvalidInputError, ProbeError
from kvguard.probes.host import process_tree

PROBE_NAME = "nvml"
INIT_RETRY_INTERVAL_S = 60.0
# NVML's "value not available" for 64-bit fields; older nvidia-ml-py passes it through.
NOT_AVAILABLE_ULL = 2**64 - 1
# Newest first: pynvml's unversioned query needs a driver from about R510 on.
PROCESS_QUERIES = (
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetComputeRunningProcesses_v2",
)

log = structlog.get_logger("kvguard.probes.nvml")

T = TypeVar("T")

# pynvml ships no type information and the fake mirrors it, so the module and its
# device handles are typed loosely; every value read from them is converted here.
NvmlModule: TypeAlias = Any
NvmlHandle: TypeAlias = Any


@dataclass(frozen=True)
class GpuSelector:
    """Which GPUs the probe reads.

    Empty selects every GPU. Otherwise a GPU is selected when it matches any
    criterion given: its NVML index, its UUID (``GPU-…``), or a compute process on
    it whose PID is one of ``pids`` or a descendant of one (engines such as vLLM
    hold the GPU in a child process). PIDs are as NVML reports them: the host's,
    so a containerised kvguard needs the host PID namespace to select by PID.
    """

    indices: tuple[int, ...] = ()
    uuids: tuple[str, ...] = ()
    pids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for index in self.indices:
            if index < 0:
                raise InvalidInputError("gpu.indices", index, "GPU indices are 0 or more")
        for uuid in self.uuids:
            if not uuid.strip():
                raise InvalidInputError("gpu.uuids", uuid, "a GPU UUID such as 'GPU-1a2b…'")
        for pid in self.pids:
            if pid <= 0:
                raise InvalidInputError("engine.pid", pid, "a positive process id")

    @property
    def selects_all(self) -> bool:
        """True when no criterion is given: every GPU is read."""
        return not (self.indices or self.uuids or self.pids)

    @property
    def explicit(self) -> bool:
        """True when indices or UUIDs name the GPUs: a followed PID does not change them."""
        return bool(self.indices or self.uuids)


class _UnavailableError(Exception):
    """NVML cannot be used at all here (no library, no driver, no GPU)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class _GpuLostError(Exception):
    """One GPU stopped answering (``GpuIsLost`` or ``Unknown`` on its handle)."""

    def __init__(self, index: int, detail: str) -> None:
        self.index = index
        self.detail = detail
        super().__init__(f"GPU {index} lost: {detail}")


@dataclass(frozen=True)
class _Errors:
    """The NVML exception classes the probe tells apart (an absent class matches nothing)."""

    base: tuple[type[BaseException], ...]
    lost: tuple[type[BaseException], ...]
    not_supported: tuple[type[BaseException], ...]
    v2_missing: tuple[type[BaseException], ...]
    function_missing: tuple[type[BaseException], ...]
    reinit: tuple[type[BaseException], ...]

    @classmethod
    def of(cls, nvml: NvmlModule) -> _Errors:
        """Look the classes up on a pynvml-like module."""

        def pick(*names: str) -> tuple[type[BaseException], ...]:
            return tuple(getattr(nvml, name) for name in names if hasattr(nvml, name))

        return cls(
            # pynvml raises NVMLLibraryMismatchError (not an NVMLError) when an
            # unversioned call needs a function the driver's library lacks.
            base=pick("NVMLError", "NVMLLibraryMismatchError"),
            lost=pick("NVMLError_GpuIsLost", "NVMLError_Unknown"),
            # No permission (containers, MIG) reads as "not available to us" too.
            not_supported=pick("NVMLError_NotSupported", "NVMLError_NoPermission"),
            # How drivers older than memory info v2 refuse it.
            v2_missing=pick(
                "NVMLError_FunctionNotFound",
                "NVMLError_NotSupported",
                "NVMLError_ArgumentVersionMismatch",
            ),
            function_missing=pick(
                "NVMLError_FunctionNotFound",
                "NVMLLibraryMismatchError",
                "NVMLError_ArgumentVersionMismatch",
            ),
            # The driver went away under us: start over with nvmlInit next sample.
            reinit=pick("NVMLError_Uninitialized", "NVMLError_DriverNotLoaded"),
        )


def _describe(exc: BaseException) -> str:
    """An NVML error as ``ClassName: message`` (pynvml's messages alone are terse)."""
    return f"{type(exc).__name__}: {exc}"


def _text(value: object) -> str:
    """A name or UUID as text (older pynvml returns bytes)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _bytes_or_none(value: object) -> int | None:
    """A process's memory, or None where NVML cannot tell (WDDM, MIG, no permission)."""
    if value is None:
        return None
    number = int(value)  # type: ignore[call-overload]
    return None if number == NOT_AVAILABLE_ULL else number


def _fill(future: concurrent.futures.Future[T], fn: Callable[[], T]) -> None:
    """Run ``fn`` in the worker thread and hand its outcome to ``future``."""
    try:
        result = fn()
    except BaseException as exc:  # noqa: BLE001 - handed on whole to the awaiting task
        future.set_exception(exc)
    else:
        future.set_result(result)


async def _wait_done(future: concurrent.futures.Future[Any], timeout_s: float | None) -> bool:
    """Wait, without blocking the loop, until ``future`` is done; False on timeout."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()

    def wake(_: object) -> None:
        # The thread may finish after the loop is closed; nobody is waiting then.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(done.set)

    future.add_done_callback(wake)
    try:
        await asyncio.wait_for(done.wait(), timeout_s)
    except asyncio.TimeoutError:
        return False
    return True


def _selected(selector: GpuSelector, gpu: GpuMemory, wanted_pids: frozenset[int]) -> bool:
    """Whether ``gpu`` matches the selector (any criterion given)."""
    if selector.selects_all or gpu.index in selector.indices or gpu.uuid in selector.uuids:
        return True
    return any(p.pid in wanted_pids for p in gpu.processes)


def _check_selection(
    selector: GpuSelector, gpus: list[GpuMemory], seen_uuids: list[str], wanted_pids: frozenset[int]
) -> None:
    """Fail the sample when a named UUID is absent or the selected PIDs run on no GPU."""
    missing_uuids = [u for u in selector.uuids if u not in seen_uuids]
    if missing_uuids:
        raise ProbeError(
            PROBE_NAME,
            f"GPU uuid {missing_uuids[0]} not found: NVML sees {', '.join(seen_uuids)}",
        )
    if selector.pids and not gpus:
        pids = ", ".join(str(p) for p in sorted(wanted_pids))
        raise ProbeError(
            PROBE_NAME,
            f"no GPU runs pid {pids} (the engine or its children) yet;"
            " in a container, NVML reports host PIDs",
        )


class NvmlProbe:
    """Reads GPU memory through NVML; a :class:`~kvguard.probes.base.FollowingProbe` (``nvml``).

    ``nvml`` is a pynvml-like module (:class:`kvguard.testing.FakeNvml` in tests;
    None imports ``pynvml``). ``timeout_s`` bounds each sample's NVML work;
    ``clock`` paces the retries of a failed ``nvmlInit``.

    Calls run in one daemon thread per sample, and a new one starts only after
    the previous has returned: a hung driver call therefore holds one thread, makes
    later samples fail at once, and never blocks the loop or interpreter exit (the
    default executor's threads are joined at shutdown, so ``to_thread`` would).
    """

    name: str = PROBE_NAME

    def __init__(
        self,
        selector: GpuSelector = GpuSelector(),
        *,
        nvml: NvmlModule = None,
        timeout_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if timeout_s <= 0:
            raise InvalidInputError("poll.timeout_s", timeout_s, "a positive number of seconds")
        self.selector = selector
        self._nvml: NvmlModule = None
        self._errors: _Errors | None = None
        self._process_queries: list[str] = []
        if nvml is not None:
            self._adopt(nvml)
        self._timeout_s = timeout_s
        self._clock = clock
        # Written by the worker thread, read by the loop: plain assignments only.
        self._inited = False
        self._v2_missing = False
        self._driver_version: str | None = None
        self._nvml_version: str | None = None
        self._unavailable_reason: str | None = None
        self._unavailable_logged = False
        self._init_attempted_at: float | None = None
        self._lost: set[int] = set()
        self._inflight: concurrent.futures.Future[Any] | None = None

    @property
    def available(self) -> bool:
        """False once NVML could not start (see :attr:`unavailable_reason`).

        True before the first sample: the probe has not failed yet.
        """
        return self._unavailable_reason is None

    @property
    def unavailable_reason(self) -> str | None:
        """Why NVML cannot be used here (no library, no driver, no GPU), else None."""
        return self._unavailable_reason

    def driver_info(self) -> dict[str, str | None]:
        """Driver and NVML versions, and why NVML is unavailable if it is.

        The versions are read at ``nvmlInit`` (None until then); this makes no NVML
        call, so it never blocks.
        """
        return {
            "driver_version": self._driver_version,
            "nvml_version": self._nvml_version,
            "unavailable_reason": self._unavailable_reason,
        }

    async def sample(self) -> tuple[GpuMemory, ...]:
        """Memory of every selected GPU, in NVML index order.

        Raises :class:`ProbeError` when NVML is unavailable, a call fails or times
        out, a call from an earlier sample has still not returned, a selected
        index or UUID does not exist, or only PIDs select GPUs and none runs them.
        A GPU whose processes NVML will not list reports ``processes == ()``.
        """
        if not self._inited:
            attempted = self._init_attempted_at
            if (
                self._unavailable_reason is not None
                and attempted is not None
                and self._clock() - attempted < INIT_RETRY_INTERVAL_S
            ):
                raise ProbeError(PROBE_NAME, f"unavailable: {self._unavailable_reason}")
            self._init_attempted_at = self._clock()
        try:
            gpus = await self._run(self._sample_sync)
        except _UnavailableError as exc:
            self._mark_unavailable(exc.reason)
            raise ProbeError(PROBE_NAME, f"unavailable: {exc.reason}") from None
        except _GpuLostError as exc:
            self._note_lost(exc)
            raise ProbeError(PROBE_NAME, str(exc)) from None
        self._mark_healthy()
        return gpus

    def follow(self, pid: int | None) -> None:
        """Watch the GPUs of ``pid`` and its descendants from the next sample on.

        For supervisor mode, where the engine's PID changes at each restart. Ignored
        when indices or UUIDs select the GPUs (they are the operator's explicit
        choice) and for None. Only where NVML's PIDs are kvguard's: on the host, or
        in a container sharing the host PID namespace; in a container of its own,
        NVML already shows only that container's GPUs, so keep selecting all there.
        """
        if pid is None or self.selector.explicit or self.selector.pids == (pid,):
            return
        # One assignment of a frozen value: a sample in flight keeps the one it read.
        self.selector = replace(self.selector, pids=(pid,))

    async def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until no NVML call is running (at once when none is); False on timeout."""
        inflight = self._inflight
        if inflight is None or inflight.done():
            return True
        return await _wait_done(inflight, timeout_s)

    async def close(self) -> None:
        """Shut NVML down if this probe started it; never raises.

        A call still hung after ``timeout_s`` more is left alone: shutting down
        under it could crash the driver library.
        """
        if not self._inited:
            return
        if not await self.wait_idle(self._timeout_s):
            log.warning("nvml_shutdown_skipped", reason="an NVML call is still running")
            return
        try:
            await self._run(self._shutdown_sync)
        except ProbeError as exc:
            log.warning("nvml_shutdown_failed", error=str(exc))

    # -- loop side -------------------------------------------------------------

    async def _run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in a fresh worker thread, waiting at most ``timeout_s``."""
        inflight = self._inflight
        if inflight is not None and not inflight.done():
            raise ProbeError(
                PROBE_NAME, "an earlier NVML call is still running (driver hung?); not queuing"
            )
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._inflight = future
        worker = threading.Thread(target=_fill, args=(future, fn), name="kvguard-nvml", daemon=True)
        worker.start()
        if not await _wait_done(future, self._timeout_s):
            raise ProbeError(PROBE_NAME, f"NVML did not answer within {self._timeout_s:g} s")
        return future.result()

    def continue_from(self, previous: NvmlProbe) -> None:
        """Take over what ``previous`` (the probe this one replaces at a reload) knew.

        NVML that was unavailable stays so until the next retry is due, and is not
        reported again (``nvml_unavailable`` once per run, not once per reload); lost
        GPUs stay lost until they answer.
        """
        self._unavailable_reason = previous._unavailable_reason
        self._unavailable_logged = previous._unavailable_logged
        self._init_attempted_at = previous._init_attempted_at
        self._lost = set(previous._lost)

    def _mark_unavailable(self, reason: str) -> None:
        self._unavailable_reason = reason
        if not self._unavailable_logged:
            self._unavailable_logged = True
            log.warning(
                "nvml_unavailable",
                reason=reason,
                retry_interval_s=INIT_RETRY_INTERVAL_S,
                hint="kvguard keeps working from engine metrics",
            )

    def _note_lost(self, lost: _GpuLostError) -> None:
        if lost.index not in self._lost:
            self._lost.add(lost.index)
            log.error("gpu_lost", gpu=lost.index, detail=lost.detail)

    def _mark_healthy(self) -> None:
        if self._unavailable_reason is not None:
            log.info("nvml_available", driver_version=self._driver_version)
            self._unavailable_reason = None
            self._unavailable_logged = False
        for index in sorted(self._lost):
            log.info("gpu_recovered", gpu=index)
        self._lost.clear()

    # -- worker-thread side: every NVML call happens below ------------------------

    def _sample_sync(self) -> tuple[GpuMemory, ...]:
        selector = self.selector  # once: follow() may replace it while this runs
        nvml = self._ensure_init()
        with self._translated(None, "device count"):
            count = int(nvml.nvmlDeviceGetCount())
        missing_indices = [i for i in selector.indices if i >= count]
        if missing_indices:
            raise ProbeError(
                PROBE_NAME,
                f"GPU index {missing_indices[0]} not found: NVML sees {count} GPU(s)"
                f" (indices 0..{count - 1})",
            )
        wanted_pids = self._wanted_pids(selector)
        index_only = bool(selector.indices) and not (selector.uuids or selector.pids)
        gpus: list[GpuMemory] = []
        seen_uuids: list[str] = []
        for index in range(count):
            # Index-only selection can skip the others without touching them.
            if index_only and index not in selector.indices:
                continue
            gpu = self._read_gpu(nvml, index)
            seen_uuids.append(gpu.uuid)
            if _selected(selector, gpu, wanted_pids):
                gpus.append(gpu)
        _check_selection(selector, gpus, seen_uuids, wanted_pids)
        return tuple(gpus)

    @staticmethod
    def _wanted_pids(selector: GpuSelector) -> frozenset[int]:
        """The selector's PIDs and their descendants, read afresh each sample."""
        wanted: set[int] = set()
        for pid in selector.pids:
            wanted.update(process_tree(pid) or (pid,))
        return frozenset(wanted)

    def _read_gpu(self, nvml: NvmlModule, index: int) -> GpuMemory:
        with self._translated(index, "handle"):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        with self._translated(index, "uuid"):
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        processes = self._processes(nvml, index, handle)
        total, used, free, reserved = self._memory(nvml, index, handle)
        return GpuMemory(
            index=index,
            uuid=uuid,
            name=self._name(nvml, index, handle),
            total_bytes=total,
            used_bytes=used,
            free_bytes=free,
            reserved_bytes=reserved,
            processes=processes,
        )

    def _name(self, nvml: NvmlModule, index: int, handle: NvmlHandle) -> str:
        assert self._errors is not None  # noqa: S101 - set by _ensure_init
        with self._translated(index, "name"):
            try:
                return _text(nvml.nvmlDeviceGetName(handle))
            except self._errors.not_supported:
                return ""  # GpuMemory.name is text; empty means unknown

    def _processes(
        self, nvml: NvmlModule, index: int, handle: NvmlHandle
    ) -> tuple[GpuProcess, ...]:
        """The GPU's compute processes; ``()`` when NVML will not list them."""
        assert self._errors is not None  # noqa: S101 - set by _ensure_init
        for query in list(self._process_queries):
            with self._translated(index, "processes"):
                try:
                    raw = getattr(nvml, query)(handle)
                except self._errors.not_supported:
                    return ()
                except self._errors.function_missing:
                    # An older driver: fall back to the previous query version, for good.
                    self._process_queries.remove(query)
                    continue
            return tuple(
                GpuProcess(pid=int(p.pid), used_bytes=_bytes_or_none(p.usedGpuMemory)) for p in raw
            )
        return ()

    def _memory(
        self, nvml: NvmlModule, index: int, handle: NvmlHandle
    ) -> tuple[int, int, int, int | None]:
        """Total, used, free and reserved bytes (reserved None with v1 only)."""
        assert self._errors is not None  # noqa: S101 - set by _ensure_init
        version = getattr(nvml, "nvmlMemory_v2", None)
        if version is not None and not self._v2_missing:
            with self._translated(index, "memory info v2"):
                try:
                    info = nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
                except self._errors.v2_missing:
                    # The driver is older than v2; it will not learn it while we run.
                    self._v2_missing = True
                else:
                    return int(info.total), int(info.used), int(info.free), int(info.reserved)
        with self._translated(index, "memory info"):
            info = nvml.nvmlDeviceGetMemoryInfo(handle)
        return int(info.total), int(info.used), int(info.free), None

    @contextlib.contextmanager
    def _translated(self, index: int | None, what: str) -> Iterator[None]:
        """Turn NVML errors raised inside into ours."""
        assert self._errors is not None  # noqa: S101 - set by _ensure_init
        errors = self._errors
        where = f"GPU {index} " if index is not None else ""
        try:
            yield
        except errors.lost as exc:
            if index is None:
                raise ProbeError(PROBE_NAME, f"{what}: {_describe(exc)}") from None
            raise _GpuLostError(index, f"{what}: {_describe(exc)}") from None
        except errors.reinit as exc:
            self._inited = False
            raise ProbeError(PROBE_NAME, f"{where}{what}: {_describe(exc)}") from None
        except errors.base as exc:
            raise ProbeError(PROBE_NAME, f"{where}{what}: {_describe(exc)}") from None

    def _load(self) -> NvmlModule:
        if self._nvml is None:
            try:
                self._adopt(importlib.import_module("pynvml"))
            except ImportError as exc:
                raise _UnavailableError(
                    f"nvidia-ml-py (module pynvml) is not installed: {exc}"
                ) from None
        return self._nvml

    def _adopt(self, nvml: NvmlModule) -> None:
        self._nvml = nvml
        self._errors = _Errors.of(nvml)
        self._process_queries = [name for name in PROCESS_QUERIES if hasattr(nvml, name)]

    def _ensure_init(self) -> NvmlModule:
        nvml = self._load()
        if self._inited:
            return nvml
        assert self._errors is not None  # noqa: S101 - set by _load
        try:
            nvml.nvmlInit()
        except self._errors.base as exc:
            raise _UnavailableError(_describe(exc)) from None
        self._inited = True
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except self._errors.base as exc:
            self._shutdown_quietly(nvml)
            raise _UnavailableError(f"device count: {_describe(exc)}") from None
        if count == 0:
            self._shutdown_quietly(nvml)
            raise _UnavailableError("NVML started but found no NVIDIA GPU")
        self._driver_version = self._optional_text(nvml.nvmlSystemGetDriverVersion)
        self._nvml_version = self._optional_text(nvml.nvmlSystemGetNVMLVersion)
        return nvml

    def _optional_text(self, call: Callable[[], object]) -> str | None:
        assert self._errors is not None  # noqa: S101 - set by _load
        try:
            return _text(call())
        except self._errors.base:
            return None  # versions are informative only

    def _shutdown_quietly(self, nvml: NvmlModule) -> None:
        assert self._errors is not None  # noqa: S101 - set by _load
        self._inited = False
        with contextlib.suppress(*self._errors.base):
            nvml.nvmlShutdown()

    def _shutdown_sync(self) -> None:
        with self._translated(None, "shutdown"):
            self._inited = False
            self._nvml.nvmlShutdown()
