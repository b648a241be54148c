"""How vLLM sizes its memory at start-up, version by version.

``kvguard budget`` predicts the KV pool vLLM will allocate. The arithmetic of the
pool is stable across versions; what changed is what vLLM subtracts before it,
and the defaults it picks. Each rule here names the vLLM source it follows:

- **Batch defaults** (``vllm/engine/arg_utils.py``, ``get_batch_defaults``): the
  OpenAI server takes 8,192 batched tokens and 1,024 sequences on GPUs with at least
  70 GiB that are not A100s, 16,384/1,024 from 160 GiB, else 2,048/256 (vLLM 0.32).
  The V0 engine (before 0.8) ran 256 sequences and, without chunked prefill, batched
  a whole ``max_model_len`` (at least 2,048) per step.
- **Default utilization** (``vllm/config/cache.py``): ``--gpu-memory-utilization``
  is 0.9 unless given up to 0.19, 0.92 from 0.20.
- **Activation peak**: V1's profile run (``gpu_model_runner.profile_run``) runs one
  forward pass of ``max_num_batched_tokens`` and then a dummy sampler over
  ``max_num_seqs`` rows of the vocabulary with top-k/top-p; on large-vocabulary
  models the sampler's copies are the peak, and how many there are depends on the
  top-k/top-p path of the release (PyTorch's sort before 0.17, in place after). V0
  profiled the forward pass and kept fp32 logits.
- **Outside the pool**: since 0.21 the profiler also estimates CUDA graph memory
  and takes it from the pool (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``, default
  on); earlier versions captured graphs after sizing the pool, outside the
  utilization fraction.
- **Sliding windows**: a sliding layer reserves ``cdiv(min(window - 1 + in-flight
  tokens, max_model_len), block) + 1`` blocks per request (``SlidingWindowSpec``);
  in-flight tokens are one batch, two with async scheduling (0.32's default).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from kvguard.core.units import GiB
from kvguard.errors import InvalidInputError

CURRENT_VLLM: tuple[int, int] = (0, 32)
"""The vLLM release whose source the default rule follows."""

OLDEST_VLLM: tuple[int, int] = (0, 5)

_VERSION = re.compile(r"^v?(\d+)\.(\d+)(?:\.\d+)*(?:[.+-].*)?$")


@dataclass(frozen=True)
class VllmRule:
    """What one vLLM version does when it sizes its KV pool."""

    version: tuple[int, int]
    stated: bool  # given by the operator (else the current default)

    @property
    def engine(self) -> Literal["v0", "v1"]:
        """V1 became the default engine in 0.8."""
        return "v1" if self.version >= (0, 8) else "v0"

    @property
    def profiles_cuda_graphs(self) -> bool:
        """Whether CUDA graph memory is taken from the pool before sizing it (0.21+)."""
        return self.version >= (0, 21)

    @property
    def in_flight_batches(self) -> int:
        """Batches a sliding window's reservation covers: two under async scheduling."""
        return 2 if self.version >= (0, 21) else 1

    @property
    def label(self) -> str:
        """How the budget names the rule: ``vLLM 0.32 (V1)``."""
        major, minor = self.version
        text = f"vLLM {major}.{minor} ({self.engine.upper()})"
        return text if self.stated else f"{text}, the default; --engine-version to change"


def vllm_rule(version: str | None) -> VllmRule:
    """The rule of ``version`` (``0.11``, ``0.11.0``, ``v0.10.1.1``); None: the current one."""
    if version is None:
        return VllmRule(CURRENT_VLLM, stated=False)
    match = _VERSION.match(version.strip())
    if not match:
        raise InvalidInputError(
            "engine_version", version, "must be a vLLM version such as 0.11 or 0.10.1"
        )
    parsed = (int(match.group(1)), int(match.group(2)))
    if parsed < OLDEST_VLLM:
        raise InvalidInputError(
            "engine_version",
            version,
            f"must be {OLDEST_VLLM[0]}.{OLDEST_VLLM[1]} or newer (older engines are not modelled)",
        )
    return VllmRule(parsed, stated=True)


