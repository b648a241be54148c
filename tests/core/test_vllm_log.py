"""Reading vLLM's start-up figures back from its log, for ``budget --from-vllm-log``.

Every fixture under tests/fixtures/vllm_logs/ is a verbatim excerpt of a public log
(its first line names the page); each expected value below is the number printed in
that file, converted to bytes the way the parser does (GiB x 2**30, rounded).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvguard.core.units import GiB
from kvguard.core.vllm_log import NOT_A_VLLM_LOG, VllmStartupLog, parse_vllm_log
from kvguard.errors import InvalidInputError

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm_logs"


def gib(text: str) -> int:
    """A figure vLLM printed in GiB, in bytes."""
    return round(float(text) * GiB)


def read(name: str) -> str:
    """A fixture's text."""
    return (FIXTURES / name).read_text(encoding="utf-8")


def parse(*names: str) -> VllmStartupLog:
    """Parse fixtures read one after another, as one log file."""
    return parse_vllm_log("".join(read(name) for name in names), source=names[0])


def test_every_fixture_names_its_public_source():
    """A fixture without its page could not be checked against what vLLM printed."""
    logs = sorted(FIXTURES.glob("*.log"))
    assert len(logs) >= 5
    for log in logs:
        first = log.read_text(encoding="utf-8").splitlines()[0]
        assert first.startswith("# source: https://github.com/"), log.name


# ---------------------------------------------------------------- V0 formats


def test_v0_one_line_profiling_results():
    """v0.6.4-v0.6.4.post1: one "Memory profiling results:" line of key=value."""
    log = parse("v0_profiling_results_oneline.log")
    assert log.engine == "v0"
    assert log.weights_bytes == gib("14.9888")  # "Loading model weights took 14.9888 GB"
    assert log.total_gpu_memory_bytes == gib("23.58")
    assert log.non_torch_bytes == gib("0.35")
    assert log.kv_cache_memory_bytes == gib("2.89")  # kv_cache_size=2.89GiB
    assert log.gpu_memory_utilization == 0.90
    # peak_torch_memory includes the weights here: not reported as the activation peak.
    assert log.activation_peak_bytes is None
    # "# GPU blocks: 1478" starts with "#" but is vLLM's line, not a comment.
    assert log.gpu_blocks == 1478
    assert (log.max_concurrency, log.max_concurrency_tokens_per_request) == (0.82, 29000)
    assert log.kv_cache_tokens == 23648  # the capacity error: 1478 blocks x 16
    assert log.ranks_seen == 1
    assert log.sources["kv_cache_memory_bytes"] == "V0 memory profiling results line"
    assert log.sources["kv_cache_tokens"] == "KV cache capacity error line"


def test_v0_profiling_results_with_duration_and_commas():
    """The same line in later v0.6.4 builds adds ``duration=`` and commas.

    Rendered from the format string of vllm/worker/worker.py (v0.6.4.post2.dev, the
    ``Memory profiling results: duration=%.2f seconds, total_gpu_memory=%.2fGiB, …``
    call) with plausible numbers; no public log with a page to cite was found.
    """
    line = (
        "INFO 12-07 17:39:09 worker.py:237] Memory profiling results: duration=39.11 seconds, "
        "total_gpu_memory=44.98GiB, initial_memory_usage=15.23GiB, peak_torch_memory=16.20GiB, "
        "memory_usage_post_profile=15.46GiB, non_torch_memory=0.44GiB, kv_cache_size=23.84GiB, "
        "gpu_memory_utilization=0.90."
    )
    log = parse_vllm_log(line)
    assert log.total_gpu_memory_bytes == gib("44.98")
    assert log.non_torch_bytes == gib("0.44")
    assert log.kv_cache_memory_bytes == gib("23.84")
    assert log.gpu_memory_utilization == 0.90


def test_v0_profiling_table_of_the_development_build():
    """PR #10511's build printed one ``name<TAB>value`` line per figure."""
    log = parse("v0_profiling_table_pr10511.log")
    assert log.engine == "v0"
    assert log.total_gpu_memory_bytes == gib("79.22")
    assert log.gpu_memory_utilization == 0.90
    assert log.requested_memory_bytes == gib("71.29")
    assert log.weights_bytes == gib("14.96")
    assert log.non_torch_bytes == gib("1.79")
    assert log.activation_peak_bytes == gib("1.26")
    assert log.kv_cache_memory_bytes == gib("53.29")


