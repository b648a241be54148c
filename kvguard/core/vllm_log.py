"""What a vLLM server measured at start-up, read back from its log.

vLLM profiles the GPU before it sizes its KV cache pool and prints what it found:
the memory the weights took, the activation peak, memory outside PyTorch, what was
left for the KV cache, and how many tokens that pool holds. ``kvguard budget
--from-vllm-log FILE`` reads those figures back so an operator can set them beside
kvguard's own prediction. This module is the pure half of that: it takes the log's
text (the caller reads the file) and returns a :class:`VllmStartupLog`.

vLLM has changed these lines many times; every wording below was copied from a real
log or from vLLM's source, with the releases that printed it:

* V0, v0.6.4 to v0.6.4.post1 (PR #9352), ``worker.py``: ``Memory profiling results:
  total_gpu_memory=…GiB initial_memory_usage=… peak_torch_memory=…
  non_torch_memory=…GiB kv_cache_size=…GiB gpu_memory_utilization=0.90`` (later
  builds of the same line add ``duration=… seconds,`` and commas).
* V0, a development build between v0.6.4.post1 and v0.6.5: a ``Memory profiling
  results:`` table, one ``name<TAB>value`` line per figure.
* V0, v0.6.5 to v0.8.x: ``Memory profiling takes … seconds`` / ``the current vLLM
  instance can use total_gpu_memory (…GiB) x gpu_memory_utilization (…) = …GiB`` /
  ``model weights take …GiB; non_torch_memory takes …GiB; PyTorch activation peak
  memory takes …GiB; the rest of the memory reserved for KV Cache is …GiB.``
* V0: ``Loading model weights took … GB`` (vLLM divides by 2**30, so "GB" is GiB),
  ``# GPU blocks: N, # CPU blocks: M`` (``# CUDA blocks`` / ``# cuda blocks`` from
  early 2025; ``# rocm blocks`` and so on on other platforms), ``Graph capturing
  finished in N secs, took … GiB`` (PR #10027), and the capacity error ``maximum
  number of tokens that can be stored in KV cache (N)``.
* V1 (v0.8 on): ``Model loading took … GiB and … seconds`` (later ``… GiB memory
  and …``), ``Available KV cache memory: … GiB`` (``gpu_worker.py``), ``GPU KV cache
  size: N tokens`` and ``Maximum concurrency for N tokens per request: X.XXx``
  (``kv_cache_utils.py``; thousands separators since PR #13596, early 2025).
* V1 DEBUG lines of ``gpu_worker.py``: ``Free memory on device (free/total GiB) on
  startup. Desired GPU memory utilization is (u, … GiB). Actual usage is … GiB for
  weight, … for peak activation, … for non-torch memory, and … GiB for CUDAGraph
  memory. … Current kv cache memory in use is … GiB.`` (PR #21489, mid-2025),
  ``Initial free memory: … GiB; Requested memory: u (util), … GiB``, and the
  ``MemoryProfilingResult`` repr of ``vllm/utils/mem_utils.py``.
* V1 CUDA graph reservation: ``Estimated CUDA graph memory: … GiB total``, ``CUDA
  graph memory profiling is enabled …`` (opt-in with
  ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1`` after PR #30515, the default since
  v0.21.0 by vLLM's own message: the estimate is then taken off the pool *before* it
  is sized), ``In v0.19, CUDA graph memory profiling will be enabled by default …``
  (estimated, not taken off), and ``CUDA graph pool memory: … GiB (actual), … GiB
  (estimated)``.
* Configuration: ``Initializing a V1 LLM engine (v…) with config: model='…', …``
  (``Initializing an LLM engine`` / ``a V0 LLM engine`` on V0), ``vLLM API server
  version …``, the start-up banner's ``version …``, and ``non-default args: {…}``.

With tensor or pipeline parallelism every worker prints its own lines, prefixed
``(VllmWorkerProcess pid=…)``, ``(VllmWorker rank=1 pid=…)``, ``(RayWorkerWrapper
pid=…)``, ``(Worker_TP1 pid=…)`` and so on; a figure is taken from rank 0 (the
unprefixed driver, ``rank=0``, ``Worker_TP0``, ``EngineCore_DP0``) when rank 0
printed it, and ``ranks_seen`` says how many workers printed one. Where a line
repeats, the last one counts. Unknown lines are skipped, never an error. A file of
several start-ups (rank 0 printed the pool's size more than once) is read from the
end of the last but one: the last start-up alone.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from kvguard.core.units import GiB
from kvguard.errors import InvalidInputError

FIELD = "from_vllm_log"
NOT_A_VLLM_LOG = "no vLLM memory-profiling or KV cache lines found (is this a vLLM start-up log?)"


@dataclass(frozen=True)
class VllmStartupLog:
    """The figures one vLLM start-up log holds; ``None`` where the log does not say.

    Memory is in bytes (vLLM prints GiB with two or four decimals, so a figure is
    only as exact as that: about 5 MiB). Figures printed by every worker are rank 0's.
    ``sources`` names, for each field that has a value, the line it came from, for
    an operator-facing "source" column.
    """

    source: str
    version: str | None = None
    engine: str | None = None  # "v1" or "v0"
    model: str | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_dtype: str | None = None
    quantization: str | None = None
    block_size: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    enforce_eager: bool | None = None
    speculative_config: str | None = None
    sampler: str | None = None  # the top-k/top-p path it said it took (engine_rules.SAMPLERS)
    total_gpu_memory_bytes: int | None = None
    free_gpu_memory_at_startup_bytes: int | None = None
    requested_memory_bytes: int | None = None  # total x gpu_memory_utilization
    weights_bytes: int | None = None
    non_torch_bytes: int | None = None
    activation_peak_bytes: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_tokens: int | None = None
    gpu_blocks: int | None = None
    max_concurrency: float | None = None
    max_concurrency_tokens_per_request: int | None = None
    cuda_graph_bytes: int | None = None  # measured after capture
    cuda_graph_estimate_bytes: int | None = None  # estimated before the pool was sized
    # True: the estimate was taken off before the pool was sized; False: it was printed
    # but not taken off (so the graphs came out of the headroom instead).
    cuda_graph_reserved_before_kv_cache: bool | None = None
    ranks_seen: int = 0
    # Start-ups the text holds (rank 0's KV cache size lines): figures are the last one's.
    startups: int = 1
    sources: dict[str, str] = field(default_factory=dict, hash=False)


# Figures that say something about memory; a log with none of them is not a start-up
# log (or was cut before profiling), and parse_vllm_log refuses it.
MEMORY_FIELDS: tuple[str, ...] = (
    "total_gpu_memory_bytes",
    "free_gpu_memory_at_startup_bytes",
    "requested_memory_bytes",
    "weights_bytes",
    "non_torch_bytes",
    "activation_peak_bytes",
    "kv_cache_memory_bytes",
    "kv_cache_tokens",
    "gpu_blocks",
    "max_concurrency",
    "cuda_graph_bytes",
    "cuda_graph_estimate_bytes",
)
# Figures each worker measures for its own GPU: the ones ranks_seen counts. The token,
# block and concurrency lines come from the scheduler, once per engine.
_PER_WORKER_FIELDS = frozenset(MEMORY_FIELDS) - {
    "kv_cache_tokens",
    "gpu_blocks",
    "max_concurrency",
}

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# (VllmWorkerProcess pid=90), (VllmWorker rank=1 pid=7), (RayWorkerWrapper pid=3, ip=…),
# (Worker_TP1 pid=5), (EngineCore_DP0 pid=9), (APIServer pid=1), (WorkerDict pid=4).
_WORKER = re.compile(r"\((?P<name>[A-Za-z_]\w*)(?: rank=(?P<rank>\d+))? pid=\d+(?:, ip=[^)]*)?\)")
# A number as vLLM prints it: 42,656 or 6.51 or -0.19.
_N = r"(-?\d[\d,]*(?:\.\d+)?)"
_UNKNOWN_RANK = 1_000_000
_RANK_ZERO = 0


def _num(text: str) -> float:
    return float(text.replace(",", ""))


def _int(text: str) -> int:
    return int(_num(text))


def _gib(text: str) -> int:
    return round(_num(text) * GiB)


def _mib(text: str) -> int:
    return round(_num(text) * 2**20)


def _rank_of(line: str) -> tuple[int, str]:
    """Who printed the line: (priority, process label); priority 0 is rank 0.

    Unprefixed lines come from the driver process, which is rank 0 in V0 and the
    single process of an in-process V1 engine. A worker whose rank the prefix does
    not say (``VllmWorkerProcess``, ``RayWorkerWrapper``) counts only when rank 0
    printed nothing.
    """
    match = _WORKER.search(line)
    if match is None:
        return _RANK_ZERO, ""
    name, rank = match["name"], match["rank"]
    label = match.group(0)[1:-1]
    if rank is not None:
        return int(rank), label
    if name.startswith(("Worker_", "EngineCore")):
        # Worker_TP1, Worker_PP1_TP0, EngineCore_DP1, EngineCore_1: all indices zero is rank 0.
        indices = [int(n) for n in re.findall(r"\d+", name)]
        return (max(indices, default=0), label) if any(indices) else (_RANK_ZERO, label)
    if name == "APIServer":
        return _RANK_ZERO, label
    return _UNKNOWN_RANK, label


class _Collector:
    """Keeps, for each field, the value of the best-ranked line (the last of equals)."""

    def __init__(self) -> None:
        self.values: dict[str, object] = {}
        self.priority: dict[str, int] = {}
        self.sources: dict[str, str] = {}
        self.workers: set[str] = set()
        self.any_memory: set[str] = set()

    def put(self, name: str, value: object, what: str, rank: tuple[int, str]) -> None:
        priority, label = rank
        if name in MEMORY_FIELDS:
            self.any_memory.add(label)
            if name in _PER_WORKER_FIELDS:
                self.workers.add(label)
        if name in self.priority and self.priority[name] < priority:
            return
        self.values[name] = value
        self.priority[name] = priority
        self.sources[name] = f"{what} ({label})" if label else what


# ---------------------------------------------------------------- line readers
# Each reader looks for one wording anywhere in the line (so timestamps, levels,
# worker prefixes, docker-compose "service |" prefixes and quote marks before it do
# not matter) and puts what it finds.

Reader = Callable[[str, _Collector, tuple[int, str]], None]


def _profiling_results_line(line: str, out: _Collector, rank: tuple[int, str]) -> None:
    if "Memory profiling results:" not in line:
        return
    what = "V0 memory profiling results line"
    out.put("engine_hint", "v0", what, rank)
    pairs = dict(re.findall(r"\b(\w+)=" + _N, line))
    if "total_gpu_memory" in pairs:
        out.put("total_gpu_memory_bytes", _gib(pairs["total_gpu_memory"]), what, rank)
    if "non_torch_memory" in pairs:
        out.put("non_torch_bytes", _gib(pairs["non_torch_memory"]), what, rank)
    if "kv_cache_size" in pairs:
        out.put("kv_cache_memory_bytes", _gib(pairs["kv_cache_size"]), what, rank)
    if "gpu_memory_utilization" in pairs:
        out.put("gpu_memory_utilization", _num(pairs["gpu_memory_utilization"]), what, rank)
    # peak_torch_memory here includes the weights, so it is not the activation peak;
    # it is left out rather than derived.


_TABLE = {
    # The development-build table: "name<TAB>value" after the prefix.
    "total_gpu_memory_bytes": re.compile(r"\btotal_gpu_memory\s+" + _N + r"\s*GiB"),
    "weights_bytes": re.compile(r"\bmodel weights take\s+" + _N + r"\s*GiB\s*$"),
    "non_torch_bytes": re.compile(r"\bnon_torch_memory\s+" + _N + r"\s*GiB"),
    "activation_peak_bytes": re.compile(r"PyTorch activation peak memory\s+" + _N + r"\s*GiB"),
    "kv_cache_memory_bytes": re.compile(r"\bavailable_kv_cache_memory\s+" + _N + r"\s*GiB"),
    "requested_memory_bytes": re.compile(r"the current vLLM instance can use\s+" + _N + r"\s*GiB"),
}
_TABLE_UTIL = re.compile(r"\bgpu_memory_utilization\s+" + _N + r"\s*$")


def _profiling_table_line(line: str, out: _Collector, rank: tuple[int, str]) -> None:
    what = "V0 memory profiling table"
    for name, pattern in _TABLE.items():
        match = pattern.search(line)
        if match:
            out.put(name, _gib(match[1]), what, rank)
            out.put("engine_hint", "v0", what, rank)
    match = _TABLE_UTIL.search(line)
    if match:
        out.put("gpu_memory_utilization", _num(match[1]), what, rank)


_CAN_USE = re.compile(
    r"the current vLLM instance can use total_gpu_memory \(" + _N + r"\s*GiB\)"
    r" x gpu_memory_utilization \(" + _N + r"\) = " + _N + r"\s*GiB"
)
_TAKES = re.compile(
    r"model weights take " + _N + r"\s*GiB; non_torch_memory takes " + _N + r"\s*GiB;"
    r" PyTorch activation peak memory takes " + _N + r"\s*GiB;"
    r" the rest of the memory reserved for KV Cache is " + _N + r"\s*GiB"
)


def _profiling_takes_lines(line: str, out: _Collector, rank: tuple[int, str]) -> None:
    what = "V0 memory profiling line"
    match = _CAN_USE.search(line)
    if match:
        out.put("total_gpu_memory_bytes", _gib(match[1]), what, rank)
        out.put("gpu_memory_utilization", _num(match[2]), what, rank)
        out.put("requested_memory_bytes", _gib(match[3]), what, rank)
        out.put("engine_hint", "v0", what, rank)
    match = _TAKES.search(line)
    if match:
        out.put("weights_profiled", _gib(match[1]), what, rank)
        out.put("non_torch_bytes", _gib(match[2]), what, rank)
        out.put("activation_peak_bytes", _gib(match[3]), what, rank)
        out.put("kv_cache_memory_bytes", _gib(match[4]), what, rank)


# "Loading model weights took 7.5122 GB" (V0, and V1 before v0.8.x) and "Model loading
# took 31.2795 GiB and 45.4 seconds" / "… GiB memory and …" (V1). "Loading weights took
# 46.94 seconds" is a duration and does not match.
_WEIGHTS = re.compile(r"(?:Loading model weights|Model loading) took " + _N + r"\s*Gi?B\b")


def _weights_line(line: str, out: _Collector, rank: tuple[int, str]) -> None:
    match = _WEIGHTS.search(line)
    if match:
        # vLLM divides by 2**30 even where it prints "GB".
        out.put("weights_bytes", _gib(match[1]), "model loading line", rank)
        if match[0].startswith("Model loading"):
            # V1's GPU model runner; V0 said "Loading model weights took".
            out.put("engine_hint", "v1", "model loading line", rank)


_AVAILABLE = re.compile(r"Available KV cache memory: " + _N + r"\s*GiB")
_SKIPPED = re.compile(
    r"Initial free memory " + _N + r"\s*GiB, reserved " + _N + r"\s*GiB memory for KV Cache"
)
_TOKENS = re.compile(r"GPU KV cache size: " + _N + r" tokens")
_CONCURRENCY = re.compile(r"Maximum concurrency for " + _N + r" tokens per request: " + _N + "x")
# V0's executor names the device as its platform does: "# GPU blocks" before early
# 2025, then current_platform.device_name ("cuda", "rocm", "xpu", "hpu", "tpu").
_BLOCKS = re.compile(r"#?\s*(?:GPU|CUDA|(?i:cuda|gpu|rocm|xpu|hpu|tpu)) blocks: " + _N)
_CPU_BLOCKS = re.compile(r"#\s*CPU blocks: ")
_CAPACITY = re.compile(r"maximum number of tokens that can be stored in KV cache \(" + _N + r"\)")


def _kv_cache_lines(line: str, out: _Collector, rank: tuple[int, str]) -> None:
    match = _AVAILABLE.search(line)
    if match:
        out.put("kv_cache_memory_bytes", _gib(match[1]), "Available KV cache memory line", rank)
        out.put("engine_hint", "v1", "Available KV cache memory line", rank)
    match = _SKIPPED.search(line)
    if match:
        what = "kv_cache_memory_bytes line (profiling skipped)"
        out.put("free_gpu_memory_at_startup_bytes", _gib(match[1]), what, rank)
        out.put("kv_cache_memory_bytes", _gib(match[2]), what, rank)
    match = _TOKENS.search(line)
    if match:
        out.put("kv_cache_tokens", _int(match[1]), "GPU KV cache size line", rank)
        out.put("engine_hint", "v1", "GPU KV cache size line", rank)
    match = _CONCURRENCY.search(line)
    if match:
        what = "Maximum concurrency line"
        out.put("max_concurrency_tokens_per_request", _int(match[1]), what, rank)
        out.put("max_concurrency", _num(match[2]), what, rank)
    match = _BLOCKS.search(line)
    if match:
        out.put("gpu_blocks", _int(match[1]), "GPU blocks line", rank)
        if _CPU_BLOCKS.search(line):
            # Only V0 sized a CPU swap pool next to the GPU one.
            out.put("engine_hint", "v0", "GPU blocks line", rank)
    match = _CAPACITY.search(line)
    if match:
        out.put("kv_cache_tokens", _int(match[1]), "KV cache capacity error line", rank)


_FREE_ON_DEVICE = re.compile(r"Free memory on device \(" + _N + r"/" + _N + r" GiB\) on startup")
_DESIRED = re.compile(r"[Dd]esired GPU memory utilization (?:is )?\(" + _N + r", " + _N + r" GiB\)")
_ACTUAL_USAGE = re.compile(
    r"Actual usage is "
    + _N
    + r" GiB for weight, "
    + _N
    + r" GiB for peak activation, "
    + _N
    + r" GiB for non-torch memory, and "
    + _N
    + r" GiB for CUDAGraph memory"
)
_IN_USE = re.compile(r"Current kv cache memory in use is " + _N + r" GiB")
_REQUESTED = re.compile(
    r"Initial free memory: " + _N + r" GiB; Requested memory: " + _N + r" \(util\), " + _N + " GiB"
)
_PROFILE_REPR = re.compile(
    r"Memory profiling takes [\d.]+ seconds\. Total non KV cache memory: " + _N + r"GiB;"
    r" torch peak memory increase: " + _N + r"GiB;"
)
_PROFILE_NON_TORCH = re.compile(r"non-torch forward increase memory: " + _N + r"GiB")
_PROFILE_WEIGHTS = re.compile(r"weights memory: " + _N + r"GiB")


def _v1_debug_lines(line: str, out: _Collector, rank: tuple[int, str]) -> None:
    match = _FREE_ON_DEVICE.search(line)
    if match:
        what = "free memory on device line"
        out.put("free_gpu_memory_at_startup_bytes", _gib(match[1]), what, rank)
        out.put("total_gpu_memory_bytes", _gib(match[2]), what, rank)
    match = _DESIRED.search(line)
    if match:
        what = "desired GPU memory utilization line"
        out.put("gpu_memory_utilization", _num(match[1]), what, rank)
        out.put("requested_memory_bytes", _gib(match[2]), what, rank)
    match = _ACTUAL_USAGE.search(line)
    if match:
        what = "memory usage breakdown line"
        out.put("weights_profiled", _gib(match[1]), what, rank)
        out.put("activation_peak_bytes", _gib(match[2]), what, rank)
        out.put("non_torch_bytes", _gib(match[3]), what, rank)
        out.put("cuda_graph_bytes", _gib(match[4]), what, rank)
    match = _IN_USE.search(line)
    if match:
        out.put("kv_cache_memory_bytes", _gib(match[1]), "memory usage breakdown line", rank)
    match = _REQUESTED.search(line)
    if match:
        what = "requested memory line"
        out.put("free_gpu_memory_at_startup_bytes", _gib(match[1]), what, rank)
        out.put("gpu_memory_utilization", _num(match[2]), what, rank)
        out.put("requested_memory_bytes", _gib(match[3]), what, rank)
    match = _PROFILE_REPR.search(line)
    if match:
        what = "memory profiling result line"
        out.put("activation_peak_bytes", _gib(match[2]), what, rank)
        non_torch = _PROFILE_NON_TORCH.search(line)
        if non_torch:
            out.put("non_torch_bytes", _gib(non_torch[1]), what, rank)
        weights = _PROFILE_WEIGHTS.search(line)
        if weights:
            out.put("weights_profiled", _gib(weights[1]), what, rank)


_GRAPH_CAPTURED = re.compile(
    r"Graph capturing finished in [\d.]+ secs?, took " + _N + r" (GiB|MiB)"
)
_GRAPH_POOL = re.compile(
    r"CUDA graph pool memory: " + _N + r" GiB \(actual\), " + _N + r" GiB \(estimated\)"
)
_GRAPH_ESTIMATE = re.compile(r"Estimated CUDA graph memory: " + _N + r" GiB total")
_GRAPH_UTIL = re.compile(r"The current --gpu-memory-utilization=" + _N)
_GRAPH_NOT_YET = re.compile(r"from " + _N + r" to " + _N + r" to maintain the same effective")


def _cuda_graph_lines(line: str, out: _Collector, rank: tuple[int, str]) -> None:
    match = _GRAPH_CAPTURED.search(line)
    if match:
        size = _gib(match[1]) if match[2] == "GiB" else _mib(match[1])
        out.put("cuda_graph_bytes", size, "CUDA graph capture line", rank)
    match = _GRAPH_POOL.search(line)
    if match:
        # The actual figure can be negative: vLLM measures it as a change in free memory.
        out.put("cuda_graph_bytes", _gib(match[1]), "CUDA graph pool line", rank)
        out.put("cuda_graph_estimate_bytes", _gib(match[2]), "CUDA graph pool line", rank)
    match = _GRAPH_ESTIMATE.search(line)
    if match:
        what = "CUDA graph estimate line"
        out.put("cuda_graph_estimate_bytes", _gib(match[1]), what, rank)
    if "CUDA graph memory profiling is enabled" in line:
        what = "CUDA graph memory profiling line"
        out.put("cuda_graph_reserved_before_kv_cache", True, what, rank)
        util = _GRAPH_UTIL.search(line)
        if util:
            out.put("gpu_memory_utilization", _num(util[1]), what, rank)
    if "CUDA graph memory profiling will be enabled by default" in line:
        what = "CUDA graph memory profiling line"
        out.put("cuda_graph_reserved_before_kv_cache", False, what, rank)
        util = _GRAPH_NOT_YET.search(line)
        if util:
            out.put("gpu_memory_utilization", _num(util[1]), what, rank)


_ENGINE = re.compile(
    r"Initializing (?:a (V[01]) |an )LLM engine(?: \(v?([^)\s]+)\))? with config: (.*)$"
)
_API_VERSION = re.compile(r"vLLM API server version (\S+)")
_BANNER_VERSION = re.compile(r"█\s+version (\S+)")


def _take_value(text: str, start: int) -> str:
    """The raw value from ``start``: up to the next ", " at bracket depth 0."""
    depth = 0
    quote = ""
    for i in range(start, len(text)):
        char = text[i]
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            return text[start:i]
    return text[start:]


def _config_values(config: str) -> dict[str, str]:
    """``key=value`` pairs of the engine config line, stopping where the line was cut."""
    values: dict[str, str] = {}
    position = 0
    key = re.compile(r"\s*(\w+)=")
    while position < len(config):
        match = key.match(config, position)
        if match is None:
            break
        value = _take_value(config, match.end())
        values.setdefault(match[1], value.strip())
        position = match.end() + len(value) + 1
    return values


def _unquote(value: str) -> str:
    return value[1:-1] if len(value) >= 2 and value[0] == value[-1] == "'" else value


def _engine_line(line: str, out: _Collector, rank: tuple[int, str]) -> None:
    match = _ENGINE.search(line)
    if match:
        what = "engine config line"
        out.put("engine", (match[1] or "V0").lower(), what, rank)
        if match[2]:
            out.put("version", match[2], what, rank)
        values = _config_values(match[3])
        # A value at the very end may be cut short (a pasted excerpt, a truncated
        # line); only values followed by a separator are trusted.
        complete = {k: v for k, v in values.items() if match[3].find(f"{k}={v},") >= 0}
        if "model" in complete:
            out.put("model", _unquote(complete["model"]), what, rank)
        for name, key in (
            ("tensor_parallel_size", "tensor_parallel_size"),
            ("pipeline_parallel_size", "pipeline_parallel_size"),
            ("max_model_len", "max_seq_len"),
        ):
            if complete.get(key, "").isdigit():
                out.put(name, int(complete[key]), what, rank)
        for name in ("quantization", "kv_cache_dtype"):
            if complete.get(name, "None") != "None":
                out.put(name, complete[name], what, rank)
        if complete.get("enforce_eager") in ("True", "False"):
            out.put("enforce_eager", complete["enforce_eager"] == "True", what, rank)
        if complete.get("speculative_config", "None") != "None":
            out.put("speculative_config", complete["speculative_config"], what, rank)
    for pattern, what in (
        (_API_VERSION, "API server version line"),
        (_BANNER_VERSION, "start-up banner"),
    ):
        version = pattern.search(line)
        if version:
            out.put("version", version[1], what, rank)


_ARGS = re.compile(r"non-default args: (\{.*\})\s*$")
_ARG_TYPES: dict[str, type] = {
    "max_model_len": int,
    "tensor_parallel_size": int,
    "pipeline_parallel_size": int,
    "gpu_memory_utilization": float,
    "block_size": int,
    "max_num_batched_tokens": int,
    "max_num_seqs": int,
    "kv_cache_dtype": str,
    "quantization": str,
    "enforce_eager": bool,
}


def _args_line(line: str, out: _Collector, rank: tuple[int, str]) -> None:
    match = _ARGS.search(line)
    if match is None:
        return
    try:
        # literal_eval only builds literals; it never runs code from the log.
        args = ast.literal_eval(match[1])
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return
    if not isinstance(args, dict):
        return
    what = "non-default args line"
    model = args.get("model", args.get("model_tag"))
    if isinstance(model, str):
        out.put("model", model, what, rank)
    for name, kind in _ARG_TYPES.items():
        value = args.get(name)
        if isinstance(value, bool) and kind is not bool:
            continue
        if kind is float and isinstance(value, int):
            value = float(value)
        if isinstance(value, kind):
            out.put(name, value, what, rank)
    if args.get("speculative_config") is not None:
        out.put("speculative_config", repr(args["speculative_config"]), what, rank)


def _sampler_line(line: str, out: _Collector, rank: tuple[int, str]) -> None:
    # vllm/v1/sample/ops/topk_topp_sampler.py says which top-k/top-p path it took (0.8
    # to 0.16 print one or the other; later releases print neither where they take
    # their default): what the profile run's sampler held.
    if "Using FlashInfer for top-p & top-k sampling" in line:
        out.put("sampler", "flashinfer", "top-k/top-p sampler line", rank)
    elif "Falling back to the PyTorch-native implementation of top-p & top-k" in line or (
        "topk_topp_sampler" in line and "FlashInfer is not available" in line
    ):  # the warning's first half is enough: a captured log may wrap it
        out.put("sampler", "pytorch", "top-k/top-p sampler line", rank)


_READERS: tuple[Reader, ...] = (
    _sampler_line,
    _profiling_results_line,
    _profiling_table_line,
    _profiling_takes_lines,
    _weights_line,
    _kv_cache_lines,
    _v1_debug_lines,
    _cuda_graph_lines,
    _engine_line,
    _args_line,
)


def _is_comment(line: str) -> bool:
    # A fixture's "# source:" line, or a note an operator added; vLLM's own V0 line
    # "# GPU blocks: …" also starts with "#" once the log prefix is cut off.
    return line.lstrip().startswith("#") and _BLOCKS.search(line) is None


def _last_startup(lines: list[str]) -> tuple[list[str], int]:
    """The lines of the last start-up in ``lines``, and how many start-ups they hold.

    A start-up ends where rank 0 prints the pool it sized (V1's "GPU KV cache size",
    else V0's "# GPU blocks"): a file of several (a server restarted with other
    flags, two engines' logs in one file) would otherwise mix one start-up's figures
    with another's. What follows the last but one such line is the last start-up.
    """
    ends = [i for i, line in enumerate(lines) if _TOKENS.search(line) and _is_rank_zero(line)]
    if not ends:
        ends = [i for i, line in enumerate(lines) if _BLOCKS.search(line) and _is_rank_zero(line)]
    if len(ends) < 2:
        return lines, 1
    return lines[ends[-2] + 1 :], len(ends)


def _is_rank_zero(line: str) -> bool:
    return _rank_of(line)[0] == _RANK_ZERO


def parse_vllm_log(text: str, source: str = "log") -> VllmStartupLog:
    """Read the figures a vLLM server printed at start-up from its log ``text``.

    ``source`` names the log in errors and in the result (a file name, "stdin").
    Raises :class:`InvalidInputError` (field ``from_vllm_log``) when the text holds
    no memory figure at all; any other line vLLM or anything else printed is skipped.
    Where the text holds several start-ups, only the last one is read
    (:attr:`VllmStartupLog.startups` says how many there were).
    """
    out = _Collector()
    cleaned = [_ANSI.sub("", raw).rstrip("\r") for raw in text.splitlines()]
    lines, startups = _last_startup(
        [line for line in cleaned if line.strip() and not _is_comment(line)]
    )
    for line in lines:
        rank = _rank_of(line)
        for reader in _READERS:
            reader(line, out, rank)

    values = out.values
    sources = dict(out.sources)
    if "weights_bytes" not in values and "weights_profiled" in values:
        # The loading line has four decimals; the profiling summary rounds to two.
        values["weights_bytes"] = values["weights_profiled"]
        sources["weights_bytes"] = sources["weights_profiled"]
    if "engine" not in values and "engine_hint" in values:
        values["engine"] = values["engine_hint"]
        sources["engine"] = f"inferred from the {sources['engine_hint']}"
    for internal in ("weights_profiled", "engine_hint"):
        values.pop(internal, None)
        sources.pop(internal, None)

    if not any(name in values for name in MEMORY_FIELDS):
        raise InvalidInputError(FIELD, source, NOT_A_VLLM_LOG)
    ranks = out.workers or out.any_memory
    return VllmStartupLog(
        source=source,
        ranks_seen=len(ranks),
        startups=startups,
        sources=sources,
        **values,  # type: ignore[arg-type]
    )