@dataclass(frozen=True)
class BatchLimits:
    """The engine's ``max_num_batched_tokens`` and ``max_num_seqs``, and why."""

    max_num_batched_tokens: int
    max_num_seqs: int
    source: str


# V0 chunked its prefills (2,048-token chunks) only for contexts longer than this; at
# shorter ones a step could hold a whole prompt. Its batch, so its activation peak,
# shrinks past it: the one length where a longer context leaves a larger pool.
V0_CHUNKED_FROM = 32_768


def batch_defaults(
    rule: VllmRule,
    *,
    gpu_memory_bytes: int,
    gpu_name: str | None,
    max_model_len: int,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
) -> BatchLimits:
    """The batch limits vLLM's OpenAI server picks where the operator set none."""
    given = max_num_batched_tokens is not None and max_num_seqs is not None
    name = (gpu_name or "").lower()
    if rule.engine == "v0":
        seqs, why = 256, "V0 engine defaults"
        # V0 enabled chunked prefill (2,048-token chunks) only past 32K contexts;
        # otherwise a step could hold a whole max_model_len prompt.
        tokens = 2048 if max_model_len > V0_CHUNKED_FROM else max(max_model_len, 2048)
    elif rule.profiles_cuda_graphs and gpu_memory_bytes >= 160 * GiB:
        tokens, seqs, why = 16_384, 1024, "vLLM default for GPUs of 160 GiB or more"
    elif gpu_memory_bytes >= 70 * GiB and "a100" not in name:
        tokens, seqs, why = 8192, 1024, "vLLM default for GPUs of 70 GiB or more (not A100)"
    else:
        tokens, seqs, why = 2048, 256, "vLLM default for GPUs under 70 GiB and A100s"
    seqs = max_num_seqs if max_num_seqs is not None else seqs
    if max_num_batched_tokens is not None:
        tokens = max_num_batched_tokens
    elif rule.engine == "v1":
        tokens = min(tokens, seqs * max_model_len)  # as arg_utils caps its default
    return BatchLimits(tokens, seqs, "given" if given else why)


# vLLM's default --gpu-memory-utilization (``vllm/config/cache.py``, CacheConfig):
# 0.9 until 0.19, 0.92 from 0.20 (0.20-0.32 read alike).
UTILIZATION_092_FROM: tuple[int, int] = (0, 20)


def default_gpu_memory_utilization(rule: VllmRule) -> float:
    """The share of GPU memory vLLM takes when ``--gpu-memory-utilization`` is not given."""
    return 0.92 if rule.version >= UTILIZATION_092_FROM else 0.9


def non_torch_bytes(rule: VllmRule, tp: int, *, nvlink: bool = True) -> int:
    """Memory outside torch's allocator that grows while vLLM profiles (per GPU).

    vLLM prints it as ``non_torch_memory``. Measured: V1 0.11 about 0.13 GiB on one
    GPU and 0.55 GiB with tensor parallelism (llm-d-benchmark, H100); V1 0.19 about
    0.25 GiB on one GPU and 2.06-2.21 GiB with tensor parallelism (NCCL and custom
    all-reduce buffers; llm-d-planner's H100 logs, where pipeline parallelism alone
    added none); V0 0.35 GiB on one GPU (vLLM issue 10517) and 2.1 GiB at TP 8
    (vLLM 0.7.1 on A100). Those tensor-parallel figures are NVLink machines'. On
    boards with no NVLink (``nvlink=False``) vLLM's custom all-reduce is off (it
    needs peer-to-peer access, and NVLink past two GPUs) and NCCL goes over PCIe
    and host memory: V0 printed 0.30 GiB at TP 2 on L40S (vLLM issue 15815, 0.7.1),
    about the one-GPU figure, which is what is taken there.
    """
    parallel = tp > 1 and nvlink
    if rule.engine == "v0":
        return round((2.1 if parallel else 0.35) * GiB)
    if rule.version < NON_TORCH_CHANGE:
        return round((0.55 if parallel else 0.13) * GiB)
    return round((2.1 if parallel else 0.25) * GiB)