def test_v0_memory_profiling_takes_with_two_ranks():
    """v0.6.5-v0.8 V0: the driver (rank 0) and a VllmWorkerProcess both print."""
    log = parse("v0_profiling_takes_tp2.log")
    assert log.engine == "v0"
    assert log.total_gpu_memory_bytes == gib("15.77")
    assert log.gpu_memory_utilization == 0.95
    assert log.requested_memory_bytes == gib("14.98")
    # The loading line has four decimals; the profiling summary's 7.51GiB is the fallback.
    assert log.weights_bytes == gib("7.5122")
    assert log.sources["weights_bytes"] == "model loading line"
    assert log.non_torch_bytes == gib("0.39")
    assert log.activation_peak_bytes == gib("2.53")
    assert log.kv_cache_memory_bytes == gib("4.55")
    assert log.gpu_blocks == 4660
    assert (log.max_concurrency, log.max_concurrency_tokens_per_request) == (1.86, 40000)
    assert log.ranks_seen == 2
    # Rank 0 is the unprefixed driver: no worker label in the source column.
    assert log.sources["kv_cache_memory_bytes"] == "V0 memory profiling line"


def test_v0_cuda_blocks_inside_a_k9s_pane():
    """v0.8 V0 "[file:line]" prefixes and "# cuda blocks", with box borders around."""
    log = parse("v0_profiling_takes_cuda_blocks_k9s.log")
    assert log.engine == "v0"
    assert log.total_gpu_memory_bytes == gib("79.19")
    assert log.requested_memory_bytes == gib("71.27")
    assert log.weights_bytes == gib("12.55")
    assert log.sources["weights_bytes"] == "V0 memory profiling line"
    assert log.non_torch_bytes == gib("0.16")
    assert log.activation_peak_bytes == gib("2.38")
    assert log.kv_cache_memory_bytes == gib("56.18")
    assert log.gpu_blocks == 7191


def test_v0_engine_config_line():
    """``Initializing an LLM engine (v0.6.4.post1) with config: …``, cut short in the copy.

    The config excerpt has no memory lines, so it is read together with another real
    V0 excerpt, as two start-ups would sit in one log file.
    """
    log = parse("v0_engine_config.log", "v0_profiling_results_oneline.log")
    assert (log.engine, log.version) == ("v0", "0.6.4.post1")
    assert log.model == "NousResearch/Meta-Llama-3.1-8B-Instruct"
    assert (log.tensor_parallel_size, log.pipeline_parallel_size) == (1, 1)
    assert log.max_model_len == 120000  # max_seq_len=120000
    assert log.quantization is None  # quantization=None
    assert log.speculative_config is None
    # "enforce_eager=" is where the stored line ends: a cut value is not trusted.
    assert log.enforce_eager is None
    assert log.sources["max_model_len"] == "engine config line"


# ---------------------------------------------------------------- V1 formats


def test_v1_available_kv_cache_tokens_and_concurrency():
    """V1: Available KV cache memory, GPU KV cache size, Maximum concurrency."""
    log = parse("v1_available_kv_cache.log")
    assert log.engine == "v1"
    assert log.kv_cache_memory_bytes == gib("6.51")
    assert log.kv_cache_tokens == 42656  # "42,656 tokens"
    assert log.max_concurrency == 1.30
    assert log.max_concurrency_tokens_per_request == 32768  # "32,768 tokens per request"
    assert log.ranks_seen == 1
    assert log.sources["kv_cache_tokens"] == ("GPU KV cache size line (EngineCore_DP0 pid=1133552)")


def test_v1_model_loading_takes_rank_zero_and_ignores_durations():
    """A "Loading weights took 46.94 seconds" line is a duration, not memory."""
    log = parse("v1_vllmworker_rank_tp2.log")
    assert log.engine == "v1"
    assert log.weights_bytes == gib("31.2795")
    assert log.sources["weights_bytes"] == "model loading line (VllmWorker rank=0 pid=244025)"
    assert log.ranks_seen == 2


def test_v1_model_loading_memory_wording():
    """Later V1: "Model loading took 12.66 GiB memory and 31.657031 seconds"."""
    log = parse("v1_model_loading_memory_wording.log")
    assert log.weights_bytes == gib("12.66")
    assert log.engine == "v1"


