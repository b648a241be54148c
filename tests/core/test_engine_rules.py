"""vLLM's memory rules by version (kvguard/core/engine_rules.py), as vLLM's source states them."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvguard.config.model_files import BUNDLED_MODELS_DIR
from kvguard.core.architecture import parse_model_config
from kvguard.core.budget import Budget, BudgetInputs, compute_budget
from kvguard.core.engine_rules import (
    CURRENT_VLLM,
    V0_CHUNKED_FROM,
    batch_defaults,
    cuda_graph_bytes,
    default_gpu_memory_utilization,
    non_torch_bytes,
    sampler_bytes_per_logit,
    sampler_kind,
    speculative_layers,
    vllm_rule,
)
from kvguard.core.units import GiB
from kvguard.errors import InvalidInputError


@pytest.mark.parametrize(
    ("text", "version", "engine"),
    [("0.11", (0, 11), "v1"), ("0.10.1.1", (0, 10), "v1"), ("v0.6.4.post1", (0, 6), "v0")],
)
def test_versions_are_read_as_vllm_prints_them(text, version, engine):
    """Major.minor decide the rule; patch levels and suffixes do not."""
    rule = vllm_rule(text)
    assert rule.version == version
    assert rule.engine == engine
    assert rule.label.startswith(f"vLLM {version[0]}.{version[1]}")


def test_no_version_is_the_current_rule_and_says_so():
    """The default is the current release, named as the default in the output."""
    rule = vllm_rule(None)
    assert rule.version == CURRENT_VLLM
    assert "--engine-version" in rule.label


@pytest.mark.parametrize("text", ["latest", "0", "1.x", "0.4"])
def test_unreadable_or_unmodelled_versions_are_refused(text):
    """A version that is not X.Y, or older than 0.5, is an error naming the field."""
    with pytest.raises(InvalidInputError) as err:
        vllm_rule(text)
    assert err.value.field == "engine_version"


@pytest.mark.parametrize(
    ("memory_gib", "name", "expected"),
    [
        (79.19, "H100-SXM", (8192, 1024)),
        (79.25, "A100-80GB", (2048, 256)),  # A100s keep the small defaults (vLLM PR 17885)
        (44.42, "L40S", (2048, 256)),
        (178.35, "B200", (16_384, 1024)),
    ],
)
def test_batch_defaults_follow_the_gpu_as_vllm_does(memory_gib, name, expected):
    """The OpenAI server's defaults by GPU memory and name, as in vLLM 0.32."""
    limits = batch_defaults(
        vllm_rule("0.32"),
        gpu_memory_bytes=round(memory_gib * GiB),
        gpu_name=name,
        max_model_len=32_768,
    )
    assert (limits.max_num_batched_tokens, limits.max_num_seqs) == expected
    assert "default" in limits.source


def test_batched_tokens_never_exceed_the_sequences_times_their_length():
    """The default is capped at max_num_seqs x max_model_len, as vLLM caps it."""
    limits = batch_defaults(
        vllm_rule("0.32"),
        gpu_memory_bytes=80 * GiB,
        gpu_name="H100",
        max_model_len=4,
        max_num_seqs=2,
    )
    assert limits.max_num_batched_tokens == 8


def test_v0_batches_a_whole_context_without_chunked_prefill():
    """V0: 256 sequences; a step may hold a whole max_model_len (at least 2,048) up to 32K."""
    rule = vllm_rule("0.6")
    short = batch_defaults(rule, gpu_memory_bytes=24 * GiB, gpu_name=None, max_model_len=20_000)
    long = batch_defaults(rule, gpu_memory_bytes=24 * GiB, gpu_name=None, max_model_len=65_536)
    assert (short.max_num_batched_tokens, short.max_num_seqs) == (20_000, 256)
    assert long.max_num_batched_tokens == 2048


def test_given_limits_win_and_are_called_given():
    """An operator's flags replace the defaults."""
    limits = batch_defaults(
        vllm_rule(None),
        gpu_memory_bytes=80 * GiB,
        gpu_name="H100",
        max_model_len=8192,
        max_num_batched_tokens=4096,
        max_num_seqs=64,
    )
    assert (limits.max_num_batched_tokens, limits.max_num_seqs, limits.source) == (
        4096,
        64,
        "given",
    )


def test_tensor_parallel_buffers_grow_the_non_torch_memory():
    """More memory outside torch with TP, and more from 0.12 than before."""
    old, new = vllm_rule("0.11"), vllm_rule("0.19")
    assert non_torch_bytes(old, 1) < non_torch_bytes(old, 2)
    assert non_torch_bytes(new, 1) < non_torch_bytes(new, 2)
    assert non_torch_bytes(old, 2) < non_torch_bytes(new, 2)


def test_without_nvlink_tensor_parallelism_adds_no_large_buffers():
    """Over PCIe the one-GPU figure holds: V0 printed 0.30 GiB at TP 2 on L40S."""
    for rule in (vllm_rule("0.7"), vllm_rule("0.11"), vllm_rule("0.19")):
        assert non_torch_bytes(rule, 2, nvlink=False) == non_torch_bytes(rule, 1)
        assert non_torch_bytes(rule, 4, nvlink=False) < non_torch_bytes(rule, 4)
    assert abs(non_torch_bytes(vllm_rule("0.7"), 2, nvlink=False) - round(0.30 * GiB)) < 0.1 * GiB


