"""What a model's Hugging Face ``config.json`` says about its memory shape.

:func:`parse_model_config` turns the JSON object (already loaded; this module does
no I/O) into a :class:`ModelShape`: how many layers hold a KV cache and of what
width, which of them only keep a sliding window, which hold a constant recurrent
state instead (Mamba, linear attention), and the sizes the weight and activation
estimates need. An architecture it cannot budget is a :class:`ModelConfigError`
naming the missing field, never a guess.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from kvguard.errors import ModelConfigError

LayerKind = Literal["full", "sliding", "state"]

# Values of `layer_types` (and Jamba's `layers_block_type`) and what each holds.
_LAYER_TYPE_NAMES: dict[str, LayerKind] = {
    "full_attention": "full",
    "attention": "full",
    "sliding_attention": "sliding",
    "linear_attention": "state",
    "mamba": "state",
}

# Fields that transformers leaves out of config.json when they equal the config
# class's default. Only sizes the budget needs are listed; a default used is
# reported in the budget's assumptions.
_MODEL_TYPE_DEFAULTS: dict[str, dict[str, object]] = {
    "gemma2": {"tie_word_embeddings": True},
    "gemma3_text": {
        "tie_word_embeddings": True,
        "vocab_size": 262_208,
        "max_position_embeddings": 131_072,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
    },
}

_DTYPE_NAMES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
}


class ConfigFields:
    """Typed, error-reporting access to one config object.

    Multimodal configs nest the language model under ``text_config``; its fields
    win, and the top level is the fallback (``torch_dtype`` often lives only there).
    """

    def __init__(self, raw: Mapping[str, object], source: str = "config.json") -> None:
        if not isinstance(raw, Mapping):
            raise ModelConfigError("the config must be a JSON object", source=source)
        self.source = source
        text = raw.get("text_config")
        self.nested = isinstance(text, Mapping)
        self._layers: tuple[Mapping[str, object], ...] = (
            (text, raw) if isinstance(text, Mapping) else (raw,)
        )
        self._defaults = _MODEL_TYPE_DEFAULTS.get(str(self._layers[0].get("model_type")), {})
        self.defaulted: dict[str, object] = {}

    def get(self, name: str) -> object:
        """The field's value, ``None`` when absent (or JSON null).

        An absent field that the model type's config class defaults is taken from
        that default and remembered in :attr:`defaulted`.
        """
        for layer in self._layers:
            if layer.get(name) is not None:
                return layer[name]
        if name in self._defaults:
            self.defaulted[name] = self._defaults[name]
            return self._defaults[name]
        return None

    def has(self, name: str) -> bool:
        """Whether the field is present and not null."""
        return self.get(name) is not None

    def opt_int(self, name: str, minimum: int | None = None) -> int | None:
        """An integer field, ``None`` when absent; an error when not an integer >= ``minimum``."""
        value = self.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelConfigError(
                f"field '{name}' must be an integer, got {value!r}", source=self.source, field=name
            )
        if minimum is not None and value < minimum:
            raise ModelConfigError(
                f"field '{name}' must be >= {minimum}, got {value}", source=self.source, field=name
            )
        return value

    def int(self, name: str, why: str, minimum: int = 1) -> int:
        """A required integer field >= ``minimum``; the error says what needed it."""
        value = self.opt_int(name, minimum)
        if value is None:
            raise ModelConfigError(
                f"missing field '{name}' (needed for {why})", source=self.source, field=name
            )
        return value

    def flag(self, name: str) -> bool | None:
        """A boolean field, ``None`` when absent."""
        value = self.get(name)
        if value is None:
            return None
        if not isinstance(value, bool):
            raise ModelConfigError(
                f"field '{name}' must be true or false, got {value!r}",
                source=self.source,
                field=name,
            )
        return value

    def error(self, message: str, field: str = "") -> ModelConfigError:
        """A :class:`ModelConfigError` about this config."""
        return ModelConfigError(message, source=self.source, field=field)


@dataclass(frozen=True)
class AttentionShape:
    """Width of one attention layer's cache entry for one token.

    ``mha`` covers multi-head and grouped-query attention: K and V, ``kv_heads``
    heads of ``head_dim`` each. ``mla`` (DeepSeek-V2/V3) caches one compressed latent
    of ``latent_dim`` values per token, shared by all heads, so tensor parallelism
    replicates it instead of splitting it.
    """

    kind: Literal["mha", "mla"]
    num_heads: int
    kv_heads: int
    head_dim: int
    latent_dim: int = 0
    q_width: int = 0  # query projection width: sizes the activation estimate

    def elements_per_token(self, tp: int = 1) -> int:
        """Cached values per token per layer on one GPU at tensor-parallel size ``tp``."""
        if self.kind == "mla":
            return self.latent_dim
        # vLLM replicates KV heads when tp exceeds them, so a GPU always holds one.
        return 2 * max(1, self.kv_heads // tp) * self.head_dim


@dataclass(frozen=True)
class StateShape:
    """Constant per-sequence state of a Mamba or linear-attention layer, in elements."""

    kind: Literal["mamba", "linear_attention"]
    elements_per_layer: int


@dataclass(frozen=True)
class MlpShape:
    """MLP sizes: dense, or mixture-of-experts on the layers ``moe_layers`` marks."""

    dense_intermediate: int
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    moe_layers: tuple[bool, ...] = ()

    @property
    def active_intermediate(self) -> int:
        """Widest intermediate activation one token passes through in any layer."""
        if not self.experts:
            return self.dense_intermediate
        moe = self.experts_per_token * self.expert_intermediate + self.shared_intermediate
        # Some MoE models keep dense MLPs in a few layers (DeepSeek's first three).
        return max(self.dense_intermediate if not all(self.moe_layers) else 0, moe)


@dataclass(frozen=True)
class ModelShape:
    """Everything the budget needs to know about a model, in its own units."""

    name: str
    model_type: str
    layer_kinds: tuple[LayerKind, ...]
    attention: AttentionShape
    sliding_window: int | None
    state: StateShape | None
    mlp: MlpShape
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int | None
    dtype: str
    dtype_stated: bool
    checkpoint_dtype: str
    tie_word_embeddings: bool | None
    defaulted_fields: tuple[tuple[str, object], ...] = ()
    # The longest max_model_len vLLM accepts: max_position_embeddings, or what a rope
    # scaling in the config stretches it to (see context_limit); None: no limit given.
    context_limit: int | None = None
    context_limit_source: str = "max_position_embeddings"

    @property
    def num_layers(self) -> int:
        """All decoder layers."""
        return len(self.layer_kinds)

    @property
    def full_layers(self) -> int:
        """Layers whose cache grows with every token of the sequence."""
        return self.layer_kinds.count("full")

    @property
    def sliding_layers(self) -> int:
        """Layers that keep at most ``sliding_window`` tokens."""
        return self.layer_kinds.count("sliding")

    @property
    def state_layers(self) -> int:
        """Layers with a constant per-sequence state and no KV cache."""
        return self.layer_kinds.count("state")

    @property
    def attention_layers(self) -> int:
        """Layers that cache K/V (or a latent) per token."""
        return self.full_layers + self.sliding_layers


def parse_model_config(raw: Mapping[str, object], source: str = "config.json") -> ModelShape:
    """Build a :class:`ModelShape` from a Hugging Face config object."""
    return parse_fields(ConfigFields(raw, source))


def parse_fields(cfg: ConfigFields) -> ModelShape:
    """Build a :class:`ModelShape` from an already wrapped config."""
    num_layers = cfg.int("num_hidden_layers", "the number of layers")
    hidden = cfg.int("hidden_size", "attention and activation sizes")
    kinds = _layer_kinds(cfg, num_layers)
    if "full" not in kinds and "sliding" not in kinds:
        raise cfg.error(
            "no attention layers: kvguard budgets KV caches, and pure state-space models have none"
        )
    attention = _attention_shape(cfg, hidden)
    window = None
    if "sliding" in kinds:
        window = cfg.int("sliding_window", "layers that use sliding-window attention")
    state = _state_shape(cfg, hidden) if "state" in kinds else None
    dtype_raw = cfg.get("torch_dtype") or cfg.get("dtype")
    stored = _DTYPE_NAMES.get(str(dtype_raw).lower(), "") if dtype_raw is not None else "bf16"
    if not stored:
        raise cfg.error(
            f"field 'torch_dtype' is {dtype_raw!r}; expected one of {', '.join(_DTYPE_NAMES)}",
            "torch_dtype",
        )
    model_type = str(cfg.get("model_type") or "unknown")
    dtype = stored
    if stored == "fp32":
        # vLLM's dtype "auto" serves float32 checkpoints in 16 bits (bf16 for Gemma).
        dtype = "bf16" if model_type.startswith("gemma") else "fp16"
    name = str(cfg.get("_name_or_path") or "")
    limit, limit_source = context_limit(cfg, model_type)
    return ModelShape(
        name=name,
        model_type=model_type,
        layer_kinds=kinds,
        attention=attention,
        sliding_window=window,
        state=state,
        mlp=_mlp_shape(cfg, num_layers),
        hidden_size=hidden,
        vocab_size=cfg.int("vocab_size", "embedding weights and sampler logits"),
        max_position_embeddings=cfg.opt_int("max_position_embeddings", minimum=1),
        dtype=dtype,
        dtype_stated=dtype_raw is not None,
        checkpoint_dtype=stored,
        tie_word_embeddings=cfg.flag("tie_word_embeddings"),
        defaulted_fields=tuple(sorted(cfg.defaulted.items())),
        context_limit=limit,
        context_limit_source=limit_source,
    )


# Rope types whose factor vLLM does not apply to the context limit: their
# max_position_embeddings already is the stretched length (Llama 3.1's "llama3").
_UNSCALED_ROPE = ("su", "longrope", "llama3")


def context_limit(cfg: ConfigFields, model_type: str) -> tuple[int | None, str]:
    """The longest ``max_model_len`` vLLM accepts for the config, and how it follows.

    As vLLM derives it (``_get_and_verify_max_len``): ``max_position_embeddings``,
    times the ``factor`` of a ``rope_scaling`` (or per-layer ``rope_parameters``)
    whose type is not su, longrope or llama3 — from ``original_max_position_embeddings``
    for YaRN — except for Gemma 3, whose limit is already scaled. A YaRN block added
    with ``--hf-overrides`` is how a Qwen3 is served at 131,072 tokens.
    """
    base = cfg.opt_int("max_position_embeddings", minimum=1)
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if base is None or not isinstance(rope, Mapping) or "gemma3" in model_type:
        return base, "max_position_embeddings"
    nested = bool(rope) and all(isinstance(v, Mapping) for v in rope.values())
    factor: float = 1.0
    original: object = None
    scaled = ""  # the rope type whose factor counts
    for params in rope.values() if nested else (rope,):
        kind = str(params.get("rope_type") or params.get("type") or "default")
        if kind in _UNSCALED_ROPE:
            continue
        found = params.get("factor")
        if isinstance(found, (int, float)) and not isinstance(found, bool) and found > 0:
            factor, scaled = float(found), kind
        if kind == "yarn":
            original = params.get("original_max_position_embeddings", original)
    if factor == 1.0:
        return base, "max_position_embeddings"
    if isinstance(original, int) and not isinstance(original, bool) and original > 0:
        return int(original * factor), (
            f"YaRN: original_max_position_embeddings {original:,} x factor {factor:g}"
        )
    return int(base * factor), f"{scaled} rope scaling: max_position_embeddings x factor {factor:g}"


# Layouts public configs describe in ways kvguard does not read yet: refused by name
# rather than budgeted as if every layer held a KV cache (a hybrid's is far smaller).
_UNREAD_LAYOUTS = {
    "hybrid_override_pattern": "Nemotron-H's per-layer pattern (M, *, -, E)",
    "block_types": "RecurrentGemma's block list",
    "attn_type_list": "MiniMax's per-layer attention types",
}
# Fields that only a model with recurrent or linear-attention layers carries: seen
# without a layout that places such layers, the config is a hybrid kvguard misreads.
_STATE_HINTS = (
    "mamba_d_state",
    "ssm_state_size",
    "mamba_d_ssm",
    "linear_num_value_heads",
    "linear_attn_config",
    "conv_L_cache",
)


# Fields that state which layers hold a state: with one of them, its word is final.
_LAYOUT_FIELDS = (
    "layer_types",
    "layers_block_type",
    "attn_layer_period",
    "full_attention_interval",
)


def _layer_kinds(cfg: ConfigFields, n: int) -> tuple[LayerKind, ...]:
    """Which layers are full attention, sliding-window attention, or constant state.

    A layout this function cannot read, or state-space fields with no layout field at
    all, is an error naming the field: never a silent guess.
    """
    for key, what in _UNREAD_LAYOUTS.items():
        if cfg.has(key):
            raise cfg.error(
                f"field '{key}' describes {what}, a layout kvguard cannot budget yet"
                " (it reads layer_types, layers_block_type, attn_layer_period/offset and"
                " full_attention_interval)",
                key,
            )
    kinds = _read_layer_kinds(cfg, n)
    if "state" not in kinds and not any(cfg.has(field) for field in _LAYOUT_FIELDS):
        hint = next((name for name in _STATE_HINTS if cfg.has(name)), None)
        if hint is not None:
            raise cfg.error(
                f"field '{hint}' belongs to recurrent (Mamba / linear-attention) layers, but"
                " no layout field says which layers they are (layer_types,"
                " layers_block_type, attn_layer_period/offset, full_attention_interval):"
                " kvguard will not budget every layer as attention",
                hint,
            )
    return kinds


def _read_layer_kinds(cfg: ConfigFields, n: int) -> tuple[LayerKind, ...]:
    """The layout, by the rules each family writes its config with, in precedence order."""
    for key in ("layer_types", "layers_block_type"):
        listed = cfg.get(key)
        if listed is None:
            continue
        if not isinstance(listed, list) or len(listed) != n:
            raise cfg.error(f"field '{key}' must list one type per layer ({n} layers)", key)
        kinds: list[LayerKind] = []
        for value in listed:
            kind = _LAYER_TYPE_NAMES.get(str(value))
            if kind is None:
                allowed = ", ".join(_LAYER_TYPE_NAMES)
                raise cfg.error(
                    f"field '{key}' has layer type {value!r}, which kvguard cannot budget"
                    f" (known: {allowed})",
                    key,
                )
            kinds.append(kind)
        return tuple(kinds)
    if cfg.has("attn_layer_period"):  # Jamba: one attention layer per period, Mamba elsewhere
        period = cfg.int("attn_layer_period", "Jamba's attention layer layout")
        offset = cfg.int("attn_layer_offset", "Jamba's attention layer layout", minimum=0)
        if offset >= period:
            raise cfg.error(
                f"attn_layer_offset ({offset}) must be < attn_layer_period ({period})",
                "attn_layer_offset",
            )
        return _pattern(n, "full", "state", lambda i: i % period == offset)
    if cfg.has("full_attention_interval"):  # Qwen3-Next: every Nth layer is full attention
        every = cfg.int("full_attention_interval", "Qwen3-Next's layer layout")
        return _pattern(n, "full", "state", lambda i: (i + 1) % every == 0)
    if str(cfg.get("model_type")) == "gemma2":  # alternating, layer 0 sliding
        return _pattern(n, "sliding", "full", lambda i: i % 2 == 0)
    if cfg.has("sliding_window_pattern"):  # Gemma 3: N-1 local layers, then one global
        every = cfg.int("sliding_window_pattern", "Gemma 3's layer layout")
        return _pattern(n, "full", "sliding", lambda i: (i + 1) % every == 0)
    if cfg.get("use_sliding_window") is not None:  # Qwen2: layers from max_window_layers on
        if not cfg.flag("use_sliding_window") or not cfg.has("sliding_window"):
            return _uniform(n, "full")
        first = cfg.int("max_window_layers", "Qwen2-style sliding windows", minimum=0)
        return _pattern(n, "sliding", "full", lambda i: i >= first)
    if cfg.has("sliding_window"):  # Mistral-style: every layer keeps the window
        return _uniform(n, "sliding")
    return _uniform(n, "full")


def _pattern(
    n: int, hit: LayerKind, miss: LayerKind, is_hit: Callable[[int], bool]
) -> tuple[LayerKind, ...]:
    return tuple(hit if is_hit(i) else miss for i in range(n))


def _uniform(n: int, kind: LayerKind) -> tuple[LayerKind, ...]:
    return (kind,) * n


def _attention_shape(cfg: ConfigFields, hidden: int) -> AttentionShape:
    heads = cfg.int("num_attention_heads", "attention heads")
    if cfg.has("kv_lora_rank"):  # multi-head latent attention
        rank = cfg.int("kv_lora_rank", "MLA's compressed KV latent")
        rope = cfg.int("qk_rope_head_dim", "MLA's decoupled RoPE key (cached with the latent)")
        nope = cfg.int("qk_nope_head_dim", "MLA's query width")
        width = heads * (nope + rope)
        return AttentionShape("mla", heads, 0, 0, latent_dim=rank + rope, q_width=width)
    kv_heads = cfg.opt_int("num_key_value_heads", minimum=1) or heads
    head_dim = cfg.opt_int("head_dim", minimum=1)
    if head_dim is None:
        if hidden % heads:
            raise cfg.error(
                f"no 'head_dim' and hidden_size {hidden} is not divisible by"
                f" num_attention_heads {heads}",
                "head_dim",
            )
        head_dim = hidden // heads
    return AttentionShape(
        "mha", heads, kv_heads=kv_heads, head_dim=head_dim, q_width=heads * head_dim
    )


def _state_shape(cfg: ConfigFields, hidden: int) -> StateShape:
    if cfg.has("mamba_d_state"):
        # Mamba: a conv window of (d_conv - 1) inputs and a d_state-wide SSM state,
        # both over the expanded inner width.
        d_inner = cfg.int("mamba_expand", "the Mamba state size") * hidden
        d_conv = cfg.int("mamba_d_conv", "the Mamba state size")
        d_state = cfg.int("mamba_d_state", "the Mamba state size")
        return StateShape("mamba", d_inner * (d_conv - 1) + d_inner * d_state)
    if cfg.has("linear_num_value_heads"):
        # Gated DeltaNet (Qwen3-Next): a conv window over q, k and v plus a
        # key_dim x value_dim recurrent matrix per value head.
        why = "the linear-attention state size"
        k_heads = cfg.int("linear_num_key_heads", why)
        v_heads = cfg.int("linear_num_value_heads", why)
        k_dim = cfg.int("linear_key_head_dim", why)
        v_dim = cfg.int("linear_value_head_dim", why)
        kernel = cfg.int("linear_conv_kernel_dim", why)
        conv = (kernel - 1) * (2 * k_heads * k_dim + v_heads * v_dim)
        return StateShape("linear_attention", conv + v_heads * k_dim * v_dim)
    raise cfg.error(
        "some layers hold a recurrent state, but the config has neither Mamba fields"
        " ('mamba_d_state', 'mamba_d_conv', 'mamba_expand') nor linear-attention fields"
        " ('linear_num_value_heads', ...)",
        "mamba_d_state",
    )


def _mlp_shape(cfg: ConfigFields, n: int) -> MlpShape:
    experts = next(
        (
            v
            for v in (
                cfg.opt_int(k) for k in ("n_routed_experts", "num_local_experts", "num_experts")
            )
            if v
        ),
        0,
    )
    dense = cfg.opt_int("intermediate_size")
    if experts <= 1:
        return MlpShape(dense_intermediate=cfg.int("intermediate_size", "the MLP size"))
    expert_size = cfg.opt_int("moe_intermediate_size") or cfg.int(
        "intermediate_size", "the experts' MLP size"
    )
    per_token = cfg.opt_int("num_experts_per_tok") or cfg.int(
        "experts_per_token", "how many experts each token uses"
    )
    shared = cfg.opt_int("shared_expert_intermediate_size") or (
        (cfg.opt_int("n_shared_experts") or 0) * expert_size
    )
    return MlpShape(
        dense_intermediate=dense or 0,
        experts=experts,
        experts_per_token=per_token,
        expert_intermediate=expert_size,
        shared_intermediate=shared,
        moe_layers=_moe_layers(cfg, n),
    )


def _moe_layers(cfg: ConfigFields, n: int) -> tuple[bool, ...]:
    if cfg.has("first_k_dense_replace") or cfg.has("moe_layer_freq"):  # DeepSeek
        first = cfg.opt_int("first_k_dense_replace") or 0
        freq = cfg.opt_int("moe_layer_freq") or 1
        return tuple(i >= first and i % freq == 0 for i in range(n))
    if cfg.has("expert_layer_period"):  # Jamba
        period = cfg.int("expert_layer_period", "Jamba's expert layout")
        offset = cfg.int("expert_layer_offset", "Jamba's expert layout", minimum=0)
        return tuple(i % period == offset for i in range(n))
    dense_only = cfg.get("mlp_only_layers") or []
    step = cfg.opt_int("decoder_sparse_step") or 1
    if not isinstance(dense_only, list):
        raise cfg.error(
            "field 'mlp_only_layers' must be a list of layer indices", "mlp_only_layers"
        )
    return tuple(i not in dense_only and (i + 1) % step == 0 for i in range(n))