def test_v1_cuda_graph_estimate_taken_off_before_sizing_prefers_rank_zero():
    """TP=2: each rank estimates its own graphs; the figure kept is Worker_TP0's."""
    log = parse("v1_tp2_cudagraph_estimate.log")
    assert log.cuda_graph_estimate_bytes == gib("4.38")  # TP1 printed 4.30 first
    assert log.cuda_graph_reserved_before_kv_cache is True
    assert log.gpu_memory_utilization == 0.90  # "--gpu-memory-utilization=0.9000"
    assert log.kv_cache_memory_bytes == gib("25.46")
    assert log.ranks_seen == 2
    assert log.sources["cuda_graph_estimate_bytes"] == (
        "CUDA graph estimate line (Worker_TP0 pid=646817)"
    )


def test_rank_zero_wins_in_any_line_order():
    """A later line from another rank does not displace rank 0's figure."""
    lines = read("v1_tp2_cudagraph_estimate.log").splitlines()
    log = parse_vllm_log("\n".join([lines[0], *reversed(lines[1:])]))
    assert log.cuda_graph_estimate_bytes == gib("4.38")
    v0 = read("v0_profiling_takes_tp2.log").splitlines()
    driver_first = [line for line in v0 if not line.startswith("(VllmWorkerProcess")]
    workers_last = [line for line in v0 if line.startswith("(VllmWorkerProcess")]
    log = parse_vllm_log("\n".join(driver_first + workers_last))
    assert "VllmWorkerProcess" not in log.sources["kv_cache_memory_bytes"]
    assert log.ranks_seen == 2


def test_a_worker_of_unknown_rank_counts_when_rank_zero_said_nothing():
    """(VllmWorkerProcess …) alone: its figure is used rather than none."""
    v0 = read("v0_profiling_takes_tp2.log").splitlines()
    workers = [line for line in v0 if line.startswith("(VllmWorkerProcess")]
    log = parse_vllm_log("\n".join(workers))
    assert log.kv_cache_memory_bytes == gib("4.55")
    assert log.sources["kv_cache_memory_bytes"] == (
        "V0 memory profiling line (VllmWorkerProcess pid=90)"
    )
    assert log.ranks_seen == 1


def test_v1_cuda_graph_estimate_printed_but_not_taken_off():
    """Before v0.19 the estimate was opt-in: printed, not taken off the pool."""
    log = parse("v1_cudagraph_estimate_not_applied.log")
    assert log.cuda_graph_estimate_bytes == gib("1.62")
    assert log.cuda_graph_reserved_before_kv_cache is False
    assert log.gpu_memory_utilization == 0.90  # "from 0.9000 to 0.9690"
    assert log.kv_cache_memory_bytes == gib("6.9")  # vLLM printed "6.9 GiB"
    assert log.kv_cache_tokens == 89760
    assert (log.max_concurrency, log.max_concurrency_tokens_per_request) == (1.36, 262144)
    # "num_gpu_blocks=0 with num_gpu_blocks_override=512" is not a block count line.
    assert log.gpu_blocks is None


def test_v1_cuda_graph_pool_actual_and_estimated():
    """The pool line after capture gives both the measured and the estimated size."""
    log = parse("v1_cudagraph_pool_actual.log")
    assert log.cuda_graph_bytes == gib("0.11")
    assert log.cuda_graph_estimate_bytes == gib("0.14")
    assert log.kv_cache_tokens == 396928
    assert (log.max_concurrency, log.max_concurrency_tokens_per_request) == (3.03, 131072)
    assert log.ranks_seen == 1


def test_v1_debug_breakdown_of_free_and_used_memory():
    """The DEBUG line of gpu_worker.py: free at start-up, what each part used."""
    log = parse("v1_debug_free_memory.log")
    assert log.free_gpu_memory_at_startup_bytes == gib("43.91")
    assert log.total_gpu_memory_bytes == gib("44.4")
    assert log.gpu_memory_utilization == 0.9
    assert log.requested_memory_bytes == gib("39.96")
    assert log.weights_bytes == gib("13.72")
    assert log.activation_peak_bytes == gib("1.83")
    assert log.non_torch_bytes == gib("0.04")
    assert log.cuda_graph_bytes == 0  # "0.0 GiB for CUDAGraph memory"
    assert log.kv_cache_memory_bytes == gib("24.38")  # "Current kv cache memory in use"


