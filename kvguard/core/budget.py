"""The VRAM budget: weights, worst-case KV cache, activations, overhead, headroom.

Everything here is arithmetic on a :class:`~kvguard.core.architecture.ModelShape`
and the serving parameters in :class:`BudgetInputs`; docs/budget.md states each
formula and default. All byte figures are integers; "per GPU" means one GPU of a
tensor-/pipeline-parallel replica.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from fractions import Fraction
from functools import partial

from kvguard.core.architecture import ConfigFields, ModelShape, parse_fields
from kvguard.core.engine_rules import (
    SAMPLERS,
    V0_CHUNKED_FROM,
    BatchLimits,
    VllmRule,
    batch_defaults,
    cuda_graph_bytes,
    default_gpu_memory_utilization,
    non_torch_bytes,
    sampler_bytes_per_logit,
    sampler_kind,
    vllm_rule,
)
from kvguard.core.gpus import gpu_compute_capability, gpu_without_nvlink
from kvguard.core.units import DTYPE_BYTES, GiB, dtype_bytes
from kvguard.core.weights import estimate_weights, mxfp4_experts
from kvguard.errors import InvalidInputError

DEFAULT_GPU_MEMORY_BYTES = 80 * GiB
DEFAULT_BLOCK_SIZE = 16
SAMPLER_LOGIT_BYTES = 4  # fp32 logits per vocabulary entry per sequence (V0)
# Buffers V0's profile held besides the forward pass's activations (the intercept
# of its Llama-3-8B profiles at two batch sizes).
V0_FIXED_ACTIVATION_BYTES = GiB // 2


@dataclass(frozen=True)
class BudgetInputs:
    """Serving parameters, named after the engine flags they mirror.

    ``None`` means "derive it": ``max_model_len`` from the model's
    ``max_position_embeddings``, ``gpu_memory_bytes`` from the 80 GiB default,
    ``max_num_batched_tokens`` and ``max_num_seqs`` from the engine's defaults for
    the GPU, ``weights_bytes`` from the weight index or the config,
    ``activation_bytes`` and ``overhead_bytes`` from the documented estimates.
    ``kv_cache_memory_bytes`` fixes the per-GPU KV pool instead of deriving it from
    memory x utilization. ``engine_version`` picks the vLLM rule (None: the current
    one); ``gpu_name`` matters where vLLM's defaults look at it (A100s);
    ``speculative_layers`` are a drafter's attention layers (EAGLE, MTP) that share
    the pool with the target's shape.
    """

    tp: int = 1
    pp: int = 1
    max_model_len: int | None = None
    concurrency: int = 1
    kv_cache_dtype: str = "auto"
    gpu_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    weights_bytes: int | None = None
    kv_cache_memory_bytes: int | None = None
    activation_bytes: int | None = None
    overhead_bytes: int | None = None
    engine_version: str | None = None
    gpu_name: str | None = None
    speculative_layers: int = 0
    enforce_eager: bool = False
    sampler: str | None = None

    @property
    def utilization(self) -> float:
        """``gpu_memory_utilization``, or vLLM's default for ``engine_version`` when not given."""
        if self.gpu_memory_utilization is not None:
            return self.gpu_memory_utilization
        return default_gpu_memory_utilization(vllm_rule(self.engine_version))

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "concurrency", "block_size"):
            _check_int(name, getattr(self, name), 1, MAX_COUNT)
        _check_int("max_num_seqs", self.max_num_seqs, 1, MAX_COUNT, optional=True)
        _check_int("speculative_layers", self.speculative_layers, 0, 64)
        _check_int(
            "max_num_batched_tokens", self.max_num_batched_tokens, 1, MAX_TOKENS, optional=True
        )
        vllm_rule(self.engine_version)  # raises for a version it cannot read
        _check_int("max_model_len", self.max_model_len, 1, MAX_TOKENS, optional=True)
        _check_int("gpu_memory_bytes", self.gpu_memory_bytes, 1, MAX_BYTES, optional=True)
        _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1, MAX_BYTES, optional=True)
        for name in ("weights_bytes", "activation_bytes", "overhead_bytes"):
            _check_int(name, getattr(self, name), 0, MAX_BYTES, optional=True)
        util = self.gpu_memory_utilization
        if util is not None and (
            isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1
        ):
            raise InvalidInputError("gpu_memory_utilization", util, "must be a fraction in (0, 1]")
        if self.sampler is not None and self.sampler not in SAMPLERS:
            allowed = ", ".join(SAMPLERS)
            raise InvalidInputError("sampler", self.sampler, f"must be one of {allowed}")
        if not isinstance(self.kv_cache_dtype, str):
            raise InvalidInputError("kv_cache_dtype", self.kv_cache_dtype, "must be a dtype name")
        dtype = self.kv_cache_dtype.strip().lower()
        if dtype != "auto":
            dtype_bytes(dtype)  # raises for an unknown dtype
        object.__setattr__(self, "kv_cache_dtype", dtype)  # frozen: normalise once, here


