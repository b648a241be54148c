"""The VRAM budget: weights, worst-case KV cache, activations, overhead, headroom.

Everything here is arithmetic on a :class:`~kvguard.core.architecture.ModelShape`
and the serving parameters in :class:`BudgetInputs`; docs/budget.md states each
formula and default. All byte figures are integers; "per GPU" means one GPU of a
tensor-/pipeline-parallel replica.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from fractions import Fraction

from kvguard.core.architecture import ConfigFields, ModelShape, parse_fields
from kvguard.core.units import DTYPE_BYTES, GiB, MiB, dtype_bytes
from kvguard.core.weights import estimate_weights
from kvguard.errors import InvalidInputError

DEFAULT_GPU_MEMORY_BYTES = 80 * GiB
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_BLOCK_SIZE = 16
# Outside the KV pool and the activation peak an engine still holds its CUDA
# context (~0.5 GiB) and captured CUDA graphs (~0.5 GiB for a mid-size model);
# with tensor or pipeline parallelism NCCL adds communication buffers.
CUDA_CONTEXT_BYTES = 512 * MiB
CUDA_GRAPH_BYTES = 512 * MiB
NCCL_BUFFER_BYTES = 256 * MiB
SAMPLER_LOGIT_BYTES = 4  # fp32 logits per vocabulary entry per sequence


@dataclass(frozen=True)
class BudgetInputs:
    """Serving parameters, named after the engine flags they mirror.

    ``None`` means "derive it": ``max_model_len`` from the model's
    ``max_position_embeddings``, ``gpu_memory_bytes`` from the 80 GiB default,
    ``weights_bytes`` from the weight index or the config, ``activation_bytes`` and
    ``overhead_bytes`` from the documented estimates. ``kv_cache_memory_bytes``
    fixes the per-GPU KV pool instead of deriving it from memory x utilization.
    """

    tp: int = 1
    pp: int = 1
    max_model_len: int | None = None
    concurrency: int = 1
    kv_cache_dtype: str = "auto"
    gpu_memory_bytes: int | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    block_size: int = DEFAULT_BLOCK_SIZE
    weights_bytes: int | None = None
    kv_cache_memory_bytes: int | None = None
    activation_bytes: int | None = None
    overhead_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "concurrency", "max_num_seqs", "block_size"):
            _check_int(name, getattr(self, name), 1, MAX_COUNT)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, MAX_TOKENS)
        _check_int("max_model_len", self.max_model_len, 1, MAX_TOKENS, optional=True)
        _check_int("gpu_memory_bytes", self.gpu_memory_bytes, 1, MAX_BYTES, optional=True)
        _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1, MAX_BYTES, optional=True)
        for name in ("weights_bytes", "activation_bytes", "overhead_bytes"):
            _check_int(name, getattr(self, name), 0, MAX_BYTES, optional=True)
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise InvalidInputError("gpu_memory_utilization", util, "must be a fraction in (0, 1]")
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
    """Cache bytes of one shape at one KV dtype and parallel layout.

    Per-GPU figures are those of the fullest pipeline stage, the one that runs
    out first.
    """

    shape: ModelShape
    kv_dtype_bytes: Fraction
    state_dtype_bytes: Fraction
    tp: int
    pp: int
    block_size: int

    @property
    def stages(self) -> tuple[PipelineStage, ...]:
        """The pipeline stages' layer counts."""
        return pipeline_stages(self.shape, self.pp)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes per token, whole model, one replica, every attention layer."""
        elements = self.shape.attention.elements_per_token(1) * self.shape.attention_layers
        return math.ceil(elements * self.kv_dtype_bytes)

    @property
    def bytes_per_token_per_gpu(self) -> int:
        """KV bytes per token on one GPU (heads split by TP, layers by PP)."""
        layers = max(stage.full + stage.sliding for stage in self.stages)
        return math.ceil(self._gpu_elements() * layers * self.kv_dtype_bytes)

    def sequence_bytes(self, tokens: int, per_gpu: bool) -> int:
        """KV bytes of one sequence of ``tokens``: windows applied, block-rounded."""
        whole = PipelineStage(self.shape.full_layers, self.shape.sliding_layers, 0)
        stages = self.stages if per_gpu else (whole,)
        elements = self._gpu_elements() if per_gpu else self.shape.attention.elements_per_token(1)
        full_tokens = self._blocked(tokens)
        window_tokens = self._blocked(min(tokens, self.shape.sliding_window or 0))
        held = max(s.full * full_tokens + s.sliding * window_tokens for s in stages)
        return math.ceil(elements * held * self.kv_dtype_bytes)

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

    def _blocked(self, tokens: int) -> int:
        return ceil_div(tokens, self.block_size) * self.block_size

    def _gpu_elements(self) -> int:
        return self.shape.attention.elements_per_token(self.tp)


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
) -> Budget:
    """Compute the budget of ``shape`` served with ``inputs`` and ``weights_bytes`` of weights."""
    assumptions = [*notes, *_shape_assumptions(shape)]
    kv_dtype = shape.dtype if inputs.kv_cache_dtype == "auto" else inputs.kv_cache_dtype
    kv = KvFootprint(
        shape,
        dtype_bytes(kv_dtype),
        DTYPE_BYTES[shape.dtype],
        inputs.tp,
        inputs.pp,
        inputs.block_size,
    )
    check_parallel_layout(shape, inputs.tp, inputs.pp)
    model_limit = shape.max_position_embeddings
    max_len = _max_model_len(inputs, model_limit)
    gpus = inputs.tp * inputs.pp
    total = inputs.gpu_memory_bytes
    if total is None:
        total = DEFAULT_GPU_MEMORY_BYTES
        assumptions.append("no GPU memory given: memory figures assume 80 GiB per GPU")

    weights_gpu = ceil_div(weights_bytes, gpus)
    activation = inputs.activation_bytes
    if activation is None:
        activation = estimate_activation_bytes(shape, inputs)
    overhead = inputs.overhead_bytes
    if overhead is None:
        overhead = CUDA_CONTEXT_BYTES + CUDA_GRAPH_BYTES + (NCCL_BUFFER_BYTES if gpus > 1 else 0)
    non_kv = weights_gpu + activation + overhead

    if inputs.kv_cache_memory_bytes is not None:
        # Like vLLM's --kv-cache-memory-bytes: the pool is fixed and the utilization
        # fraction no longer applies, so the whole GPU is the limit.
        limit = total
        pool = inputs.kv_cache_memory_bytes
    else:
        limit = math.floor(total * Fraction(str(inputs.gpu_memory_utilization)))
        pool = max(0, limit - non_kv)
    unallocated = limit - non_kv - pool  # < 0: the lines overcommit the GPU

    seq_gpu = kv.sequence_bytes(max_len, per_gpu=True)
    state_gpu = kv.state_bytes(per_gpu=True)
    worst_kv = inputs.concurrency * seq_gpu
    worst_state = inputs.concurrency * state_gpu
    kv_spare = pool - worst_kv - worst_state
    # When the lines overcommit the GPU, the shortfall is that, plus whatever the
    # worst case lacks in the pool (a fixed pool cannot shrink to absorb it).
    headroom = kv_spare if unallocated >= 0 else unallocated - max(0, -kv_spare)

    per_token_gpu = kv.bytes_per_token_per_gpu
    blocks = pool // (inputs.block_size * per_token_gpu) if per_token_gpu else 0
    cap = model_limit or max_len
    return Budget(
        model=shape,
        inputs=inputs,
        kv_cache_dtype=kv_dtype,
        max_model_len=max_len,
        gpu_memory_bytes=total,
        kv_bytes_per_token=kv.bytes_per_token,
        kv_bytes_per_token_per_gpu=per_token_gpu,
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
        kv_capacity_tokens=blocks * inputs.block_size,
        worst_case_kv_bytes_per_gpu=worst_kv,
        worst_case_state_bytes_per_gpu=worst_state,
        max_concurrency=pool // (seq_gpu + state_gpu) if seq_gpu + state_gpu else 0,
        max_model_len_at_concurrency=_longest_fitting(kv, pool, inputs.concurrency, cap),
        max_model_len_cap=cap,
        headroom_bytes_per_gpu=headroom,
        assumptions=tuple(assumptions),
    )


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


def _max_model_len(inputs: BudgetInputs, model_limit: int | None) -> int:
    max_len = inputs.max_model_len or model_limit
    if max_len is None:
        raise InvalidInputError(
            "max_model_len", None, "the config has no max_position_embeddings: pass it explicitly"
        )
    if model_limit is not None and max_len > model_limit:
        # vLLM refuses this too (unless told to allow it): positions past the
        # model's limit were never trained.
        raise InvalidInputError(
            "max_model_len",
            max_len,
            f"must be <= the model's max_position_embeddings ({model_limit:,})",
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


def _longest_fitting(kv: KvFootprint, pool: int, concurrency: int, cap: int) -> int:
    """Longest context (<= cap) that ``concurrency`` sequences can all hold at once."""

    def fits(tokens: int) -> bool:
        per_seq = kv.sequence_bytes(tokens, per_gpu=True) + kv.state_bytes(per_gpu=True)
        return concurrency * per_seq <= pool

    if not fits(0):
        return 0
    low, high = 0, cap  # invariant: fits(low); sequence bytes only grow with tokens
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def estimate_activation_bytes(shape: ModelShape, inputs: BudgetInputs) -> int:
    """Peak activation memory per GPU of one forward pass, plus sampler logits.

    A step of ``max_num_batched_tokens`` tokens keeps, per token, about four
    hidden-size vectors (residual, normed input, attention and MLP outputs), the
    Q/K/V projections (three head-width vectors, split by TP) and the MLP's
    gate, up and activated intermediate (three intermediate-width vectors, split
    by TP), in the model dtype. The sampler then holds fp32 logits for up to
    ``max_num_seqs`` sequences over the whole vocabulary.
    """
    per_token = (
        4 * shape.hidden_size
        + ceil_div(3 * shape.attention.q_width, inputs.tp)
        + ceil_div(3 * shape.mlp.active_intermediate, inputs.tp)
    )
    act = math.ceil(inputs.max_num_batched_tokens * per_token * DTYPE_BYTES[shape.dtype])
    return act + inputs.max_num_seqs * shape.vocab_size * SAMPLER_LOGIT_BYTES


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
) -> BudgetReport:
    """Budget a model from its parsed config, choosing the best weight figure at hand.

    Weights come from ``inputs.weights_bytes`` when given, else the weight index's
    ``total_size``, else an estimate from the config's shapes.
    """
    cfg = ConfigFields(raw_config, source)
    shape = parse_fields(cfg)
    notes: tuple[str, ...] = ()
    if inputs.weights_bytes is not None:
        weights, origin = inputs.weights_bytes, "given (--weights-bytes)"
    elif index_total_size is not None:
        weights, origin = index_total_size, "model.safetensors.index.json (exact)"
        stored, served = DTYPE_BYTES[shape.checkpoint_dtype], DTYPE_BYTES[shape.dtype]
        if stored != served:
            weights = math.ceil(weights * served / stored)
            origin = (
                "model.safetensors.index.json, scaled from"
                f" {shape.checkpoint_dtype} to {shape.dtype}"
            )
    else:
        estimate = estimate_weights(cfg, shape)
        weights, origin, notes = (
            estimate.total_bytes,
            "estimated from config shapes",
            estimate.notes,
        )
    budget = compute_budget(
        shape, inputs, weights_bytes=weights, weights_source=origin, notes=notes
    )
    fp8 = compute_budget(
        shape, replace(inputs, kv_cache_dtype="fp8"), weights_bytes=weights, weights_source=origin
    )
    return BudgetReport(budget, fp8)