def test_v1_non_default_args_and_banner_config():
    """``non-default args: {…}`` is a Python dict repr, read with ast.literal_eval."""
    log = parse("v1_non_default_args.log")
    assert (log.engine, log.version) == ("v1", "0.24.0")
    assert log.model == "~/.cache/huggingface/qwen3.6-35b-a3b-nvfp4"
    assert log.max_model_len == 131072
    assert log.kv_cache_dtype == "fp8"
    assert log.quantization == "modelopt"
    assert log.max_num_batched_tokens == 8192
    assert log.max_num_seqs == 1
    # Not in the args: vLLM's defaults applied, which the log does not state.
    assert log.tensor_parallel_size is None
    assert log.gpu_memory_utilization is None
    assert log.kv_cache_memory_bytes == gib("6.01")
    assert log.kv_cache_tokens == 569878
    assert (log.max_concurrency, log.max_concurrency_tokens_per_request) == (4.35, 131072)
    assert log.sources["max_model_len"] == "non-default args line (APIServer pid=1)"


def test_v1_engine_config_with_speculative_config():
    """The raw speculative config is kept; its own ``model=`` is not the served model."""
    log = parse("v1_engine_config_speculative.log", "v1_available_kv_cache.log")
    assert (log.engine, log.version) == ("v1", "0.27.2rc1.dev77+gac7509e2b")
    assert log.model == "/model"
    assert log.speculative_config == (
        "SpeculativeConfig(method='mtp', model='/model', num_spec_tokens=4)"
    )
    assert log.max_model_len == 100000
    assert (log.tensor_parallel_size, log.pipeline_parallel_size) == (1, 1)
    assert log.quantization == "auto_gptq"
    assert log.kv_cache_dtype == "fp8"
    assert log.enforce_eager is False


def test_a_restarted_server_keeps_the_last_start_up():
    """Two start-ups in one file: the later figures replace the earlier ones."""
    log = parse("v1_available_kv_cache.log", "v1_non_default_args.log")
    assert log.kv_cache_memory_bytes == gib("6.01")
    assert log.kv_cache_tokens == 569878


def test_several_start_ups_are_read_from_the_last_one_alone():
    """A figure only an earlier start-up printed is not mixed into the last one's.

    A server restarted with another model and flags, in one file: before, the first
    start-up's weights ("Model loading took") and sampler stood beside the last one's
    pool.
    """
    log = parse("v1_flashinfer_sampler_a100.log", "v1_two_startups_no_weights_line.log")
    assert log.startups == 3
    assert log.weights_bytes is None  # the last start-up printed only a duration
    assert log.sampler is None  # nor which top-k/top-p path it took
    assert log.kv_cache_tokens == 130986  # "130,986 tokens", the last start-up's
    assert log.max_concurrency == 4.00
    assert log.kv_cache_dtype == "fp8"
    assert log.version == "0.29.0"
    assert parse("v1_flashinfer_sampler_a100.log").startups == 1


def test_two_engines_in_one_file_without_a_config_line():
    """A disaggregated pair's two engines: the last one's figures, and its context."""
    log = parse("v1_two_engines_no_config_line.log")
    assert log.startups == 2
    assert log.kv_cache_tokens == 67520  # the prefill engine's, printed last
    assert log.max_concurrency == 8.24
    assert log.max_concurrency_tokens_per_request == 8192
    assert log.max_model_len is None  # no engine config line: the caller decides
    assert log.gpu_memory_utilization == 0.9  # "--gpu-memory-utilization=0.9000"


# ---------------------------------------------------------------- lines rendered from vLLM's source


def test_v0_blocks_line_names_the_platform_device():
    """V0's executor_base.py logs "# %s blocks" with current_platform.device_name (0.8.5).

    Rendered from that format string for ROCm (device_name "rocm"), with the figures
    of a public ROCm start-up whose repository could not be named.
    """
    log = parse_vllm_log(
        "INFO 12-31 08:01:48 [executor_base.py:112] # rocm blocks: 6495, # CPU blocks: 2340"
    )
    assert log.gpu_blocks == 6495
    assert log.engine == "v0"
    assert parse_vllm_log("# xpu blocks: 12, # CPU blocks: 3").gpu_blocks == 12


def test_memory_profiling_result_repr():
    """The DEBUG ``MemoryProfilingResult`` repr of vllm/utils/mem_utils.py.

    Rendered from the f-string of ``MemoryProfilingResult.__repr__`` (V1, the version
    with "non-torch forward increase memory", before "total consumed (from
    mem_get_info)" replaced it) with plausible numbers; no public log with a page to
    cite was found.
    """
    line = (
        "(EngineCore_DP0 pid=7) DEBUG 09-26 11:02:04 [gpu_worker.py:300] Memory profiling "
        "takes 17.96 seconds. Total non KV cache memory: 17.12GiB; torch peak memory "
        "increase: 1.89GiB; non-torch forward increase memory: 0.25GiB; weights memory: "
        "14.99GiB."
    )
    log = parse_vllm_log(line)
    assert log.activation_peak_bytes == gib("1.89")
    assert log.non_torch_bytes == gib("0.25")
    assert log.weights_bytes == gib("14.99")