@pytest.mark.parametrize(
    ("version", "heavy", "says"),
    [
        ("0.11", True, "PyTorch sort"),
        ("0.12", True, "PyTorch sort"),  # FlashInfer's sampler was off by default then
        ("0.16", True, "PyTorch sort"),
        ("0.17", False, "Triton"),
        ("0.19", False, "Triton"),
        ("0.21", False, "FlashInfer"),
    ],
)
def test_the_profiled_sampler_follows_the_top_k_top_p_path_of_the_release(version, heavy, says):
    """PyTorch's sort (before 0.17) holds about 38 bytes a logit; the in-place paths 14."""
    rule = vllm_rule(version)
    assert (sampler_bytes_per_logit(rule) >= 38) is heavy
    assert 14 <= sampler_bytes_per_logit(rule) <= 39
    assert says in sampler_kind(rule)


def test_cuda_graphs_come_off_the_pool_only_from_021_and_not_eager():
    """Graphs captured after sizing (before 0.21) or never (eager) take nothing first."""
    assert cuda_graph_bytes(vllm_rule("0.19"), 32, moe=False, enforce_eager=False) == 0
    assert cuda_graph_bytes(vllm_rule("0.32"), 32, moe=False, enforce_eager=True) == 0
    dense = cuda_graph_bytes(vllm_rule("0.32"), 32, moe=False, enforce_eager=False)
    deeper = cuda_graph_bytes(vllm_rule("0.32"), 80, moe=False, enforce_eager=False)
    moe = cuda_graph_bytes(vllm_rule("0.32"), 32, moe=True, enforce_eager=False)
    assert 0 < dense < deeper
    assert dense < moe


def _config(name: str) -> dict[str, object]:
    loaded: dict[str, object] = json.loads((BUNDLED_MODELS_DIR / name / "config.json").read_text())
    return loaded


@pytest.mark.parametrize(
    ("spec", "layers"),
    [
        ({"method": "eagle3", "model": "x", "num_speculative_tokens": 3}, 1),
        ({"method": "eagle", "model": "x"}, 1),
        ({"method": "ngram", "num_speculative_tokens": 4}, 0),
        ({"method": "suffix"}, 0),
    ],
)
def test_drafters_add_the_layers_they_cache(spec, layers):
    """EAGLE heads hold one attention layer; n-gram and suffix drafters none."""
    assert speculative_layers(spec, _config("llama-3.1-8b")).layers == layers


def test_mtp_takes_the_layer_count_from_the_target_config():
    """DeepSeek-V3 states its MTP modules in num_nextn_predict_layers."""
    config = _config("deepseek-v3")
    drafter = speculative_layers({"method": "deepseek_mtp"}, config)
    assert drafter.layers == config["num_nextn_predict_layers"]
    assert "num_nextn_predict_layers" in drafter.source


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({"model": "meta-llama/Llama-3.2-1B"}, "own KV shape"),
        ({"method": "draft_model", "model": "x"}, "own KV shape"),
        ({"num_speculative_tokens": 3}, "'method'"),
        ({"method": "telepathy"}, "must be one of"),
        (["eagle"], "JSON object"),
    ],
)
def test_unbudgetable_speculation_is_refused_with_what_to_do(spec, says):
    """A separate draft model, a missing or unknown method: an error, not a guess."""
    with pytest.raises(InvalidInputError) as err:
        speculative_layers(spec, _config("llama-3.1-8b"))
    assert err.value.field == "speculative_config"
    assert says in str(err.value)


def test_v0_max_context_past_its_chunked_prefill_is_found():
    """V0's batch shrinks past 32K: a context there can fit where 32K itself does not.

    Llama-3.1-8B on 24 GiB: at 32,768 a step may hold the whole prompt and its
    activation peak leaves the pool too small for one such sequence; past it, prefill
    is chunked and a longer context fits. The max context is found past the break.
    """
    shape = parse_model_config(_config("llama-3.1-8b"))
    inputs = BudgetInputs(
        max_model_len=131_072, concurrency=1, gpu_memory_bytes=24 * GiB, engine_version="0.6"
    )

    def at(length: int) -> Budget:
        return compute_budget(
            shape, replace(inputs, max_model_len=length), weights_bytes=16 * GiB, weights_source="t"
        )

    longest = at(131_072).max_model_len_at_concurrency
    assert longest > V0_CHUNKED_FROM
    assert at(longest).worst_case_kv_bytes_per_gpu <= at(longest).kv_pool_bytes_per_gpu
    assert (
        at(V0_CHUNKED_FROM).worst_case_kv_bytes_per_gpu > at(V0_CHUNKED_FROM).kv_pool_bytes_per_gpu
    )
    assert at(longest + 16).worst_case_kv_bytes_per_gpu > at(longest + 16).kv_pool_bytes_per_gpu


@pytest.mark.parametrize(("version", "expected"), [("0.11", 0.9), ("0.19", 0.9), ("0.20", 0.92)])
def test_the_default_utilization_is_the_releases_own(version, expected):
    """As vLLM's CacheConfig: 0.9 until 0.19, 0.92 from 0.20; the current rule takes 0.92."""
    assert default_gpu_memory_utilization(vllm_rule(version)) == expected
    assert default_gpu_memory_utilization(vllm_rule(None)) == 0.92
    assert BudgetInputs(engine_version=version).utilization == expected
    assert BudgetInputs(engine_version=version, gpu_memory_utilization=0.5).utilization == 0.5


def test_a_sampler_the_log_names_wins_over_the_releases_default():
    """An older release with FlashInfer installed profiled the light figure."""
    rule = vllm_rule("0.10")
    assert sampler_bytes_per_logit(rule) == 39
    assert sampler_bytes_per_logit(rule, "flashinfer") < 20
    assert sampler_bytes_per_logit(vllm_rule("0.32"), "pytorch") == 39
    assert "(given)" in sampler_kind(rule, "flashinfer")
    with pytest.raises(InvalidInputError, match="sampler"):
        BudgetInputs(sampler="fast")