# Bounds that keep every figure far from overflow while allowing any real deployment.
MAX_COUNT = 1_000_000
MAX_TOKENS = 2**31  # engines hold token positions in int32
MAX_BYTES = 2**60  # 1 EiB


def budget_inputs_from(source: object, **overrides: object) -> BudgetInputs:
    """:class:`BudgetInputs` from an object with same-named attributes.

    ``source`` is a config section, parsed CLI flags or a sim pool spec;
    ``overrides`` win. The values are validated as usual.
    """
    values = {
        f.name: getattr(source, f.name) for f in fields(BudgetInputs) if hasattr(source, f.name)
    }
    values.update(overrides)
    return BudgetInputs(**values)


def _check_int(
    name: str, value: object, minimum: int, maximum: int, optional: bool = False
) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        kind = "a byte count" if name.endswith("_bytes") else "an integer"
        raise InvalidInputError(name, value, f"must be {kind} from {minimum} to {maximum:,}")


def ceil_div(numerator: int, denominator: int) -> int:
    """Integer ceiling of a division (exact at any size, unlike ``math.ceil(a / b)``)."""
    return -(-numerator // denominator)


@dataclass(frozen=True)
class PipelineStage:
    """The layers one pipeline stage (one GPU of a TP group) holds, by kind."""

    full: int
    sliding: int
    state: int


def pipeline_stages(shape: ModelShape, pp: int) -> tuple[PipelineStage, ...]:
    """Split the layers into ``pp`` contiguous stages, the first ones one layer larger."""
    base, extra = divmod(shape.num_layers, pp)
    stages = []
    start = 0
    for index in range(pp):
        kinds = shape.layer_kinds[start : start + base + (1 if index < extra else 0)]
        start += len(kinds)
        stages.append(
            PipelineStage(kinds.count("full"), kinds.count("sliding"), kinds.count("state"))
        )
    return tuple(stages)


@dataclass(frozen=True)
class KvFootprint:
    """Cache bytes of one shape at one KV dtype and parallel layout, as vLLM lays it out.

    vLLM splits the attention layers into groups of equal size, one group per block
    table (full-attention layers in some, sliding-window layers in others, the
    last group of a kind padded); a block id spans one layer of each of
    ``group_size`` layers, and a request holds a block table in every group. A
    full-attention group holds a request's whole length, a sliding one only its
    window plus the tokens in flight (``sliding_reserve_tokens``), plus one block
    because a window need not start at a block boundary. Per-GPU figures are those
    of the fullest pipeline stage, the one that runs out first.
    """

    shape: ModelShape
    kv_dtype_bytes: Fraction
    state_dtype_bytes: Fraction
    tp: int
    pp: int
    block_size: int
    sliding_reserve_tokens: int | None = None  # None: the window alone (V0)
    speculative_layers: int = 0

    @property
    def stages(self) -> tuple[PipelineStage, ...]:
        """The pipeline stages' layer counts; a drafter's layers sit on the last one."""
        stages = list(pipeline_stages(self.shape, self.pp))
        last = stages[-1]
        stages[-1] = PipelineStage(last.full + self.speculative_layers, last.sliding, last.state)
        return tuple(stages)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes per token, whole model, one replica, every attention layer."""
        layers = self.shape.attention_layers + self.speculative_layers
        elements = self.shape.attention.elements_per_token(1) * layers
        return math.ceil(elements * self.kv_dtype_bytes)

    @property
    def bytes_per_token_per_gpu(self) -> int:
        """KV bytes per token on one GPU (heads split by TP, layers by PP)."""
        layers = max(stage.full + stage.sliding for stage in self.stages)
        return math.ceil(self._gpu_elements() * layers * self.kv_dtype_bytes)

    def block_bytes(self, per_gpu: bool = True) -> int:
        """Bytes one block id takes from the pool: a page in each layer of a group."""
        stage = self._stage(per_gpu)
        elements = self._elements(per_gpu) * self.block_size * _group_size(stage)
        return math.ceil(elements * self.kv_dtype_bytes)

    def request_blocks(self, tokens: int, per_gpu: bool = True) -> int:
        """Block ids a request of ``tokens`` holds across every group's block table."""
        stage = self._stage(per_gpu)
        size = _group_size(stage)
        full = ceil_div(stage.full, size) * ceil_div(tokens, self.block_size) if size else 0
        sliding = 0
        if stage.sliding:
            window = self.shape.sliding_window or 0
            if self.sliding_reserve_tokens is None:
                held = ceil_div(min(tokens, window), self.block_size)
            else:
                reserve = min(window - 1 + self.sliding_reserve_tokens, tokens)
                held = ceil_div(reserve, self.block_size) + 1
            sliding = ceil_div(stage.sliding, size) * held
        return full + sliding

    def sequence_bytes(self, tokens: int, per_gpu: bool) -> int:
        """KV bytes vLLM reserves for one sequence of ``tokens``, padding included."""
        return self.request_blocks(tokens, per_gpu) * self.block_bytes(per_gpu)

    def state_bytes(self, per_gpu: bool) -> int:
        """Constant recurrent state of one sequence (Mamba / linear attention)."""
        state = self.shape.state
        if state is None:
            return 0
        layers, elements = self.shape.state_layers, state.elements_per_layer
        if per_gpu:
            layers = max(stage.state for stage in self.stages)
            elements = ceil_div(elements, self.tp)
        return math.ceil(layers * elements * self.state_dtype_bytes)

    def _stage(self, per_gpu: bool) -> PipelineStage:
        if not per_gpu:
            return PipelineStage(
                self.shape.full_layers + self.speculative_layers, self.shape.sliding_layers, 0
            )
        return max(self.stages, key=lambda s: s.full + s.sliding)

    def _elements(self, per_gpu: bool) -> int:
        return self._gpu_elements() if per_gpu else self.shape.attention.elements_per_token(1)

    def _gpu_elements(self) -> int:
        return self.shape.attention.elements_per_token(self.tp)


def _group_size(stage: PipelineStage) -> int:
    """Layers per KV cache group, as vLLM's ``_get_kv_cache_groups_uniform_page_size``.

    One kind of layer: one group. Two kinds: the smaller count (Gemma 3's 5:1 gives
    groups of the one full layer's size), or the larger when the two are within
    1.5x of each other (fewer padding layers).
    """
    counts = [n for n in (stage.full, stage.sliding) if n]
    if not counts:
        return 0
    low, high = min(counts), max(counts)
    return high if high < low * 1.5 else low


@dataclass(frozen=True)
class Budget:
    """The answer of ``kvguard budget``: per-GPU memory lines and what they allow."""

    model: ModelShape
    inputs: BudgetInputs
    kv_cache_dtype: str
    max_model_len: int
    gpu_memory_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_token_per_gpu: int
    kv_bytes_per_sequence: int
    kv_bytes_per_sequence_per_gpu: int
    state_bytes_per_sequence_per_gpu: int
    weights_bytes: int
    weights_source: str
    weights_bytes_per_gpu: int
    activation_bytes_per_gpu: int
    overhead_bytes_per_gpu: int
    memory_limit_bytes_per_gpu: int
    kv_pool_bytes_per_gpu: int
    unallocated_bytes_per_gpu: int
    kv_capacity_blocks: int
    kv_capacity_tokens: int
    worst_case_kv_bytes_per_gpu: int
    worst_case_state_bytes_per_gpu: int
    max_concurrency: int
    max_model_len_at_concurrency: int
    max_model_len_cap: int
    headroom_bytes_per_gpu: int
    assumptions: tuple[str, ...] = field(default=())
    max_concurrency_ratio: float = 0.0
    max_num_batched_tokens: int = 0
    max_num_seqs: int = 0
    engine_rule: str = ""
    sources: Mapping[str, str] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        """Whether the requested concurrency of full-length sequences fits in memory."""
        return self.headroom_bytes_per_gpu >= 0


def compute_budget(
    shape: ModelShape,
    inputs: BudgetInputs,
    *,
    weights_bytes: int,
    weights_source: str,
    notes: tuple[str, ...] = (),
    given_as: str = "given",
    given_sources: Mapping[str, str] | None = None,
) -> Budget:
    """Compute the budget of ``shape`` served with ``inputs`` and ``weights_bytes`` of weights.

    ``given_as`` is how :attr:`Budget.sources` names a figure the inputs fixed
    (``"given"``, or ``"measured (vLLM log)"`` for a calibrated budget);
    ``given_sources`` names one such figure otherwise (``activation``, ``overhead``,
    ``gpu_memory``), where the caller knows better (derived, not measured).
    """
    assumptions = [*notes, *_shape_assumptions(shape)]
    rule = vllm_rule(inputs.engine_version)
    kv_dtype = shape.dtype if inputs.kv_cache_dtype == "auto" else inputs.kv_cache_dtype
    check_parallel_layout(shape, inputs.tp, inputs.pp)
    max_len = _max_model_len(inputs, shape)
    gpus = inputs.tp * inputs.pp
    sources = {"weights": weights_source, "engine": rule.label}
    total, sources["gpu_memory"] = _gpu_memory(inputs)
    if inputs.gpu_memory_bytes is None:
        assumptions.append("no GPU memory given: memory figures assume 80 GiB per GPU")
    batch = batch_defaults(
        rule,
        gpu_memory_bytes=total,
        gpu_name=inputs.gpu_name,
        max_model_len=max_len,
        max_num_batched_tokens=inputs.max_num_batched_tokens,
        max_num_seqs=inputs.max_num_seqs,
    )
    sources["batch"] = batch.source
    weights_gpu = ceil_div(weights_bytes, gpus)
    if inputs.kv_cache_memory_bytes is not None:
        # Like vLLM's --kv-cache-memory-bytes: the pool is fixed and the utilization
        # fraction no longer applies, so the whole GPU is the limit.
        limit = total
        sources["kv_pool"] = "given (--kv-cache-memory-bytes)"
    else:
        limit = math.floor(total * Fraction(str(inputs.utilization)))
        sources["kv_pool"] = "memory x utilization - weights - activation - overhead"

    sized = partial(
        _size_for,
        shape=shape,
        inputs=inputs,
        rule=rule,
        kv_dtype=kv_dtype,
        weights_gpu=weights_gpu,
        limit=limit,
        given_as=given_as,
    )
    chosen = sized(batch)
    kv, activation, overhead, pool = chosen.kv, chosen.activation, chosen.overhead, chosen.pool
    sources |= {
        "activation": chosen.activation_source,
        "overhead": chosen.overhead_source,
        **_named_otherwise(inputs, given_sources),
    }
    non_kv = weights_gpu + activation + overhead
    by_batch = {(batch.max_num_batched_tokens, batch.max_num_seqs): chosen}

    def sized_at(tokens: int) -> _Sized:
        """The budget's parts at a context of ``tokens``: vLLM's batch defaults follow it."""
        limits = batch_defaults(
            rule,
            gpu_memory_bytes=total,
            gpu_name=inputs.gpu_name,
            max_model_len=max(tokens, 1),
            max_num_batched_tokens=inputs.max_num_batched_tokens,
            max_num_seqs=inputs.max_num_seqs,
        )
        key = (limits.max_num_batched_tokens, limits.max_num_seqs)
        if key not in by_batch:
            by_batch[key] = sized(limits)
        return by_batch[key]

    unallocated = limit - non_kv - pool  # < 0: the lines overcommit the GPU

    seq_gpu = kv.sequence_bytes(max_len, per_gpu=True)
    state_gpu = kv.state_bytes(per_gpu=True)
    worst_kv = inputs.concurrency * seq_gpu
    worst_state = inputs.concurrency * state_gpu
    kv_spare = pool - worst_kv - worst_state
    # When the lines overcommit the GPU, the shortfall is that, plus whatever the
    # worst case lacks in the pool (a fixed pool cannot shrink to absorb it).
    headroom = kv_spare if unallocated >= 0 else unallocated - max(0, -kv_spare)

    block_bytes = kv.block_bytes(per_gpu=True)
    blocks = pool // block_bytes if block_bytes else 0
    per_request = kv.request_blocks(max_len, per_gpu=True)
    ratio = blocks / per_request if per_request else 0.0
    if state_gpu:
        max_concurrency = pool // (seq_gpu + state_gpu)
    else:
        max_concurrency = blocks // per_request if per_request else 0
    # vLLM reports a sliding-window model's capacity as the tokens of the whole
    # requests it can hold ("GPU KV cache size"), not blocks x block size.
    tokens = blocks * inputs.block_size if not shape.sliding_layers else int(ratio * max_len)
    cap = shape.context_limit or max_len
    return Budget(
        model=shape,
        inputs=inputs,
        kv_cache_dtype=kv_dtype,
        max_model_len=max_len,
        gpu_memory_bytes=total,
        kv_bytes_per_token=kv.bytes_per_token,
        kv_bytes_per_token_per_gpu=kv.bytes_per_token_per_gpu,
        kv_bytes_per_sequence=kv.sequence_bytes(max_len, per_gpu=False),
        kv_bytes_per_sequence_per_gpu=seq_gpu,
        state_bytes_per_sequence_per_gpu=state_gpu,
        weights_bytes=weights_bytes,
        weights_source=weights_source,
        weights_bytes_per_gpu=weights_gpu,
        activation_bytes_per_gpu=activation,
        overhead_bytes_per_gpu=overhead,
        memory_limit_bytes_per_gpu=limit,
        kv_pool_bytes_per_gpu=pool,
        unallocated_bytes_per_gpu=unallocated,
        kv_capacity_blocks=blocks,
        kv_capacity_tokens=tokens,
        worst_case_kv_bytes_per_gpu=worst_kv,
        worst_case_state_bytes_per_gpu=worst_state,
        max_concurrency=max_concurrency,
        max_model_len_at_concurrency=_longest_fitting(
            sized_at,
            inputs.concurrency,
            cap,
            breaks=(V0_CHUNKED_FROM,)
            if rule.engine == "v0" and inputs.max_num_batched_tokens is None
            else (),
        ),
        max_model_len_cap=cap,
        headroom_bytes_per_gpu=headroom,
        assumptions=tuple(assumptions),
        max_concurrency_ratio=ratio,
        max_num_batched_tokens=batch.max_num_batched_tokens,
        max_num_seqs=batch.max_num_seqs,
        engine_rule=rule.label,
        sources=sources,
    )


def _named_otherwise(inputs: BudgetInputs, given: Mapping[str, str] | None) -> dict[str, str]:
    """The sources ``given`` names for figures the inputs fixed (others are estimated)."""
    fixed = {
        "activation": inputs.activation_bytes,
        "overhead": inputs.overhead_bytes,
        "gpu_memory": inputs.gpu_memory_bytes,
    }
    return {k: v for k, v in (given or {}).items() if fixed.get(k) is not None}


def _gpu_memory(inputs: BudgetInputs) -> tuple[int, str]:
    """Memory per GPU and where the figure came from."""
    if inputs.gpu_memory_bytes is None:
        return DEFAULT_GPU_MEMORY_BYTES, "default 80 GiB (no GPU given)"
    if inputs.gpu_name:
        return inputs.gpu_memory_bytes, f"{inputs.gpu_name} preset (the total torch reports)"
    return inputs.gpu_memory_bytes, "given"


def _overhead(inputs: BudgetInputs, rule: VllmRule, kv: KvFootprint) -> tuple[int, str]:
    """Memory outside weights, activations and the pool, and what it is made of."""
    if inputs.overhead_bytes is not None:
        return inputs.overhead_bytes, "given"
    pcie = inputs.tp > 1 and gpu_without_nvlink(inputs.gpu_name)
    non_torch = non_torch_bytes(rule, inputs.tp, nvlink=not pcie)
    layers_gpu = max(stage.full + stage.sliding + stage.state for stage in kv.stages)
    moe = kv.shape.mlp.experts > 1
    graphs = cuda_graph_bytes(rule, layers_gpu, moe, inputs.enforce_eager)
    gpus = inputs.tp * inputs.pp
    source = f"non-torch memory {_gib(non_torch)} ({rule.engine.upper()}, {gpus} GPU" + (
        "s" if gpus > 1 else ""
    )
    source += ", no NVLink: tensor parallelism over PCIe)" if pcie else ")"
    if graphs:
        source += f" + CUDA graphs {_gib(graphs)} (estimated, vLLM 0.21+)"
    return non_torch + graphs, source


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def _shape_assumptions(shape: ModelShape) -> list[str]:
    """What the figures assume about the model beyond its config's explicit fields."""
    notes = []
    if not shape.dtype_stated:
        notes.append("config names no torch_dtype: model dtype taken as bf16")
    if shape.checkpoint_dtype != shape.dtype:
        notes.append(
            f"checkpoint is {shape.checkpoint_dtype}: served in {shape.dtype}, as vLLM's"
            " --dtype auto does"
        )
    notes.extend(
        f"config omits '{name}': used the {shape.model_type} default {value!r}"
        for name, value in shape.defaulted_fields
    )
    if shape.state is not None:
        notes.append(
            f"{shape.state_layers} {shape.state.kind} layers keep a constant per-sequence state"
            f" in the model dtype ({shape.dtype}), not in the KV dtype"
        )
    return notes


def _max_model_len(inputs: BudgetInputs, shape: ModelShape) -> int:
    model_limit = shape.context_limit
    max_len = inputs.max_model_len or model_limit
    if max_len is None:
        raise InvalidInputError(
            "max_model_len", None, "the config has no max_position_embeddings: pass it explicitly"
        )
    if model_limit is not None and max_len > model_limit:
        # vLLM refuses this too (unless told to allow it): positions past the
        # model's limit were never trained.
        why = shape.context_limit_source
        raise InvalidInputError(
            "max_model_len",
            max_len,
            f"must be <= the model's context limit ({model_limit:,}: {why}); vLLM serves"
            " longer only with a rope scaling such as YaRN in the config (kvguard budget"
            " --hf-overrides adds one, as vLLM's flag does)",
        )
    return max_len


def check_parallel_layout(shape: ModelShape, tp: int, pp: int) -> None:
    """Refuse layouts the engines refuse: TP must split heads evenly, PP needs a layer per stage."""
    att = shape.attention
    if att.num_heads % tp:
        raise InvalidInputError(
            "tp", tp, f"must divide num_attention_heads ({att.num_heads}) evenly"
        )
    if att.kind == "mha" and att.kv_heads % tp and tp % att.kv_heads:
        raise InvalidInputError(
            "tp",
            tp,
            f"must divide num_key_value_heads ({att.kv_heads}) or be a multiple of it",
        )
    if pp > shape.num_layers:
        raise InvalidInputError("pp", pp, f"must be <= the number of layers ({shape.num_layers})")


@dataclass(frozen=True)
class _Sized:
    """The parts of a budget that follow the engine's batch limits."""

    kv: KvFootprint
    activation: int
    activation_source: str
    overhead: int
    overhead_source: str
    pool: int


def _size_for(
    limits: BatchLimits,
    *,
    shape: ModelShape,
    inputs: BudgetInputs,
    rule: VllmRule,
    kv_dtype: str,
    weights_gpu: int,
    limit: int,
    given_as: str,
) -> _Sized:
    """The KV footprint, activation, overhead and pool under the batch ``limits``."""
    kv = KvFootprint(
        shape,
        dtype_bytes(kv_dtype),
        DTYPE_BYTES[shape.dtype],
        inputs.tp,
        inputs.pp,
        inputs.block_size,
        sliding_reserve_tokens=(
            rule.in_flight_batches * limits.max_num_batched_tokens if rule.engine == "v1" else None
        ),
        speculative_layers=inputs.speculative_layers,
    )
    activation, activation_source = inputs.activation_bytes, given_as
    if activation is None:
        activation, activation_source = estimate_activation_bytes(
            shape, inputs.tp, limits, rule, inputs.sampler
        )
    overhead, overhead_source = _overhead(inputs, rule, kv)
    if inputs.overhead_bytes is not None:
        overhead_source = given_as
    pool = inputs.kv_cache_memory_bytes
    if pool is None:
        pool = max(0, limit - (weights_gpu + activation + overhead))
    return _Sized(kv, activation, activation_source, overhead, overhead_source, pool)


def _longest_fitting(
    sized_at: Callable[[int], _Sized], concurrency: int, cap: int, breaks: tuple[int, ...] = ()
) -> int:
    """Longest context (<= cap) that ``concurrency`` sequences can all hold at once.

    ``sized_at`` gives the footprint and pool at a context length: vLLM's default
    batch limits follow ``max_model_len``, and with them the activation peak (so the
    pool) and a sliding window's reserve. Between the ``breaks`` (the lengths after
    which the default batch shrinks: V0's chunked prefill) longer contexts need more
    per sequence and leave no larger a pool, so within each span what fits is a
    prefix; the answer is the longest over the spans.
    """

    def fits(tokens: int) -> bool:
        at = sized_at(tokens)
        per_seq = at.kv.sequence_bytes(tokens, per_gpu=True) + at.kv.state_bytes(per_gpu=True)
        return concurrency * per_seq <= at.pool

    longest = 0
    starts = (0, *(b + 1 for b in breaks if b < cap))
    ends = (*(b for b in breaks if b < cap), cap)
    for start, end in zip(starts, ends, strict=True):
        if not fits(start):
            continue
        low, high = start, end  # invariant: fits(low)
        while low < high:
            mid = (low + high + 1) // 2
            if fits(mid):
                low = mid
            else:
                high = mid - 1
        longest = max(longest, low)
    return longest


def estimate_activation_bytes(
    shape: ModelShape, tp: int, batch: BatchLimits, rule: VllmRule, sampler: str | None = None
) -> tuple[int, str]:
    """Peak activation memory per GPU of vLLM's profile run, and what sized it.

    V1's forward pass keeps, per batched token, about four hidden-size vectors
    (residual, normed input, attention and MLP outputs), the Q/K/V projections and
    the MLP's gate, up and activated intermediate (split by TP) in the model dtype:
    1.1 GiB for Llama-3.1-8B at 8,192 tokens, as vLLM 0.19 measured on a pipeline
    stage without the sampler. It then runs the sampler over ``max_num_seqs`` rows
    of the whole vocabulary (every GPU holds the gathered logits), which on today's
    large vocabularies is the peak. V0's profiles of Llama-3-8B at 8,192 and 20,000
    tokens fit a slimmer slope (residual, hidden, gate and up) over about 0.5 GiB of
    fixed buffers, and it kept one fp32 copy of the logits. ``sampler`` is V1's
    top-k/top-p path where known (:func:`~kvguard.core.engine_rules.sampler_bytes_per_logit`).
    """
    dtype = DTYPE_BYTES[shape.dtype]
    tokens = f"{batch.max_num_batched_tokens:,} batched tokens"
    if rule.engine == "v0":
        per_token = 2 * shape.hidden_size + ceil_div(2 * shape.mlp.active_intermediate, tp)
        forward = math.ceil(batch.max_num_batched_tokens * per_token * dtype)
        logits = batch.max_num_seqs * shape.vocab_size * SAMPLER_LOGIT_BYTES
        return (
            forward + V0_FIXED_ACTIVATION_BYTES + logits,
            f"estimated: V0 profile, forward pass of {tokens}",
        )
    per_token = (
        4 * shape.hidden_size
        + ceil_div(3 * shape.attention.q_width, tp)
        + ceil_div(3 * shape.mlp.active_intermediate, tp)
    )
    forward = math.ceil(batch.max_num_batched_tokens * per_token * dtype)
    logits = batch.max_num_seqs * shape.vocab_size * sampler_bytes_per_logit(rule, sampler)
    if logits >= forward:
        return logits, (
            f"estimated: V1 profile, sampler over {batch.max_num_seqs:,} sequences"
            f" x {shape.vocab_size:,} vocabulary, {sampler_kind(rule, sampler)}"
        )
    return forward, f"estimated: V1 profile, forward pass of {tokens}"


@dataclass(frozen=True)
class BudgetReport:
    """A budget and the same budget with an fp8 KV cache, for comparison."""

    budget: Budget
    fp8: Budget


def plan_budget(
    raw_config: Mapping[str, object],
    inputs: BudgetInputs,
    *,
    index_total_size: int | None = None,
    source: str = "config.json",
    notes: tuple[str, ...] = (),
    given_as: str = "given",
    given_sources: Mapping[str, str] | None = None,
) -> BudgetReport:
    """Budget a model from its parsed config, choosing the best weight figure at hand.

    Weights come from ``inputs.weights_bytes`` when given, else the weight index's
    ``total_size``, else an estimate from the config's shapes. ``notes`` join the
    budget's assumptions (what the caller derived, e.g. a drafter's layers);
    ``given_as`` and ``given_sources`` name the figures the inputs fix, as in
    :func:`compute_budget` (``given_sources["weights"]`` the given weights).
    """
    cfg = ConfigFields(raw_config, source)
    shape = parse_fields(cfg)
    extra: tuple[str, ...] = ()
    # vLLM pads MXFP4 experts on load, by the kernel the version and GPU imply.
    capability = gpu_compute_capability(inputs.gpu_name)
    if inputs.weights_bytes is not None:
        weights = inputs.weights_bytes
        origin = "given (--weights-bytes)" if given_as == "given" else given_as
        if given_sources and "weights" in given_sources:
            origin = given_sources["weights"]
    elif index_total_size is not None:
        weights, origin = index_total_size, "model.safetensors.index.json (exact)"
        stored, served = DTYPE_BYTES[shape.checkpoint_dtype], DTYPE_BYTES[shape.dtype]
        if stored != served:
            weights = math.ceil(weights * served / stored)
            origin = (
                "model.safetensors.index.json, scaled from"
                f" {shape.checkpoint_dtype} to {shape.dtype}"
            )
        mx = mxfp4_experts(cfg, shape, inputs.engine_version, capability, inputs.tp)
        if mx is not None:
            # The index sizes the checkpoint's expert tensors; loading pads them.
            weights += mx.padding_bytes
            origin = (
                f"{origin.removesuffix(' (exact)')}, plus the padding of MXFP4 experts"
                f" in {mx.kernel_text} (estimated)"
            )
            extra = (mx.note,)
    else:
        estimate = estimate_weights(
            cfg,
            shape,
            engine_version=inputs.engine_version,
            compute_capability=capability,
            tp=inputs.tp,
        )
        origin = "estimated from config shapes"
        mx = mxfp4_experts(cfg, shape, inputs.engine_version, capability, inputs.tp)
        if mx is not None:
            origin += f", MXFP4 experts padded for {mx.kernel_text}"
        weights, extra = estimate.total_bytes, estimate.notes
    budget = compute_budget(
        shape,
        inputs,
        weights_bytes=weights,
        weights_source=origin,
        notes=(*notes, *extra),
        given_as=given_as,
        given_sources=given_sources,
    )
    fp8 = compute_budget(
        shape,
        replace(inputs, kv_cache_dtype="fp8"),
        weights_bytes=weights,
        weights_source=origin,
        given_as=given_as,
        given_sources=given_sources,
    )
    return BudgetReport(budget, fp8)