def test_requested_memory_and_skipped_profiling_lines():
    """Two lines of vllm/v1/worker/gpu_worker.py (v0.11-v0.12), rendered from source.

    ``Initial free memory: %.2f GiB; Requested memory: %.2f (util), %.2f GiB`` (DEBUG)
    and the INFO line printed when ``--kv-cache-memory`` skips profiling, filled with
    plausible numbers; no public log with a page to cite was found.
    """
    log = parse_vllm_log(
        "DEBUG 12-01 19:49:02 [gpu_worker.py:276] Initial free memory: 78.50 GiB; "
        "Requested memory: 0.90 (util), 71.29 GiB\n"
    )
    assert log.free_gpu_memory_at_startup_bytes == gib("78.50")
    assert log.gpu_memory_utilization == 0.90
    assert log.requested_memory_bytes == gib("71.29")
    log = parse_vllm_log(
        "INFO 12-01 19:49:02 [gpu_worker.py:262] Initial free memory 78.50 GiB, reserved "
        "20.00 GiB memory for KV Cache as specified by kv_cache_memory_bytes config and "
        "skipped memory profiling. This does not respect the gpu_memory_utilization config."
    )
    assert log.kv_cache_memory_bytes == gib("20.00")


# ---------------------------------------------------------------- what the text may carry


def test_ansi_colours_windows_line_ends_and_compose_prefixes():
    """A log copied from a coloured terminal, a Windows editor or docker compose."""
    plain = parse("v1_available_kv_cache.log")
    lines = [line for line in read("v1_available_kv_cache.log").splitlines() if line[:1] != "#"]
    dressed = "\r\n".join(
        "vllm-1  | " + line.replace("INFO", "\x1b[32mINFO\x1b[0m") for line in lines
    )
    log = parse_vllm_log(dressed + "\r\n", source=plain.source)
    assert log == plain


def test_comment_lines_are_skipped():
    """A "#" line holding vLLM-looking text is a note, not a figure."""
    text = "# Available KV cache memory: 99.00 GiB\n" + read("v1_available_kv_cache.log")
    assert parse_vllm_log(text).kv_cache_memory_bytes == gib("6.51")


def test_a_broken_non_default_args_line_is_skipped():
    """A dict cut short in the paste is ignored, not an error."""
    line = next(
        line for line in read("v1_non_default_args.log").splitlines() if "non-default" in line
    )
    text = line[: line.index("'served_model_name'")] + "\n" + read("v1_available_kv_cache.log")
    log = parse_vllm_log(text)
    assert log.max_model_len is None
    assert log.kv_cache_memory_bytes == gib("6.51")


@pytest.mark.parametrize(
    "text",
    [
        "",
        "hello\nworld\n",
        "llama_kv_cache: size = 1024.00 MiB (  8192 cells,  32 layers)\n",
        # Configuration alone is not a measurement.
        "INFO 06-01 22:03:08 [api_server.py:1289] vLLM API server version 0.9.0.1\n",
    ],
)
def test_text_without_memory_figures_is_refused(text: str):
    """No memory figure at all: a clean one-line error naming the input."""
    with pytest.raises(InvalidInputError) as caught:
        parse_vllm_log(text, source="server.log")
    assert caught.value.field == "from_vllm_log"
    assert caught.value.value == "server.log"
    assert caught.value.allowed == NOT_A_VLLM_LOG
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("name", ["v0_engine_config.log", "v1_engine_config_speculative.log"])
def test_a_config_only_excerpt_is_refused(name: str):
    """Real vLLM lines, but none about memory: still refused."""
    with pytest.raises(InvalidInputError):
        parse(name)


def test_the_top_k_top_p_path_the_engine_took():
    """Whether vLLM 0.10 samples with FlashInfer or falls back to PyTorch's sort is read.

    The path sizes the profile run's sampler (about 14 against 38 bytes a logit), so
    a prediction from the log follows it. A log that says neither leaves it unknown.
    """
    assert parse("v1_flashinfer_sampler_a100.log").sampler == "flashinfer"
    # Two workers over Ray; the file is wrapped at 130 columns, so their warnings too.
    assert parse("v1_pytorch_sampler_ray_tp2.log").sampler == "pytorch"
    assert parse("v1_available_kv_cache.log").sampler is None