# The first vLLM release kvguard models with the larger tensor-parallel buffers of
# 0.19 (measured on both sides; the release in between that changed it is not known).
NON_TORCH_CHANGE: tuple[int, int] = (0, 12)

# What V1's profile run samples with (``vllm/v1/sample/ops/topk_topp_sampler.py``):
# its dummy sampler run sets top-k and top-p on every row (``gpu_model_runner.
# _dummy_sampler_run``), so the top-k/top-p path in force is what the peak holds.
# Before 0.17, PyTorch's sort: vLLM turned FlashInfer's sampler off by default in
# 0.11.1 (PR 26859) and before that used it only where FlashInfer was installed (an
# optional extra; vLLM's Docker image has it: such a start-up logs "Using FlashInfer
# for top-p & top-k sampling" and profiles the light figure). From 0.17, Triton
# kernels that work in place (PR 33538); from 0.21 FlashInfer again by default.
TRITON_SAMPLER: tuple[int, int] = (0, 17)
FLASHINFER_SAMPLER: tuple[int, int] = (0, 21)


SAMPLERS = ("pytorch", "triton", "flashinfer")
"""vLLM's top-k/top-p paths, as ``kvguard budget --sampler`` names them."""


def release_sampler(rule: VllmRule) -> str:
    """The top-k/top-p path a release takes unless told otherwise (:data:`SAMPLERS`)."""
    if rule.version < TRITON_SAMPLER:
        return "pytorch"
    return "triton" if rule.version < FLASHINFER_SAMPLER else "flashinfer"


def sampler_bytes_per_logit(rule: VllmRule, sampler: str | None = None) -> int:
    """Bytes V1's profile-run sampler holds per sequence per vocabulary entry.

    With PyTorch's sort (before 0.17): the bf16 logits (2), their fp32 copy (4), the
    sorted values (4) and int64 indices (8), the sort's int64 reverse indices (8) and
    CUB's alternate key and value buffers (4 + 8): 38, at the sort. In place (Triton,
    0.17-0.20; FlashInfer from 0.21): the bf16 and fp32 logits, the softmax and one
    more fp32 row set: 14, plus Triton's cached rows. Measured on H100 at 1,024
    sequences, the hidden states on top: about 39 bytes a logit on 0.11
    (llm-d-benchmark: 4.76 GiB for Llama-3.1-8B's 128,256-entry vocabulary, 5.56-5.64
    for Qwen3's 151,936, 7.38 for gpt-oss's 201,088) and about 15.5 on 0.19
    (llm-d-planner: 1.89, 2.21, 2.87 GiB for the same vocabularies, 3.65 for
    Gemma-2's 256,000). A start-up of an older release with FlashInfer installed
    profiles the light figure: calibrate it with ``--from-vllm-log``. vLLM's Model
    Runner V2 (every generate model's from 0.29) sets no top-k/top-p in its dummy
    run, and one public 0.27 start-up under it profiled under 7 bytes a logit; kvguard
    keeps the in-place figure there, which errs toward a smaller pool, until a
    start-up of such a release is compared. ``sampler`` (:data:`SAMPLERS`) is the path
    the engine took where it is known (its log says); None: the release's own.
    """
    return 39 if (sampler or release_sampler(rule)) == "pytorch" else 15


_SAMPLER_NAMES = {
    "pytorch": ("PyTorch sort top-k/top-p", "vLLM before 0.17 without FlashInfer"),
    "triton": ("Triton top-k/top-p", "vLLM 0.17-0.20"),
    "flashinfer": ("FlashInfer top-k/top-p", "vLLM 0.21+"),
}


def sampler_kind(rule: VllmRule, sampler: str | None = None) -> str:
    """The top-k/top-p path V1's profile run samples with, in words (for sources)."""
    name, releases = _SAMPLER_NAMES[sampler or release_sampler(rule)]
    return f"{name} ({'given' if sampler is not None else releases})"


def cuda_graph_bytes(rule: VllmRule, layers_per_gpu: int, moe: bool, enforce_eager: bool) -> int:
    """CUDA graph memory vLLM takes from the pool (0.21+, not with ``--enforce-eager``).

    Earlier releases captured graphs after sizing the pool, outside the utilization
    fraction. The estimate follows the graph pools vLLM 0.19 measured on H100
    (llm-d-planner): about 0.55 GiB plus 13 MiB per layer on the GPU (0.87-0.96 GiB
    for 28-36-layer 7-8B models, 1.6 GiB for 80-layer 70B ones), and 0.5 GiB more
    for mixture-of-experts models (1.41-1.84 GiB). vLLM's own estimate is known to
    run higher on some models (vLLM issue 45178): calibrate with ``--from-vllm-log``.
    """
    if enforce_eager or not rule.profiles_cuda_graphs:
        return 0
    return round(0.55 * GiB) + layers_per_gpu * 13 * 2**20 + (GiB // 2 if moe else 0)


# Speculative methods whose drafter keeps no KV cache of its own.
_NO_KV_DRAFTERS = ("ngram", "ngram_gpu", "suffix", "medusa", "mlp_speculator")
# Where a target config states how many MTP (next-token prediction) layers it carries.
_MTP_LAYER_FIELDS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")


@dataclass(frozen=True)
class Speculation:
    """The attention layers a speculative drafter adds to the pool, and why."""

    layers: int
    source: str


def speculative_layers(spec: object, model_config: Mapping[str, object]) -> Speculation:
    """Drafter layers of vLLM's ``--speculative-config`` (its JSON, already parsed).

    EAGLE heads and MTP modules are attention layers with the target's KV shape that
    share its pool (vLLM groups them with the target's full-attention layers): one for
    EAGLE/EAGLE-3, the config's ``num_nextn_predict_layers`` for MTP. n-gram, suffix
    and Medusa drafters keep no cache. A separate draft model has its own shape, which
    this budget does not hold: that is an error that says what to pass instead.
    """
    if not isinstance(spec, Mapping):
        raise InvalidInputError(
            "speculative_config", spec, 'must be a JSON object such as {"method": "eagle3"}'
        )
    method = spec.get("method")
    if method is None and spec.get("model") is not None:
        method = "draft_model"
    if not isinstance(method, str) or not method:
        raise InvalidInputError("speculative_config", dict(spec), "must name its 'method'")
    if method in _NO_KV_DRAFTERS:
        return Speculation(0, f"{method} drafter: no KV cache of its own")
    if method in ("eagle", "eagle3"):
        return Speculation(
            1,
            f"{method} head: 1 attention layer with the target's KV shape"
            " (--speculative-layers N for a deeper head)",
        )
    if method == "mtp" or method.endswith("_mtp"):
        text = model_config.get("text_config")
        scopes = (text, model_config) if isinstance(text, Mapping) else (model_config,)
        for scope in scopes:
            for name in _MTP_LAYER_FIELDS:
                value = scope.get(name)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return Speculation(value, f"{method}: {name} = {value} in the model config")
        return Speculation(1, f"{method}: the config names no MTP layer count, 1 assumed")
    if method == "draft_model":
        raise InvalidInputError(
            "speculative_config",
            dict(spec),
            "a separate draft model has its own KV shape, which kvguard does not budget;"
            " pass --speculative-layers N when its layers match the target's, else"
            " calibrate with --from-vllm-log",
        )
    raise InvalidInputError(
        "speculative_config",
        dict(spec),
        "method must be one of eagle, eagle3, mtp (or a *_mtp method), draft_model, "
        + ", ".join(_NO_KV_DRAFTERS),
    )
