"""`kvguard budget` against real vLLM start-ups: --from-vllm-log, versions, speculation, sources."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvguard.cli.from_vllm_log import V0_RULE_VERSION, log_notes, logged_inputs
from kvguard.cli.main import EXIT_BAD_INPUT, EXIT_OK, main
from kvguard.core.budget import BudgetInputs
from kvguard.core.vllm_log import VllmStartupLog
from tests.helpers import strict_json

LOGS = Path(__file__).parent / "fixtures" / "budget" / "logs"
# vLLM 0.19 on an H100, Llama-3.1-8B, utilization 0.95, max_model_len 8,192 (llm-d-planner).
LLAMA_LOG = LOGS / "planner-llama31-8b-h100-tp1-8k.log"


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    """Run ``kvguard budget ARGV --json`` in-process and parse what it printed."""
    assert main(["budget", *argv, "--json"]) == EXIT_OK
    data: dict[str, object] = strict_json(capsys.readouterr().out)
    return data


def test_a_log_is_compared_figure_by_figure(capsys):
    """Each figure vLLM printed beside kvguard's prediction from the logged settings."""
    assert main(["budget", "llama-3.1-8b", "--from-vllm-log", str(LLAMA_LOG)]) == EXIT_OK
    out = capsys.readouterr().out
    assert "vLLM logged" in out
    assert "vLLM 0.19 (V1)" in out  # the version the log names picks the rule
    for figure in ("weights (GiB)", "activation peak (GiB)", "KV pool (GiB)", "KV tokens"):
        assert figure in out
    assert "What-if from the logged figures" in out


def test_the_json_holds_the_log_the_comparison_and_both_budgets(capsys):
    """Keys log, comparison, predicted and calibrated; the calibrated pool is vLLM's."""
    data = run_json(capsys, "llama-3.1-8b", "--from-vllm-log", str(LLAMA_LOG))
    log = data["log"]
    assert isinstance(log, dict)
    assert log["version"] == "0.19.0"
    rows = {row["figure"]: row for row in data["comparison"]}  # type: ignore[union-attr]
    pool = rows["KV pool (GiB)"]
    assert pool["logged"] == pytest.approx(58.11, abs=0.005)
    assert abs(pool["difference_pct"]) < 5
    calibrated = data["calibrated"]
    assert isinstance(calibrated, dict)
    # From vLLM's own weights, activation and non-torch figures, the pool is vLLM's.
    assert calibrated["kv_pool_bytes_per_gpu"] / 2**30 == pytest.approx(58.11, abs=0.02)
    assert calibrated["sources"]["activation"].startswith("measured (vLLM log")
    assert calibrated["weights_source"].startswith("measured (vLLM log")


def test_what_ifs_change_only_what_was_asked(capsys):
    """--max-model-len and --kv-cache-dtype answer from the measured figures."""
    base = run_json(capsys, "llama-3.1-8b", "--from-vllm-log", str(LLAMA_LOG))["calibrated"]
    asked = run_json(
        capsys,
        "llama-3.1-8b",
        "--from-vllm-log",
        str(LLAMA_LOG),
        "--max-model-len",
        "32K",
        "--kv-cache-dtype",
        "fp8",
    )["calibrated"]
    assert isinstance(base, dict)
    assert isinstance(asked, dict)
    assert (base["max_model_len"], asked["max_model_len"]) == (8192, 32_768)
    assert asked["kv_cache_dtype"] == "fp8"
    assert asked["kv_pool_bytes_per_gpu"] == base["kv_pool_bytes_per_gpu"]
    assert asked["kv_capacity_tokens"] == pytest.approx(2 * base["kv_capacity_tokens"], rel=1e-3)


def test_a_utilization_what_if_moves_the_pool_by_the_memory_it_adds(capsys):
    """0.95 to 0.90 of 79.19 GiB takes 3.96 GiB from the pool, nothing else."""
    base = run_json(capsys, "llama-3.1-8b", "--from-vllm-log", str(LLAMA_LOG))["calibrated"]
    lower = run_json(
        capsys,
        "llama-3.1-8b",
        "--from-vllm-log",
        str(LLAMA_LOG),
        "--gpu-memory-utilization",
        "0.9",
    )["calibrated"]
    assert isinstance(base, dict)
    assert isinstance(lower, dict)
    taken = (base["kv_pool_bytes_per_gpu"] - lower["kv_pool_bytes_per_gpu"]) / 2**30
    assert taken == pytest.approx(0.05 * 79.19, abs=0.01)


def test_a_file_that_is_not_a_vllm_log_is_one_line_and_exit_2(capsys, tmp_path):
    """No memory line: one line naming the flag and the file."""
    notes = tmp_path / "notes.txt"
    notes.write_text("hello\nworld\n")
    assert main(["budget", "llama-3.1-8b", "--from-vllm-log", str(notes)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "from_vllm_log" in err[0] or "--from-vllm-log" in err[0]
    missing = tmp_path / "absent.log"
    assert main(["budget", "llama-3.1-8b", "--from-vllm-log", str(missing)]) == EXIT_BAD_INPUT
    assert "cannot be read" in capsys.readouterr().err


def test_every_input_names_its_source(capsys):
    """Text and JSON say where weights, activation, overhead, batch and memory came from."""
    data = run_json(capsys, "llama-3.1-8b", "--gpu", "H100", "--engine-version", "0.19")
    sources = data["sources"]
    assert isinstance(sources, dict)
    assert sources["weights"] == "model.safetensors.index.json (exact)"
    assert sources["activation"].startswith("estimated: V1 profile, sampler over 1,024")
    assert sources["batch"].startswith("vLLM default for GPUs of 70 GiB")
    assert "H100-SXM preset" in sources["gpu_memory"]
    assert (data["max_num_batched_tokens"], data["max_num_seqs"]) == (8192, 1024)
    assert main(["budget", "llama-3.1-8b", "--gpu", "L4"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "Batch            2,048 tokens, 256 sequences" in out
    assert "Engine           vLLM 0.32 (V1), the default" in out


def test_a_drafter_adds_its_layers_to_the_pool(capsys):
    """An EAGLE-3 head is one more layer of Llama's KV shape: 33/32 of the bytes per token."""
    plain = run_json(capsys, "llama-3.1-8b", "--gpu", "H100")
    eagle = run_json(
        capsys,
        "llama-3.1-8b",
        "--gpu",
        "H100",
        "--speculative-config",
        json.dumps({"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"}),
    )
    assert eagle["kv_bytes_per_token"] == plain["kv_bytes_per_token"] * 33 // 32
    assert any("eagle3" in a for a in eagle["assumptions"])  # type: ignore[union-attr]
    layers = run_json(capsys, "llama-3.1-8b", "--gpu", "H100", "--speculative-layers", "1")
    assert layers["kv_bytes_per_token"] == eagle["kv_bytes_per_token"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--engine-version", "latest"], "--engine-version"),
        (["--speculative-config", "{eagle"], "--speculative-config: must be JSON"),
        (["--speculative-config", '{"method": "draft_model", "model": "x"}'], "own KV shape"),
    ],
)
def test_bad_engine_and_speculation_flags_are_one_clear_line(capsys, argv, says):
    """Bad input exits 2 with one line that names the flag."""
    assert main(["budget", "llama-3.1-8b", *argv]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert says in err
    assert len(err.strip().splitlines()) == 1


def test_a_log_that_sampled_with_flashinfer_is_predicted_with_its_lighter_profile(capsys):
    """A public vLLM 0.10.1.1 start-up on an A100-80GB at utilization 0.25: FlashInfer's sampler.

    Its profile held far less than PyTorch's sort would have; predicted with the path the
    log names, the pool lands within 5% of the 5.01 GiB it printed. The file is wrapped
    at 130 columns, its settings line too: the utilization is given as the flag.
    """
    log = Path(__file__).parent / "fixtures" / "vllm_logs" / "v1_flashinfer_sampler_a100.log"
    data = run_json(
        capsys,
        "qwen2.5-7b-instruct",
        "--gpu",
        "A100-80GB",
        "--gpu-memory-utilization",
        "0.25",
        "--from-vllm-log",
        str(log),
    )
    predicted = data["predicted"]
    assert isinstance(predicted, dict)
    assert "FlashInfer" in predicted["sources"]["activation"]
    pool = predicted["kv_pool_bytes_per_gpu"] / 2**30
    assert abs(pool - 5.01) <= 0.05 * 5.01, pool


VLLM_LOGS = Path(__file__).parent / "fixtures" / "vllm_logs"
# vLLM 0.29.0 on an L4, gpt-oss-20b, utilization 0.85: two start-ups, no "Model loading" line.
TWO_STARTUPS = VLLM_LOGS / "v1_two_startups_no_weights_line.log"
# vLLM 0.29.0 on L4s, Qwen3-8B-FP8: two engines, no engine config line, 8,192-token context.
TWO_ENGINES = VLLM_LOGS / "v1_two_engines_no_config_line.log"


def test_weights_the_log_did_not_measure_are_not_called_measured(capsys):
    """Without a "Model loading took" line the what-if's weights are kvguard's, and say so."""
    argv = ["gpt-oss-20b", "--gpu", "L4", "--from-vllm-log", str(TWO_STARTUPS)]
    data = run_json(capsys, *argv, "--gpu-memory-utilization", "0.85")
    calibrated, notes = data["calibrated"], data["notes"]
    assert isinstance(calibrated, dict)
    assert isinstance(notes, list)
    assert not calibrated["weights_source"].startswith("measured")
    assert calibrated["weights_source"].endswith("(the log has no model loading line)")
    assert any("no model loading line" in note for note in notes)
    assert any("2 start-ups" in note for note in notes)
    assert data["log"]["startups"] == 2  # type: ignore[index]
    assert main(["budget", *argv]) == EXIT_OK
    out = capsys.readouterr().out
    assert "Note: the file holds 2 start-ups" in out
    assert "4.00x" in out  # the concurrency as vLLM printed it, not "4"
    assert "(weights, activation and overhead as measured)" not in out


def test_the_context_comes_from_the_concurrency_line_and_an_unknown_gpu_is_said(capsys):
    """No engine config line: max_model_len is the Maximum concurrency line's 8,192."""
    data = run_json(capsys, "qwen3-8b", "--from-vllm-log", str(TWO_ENGINES))
    predicted, notes = data["predicted"], data["notes"]
    assert isinstance(predicted, dict)
    assert isinstance(notes, list)
    assert predicted["max_model_len"] == 8192  # not the model's own 40,960
    assert any("Maximum concurrency line" in note for note in notes)
    assert any("assumes 80 GiB" in note for note in notes)  # no --gpu, no memory line
    with_gpu = run_json(capsys, "qwen3-8b", "--gpu", "L4", "--from-vllm-log", str(TWO_ENGINES))
    assert not any("80 GiB" in note for note in with_gpu["notes"])  # type: ignore[union-attr]


def test_a_pool_without_a_breakdown_calibrates_the_overhead_and_says_it_was_derived(capsys):
    """V0 printed the total and the pool but no activation: the rest is derived, not measured."""
    log = LOGS / "vllm-10517-llama31-8b-rtx3090-20k.log"
    data = run_json(capsys, "llama-3.1-8b", "--gpu", "RTX-3090", "--from-vllm-log", str(log))
    calibrated, predicted = data["calibrated"], data["predicted"]
    assert isinstance(calibrated, dict)
    assert isinstance(predicted, dict)
    assert calibrated["sources"]["overhead"].startswith("derived from vLLM log")
    assert calibrated["sources"]["activation"].startswith("counted in the overhead")
    assert calibrated["sources"]["gpu_memory"].startswith("as logged")
    assert predicted["sources"]["gpu_memory"].startswith("as logged")
    # Its other notes: the context, which the log gives in no engine config line, and
    # the V0 rule its V0 lines call for though no version is printed.
    assert data["notes"] == [
        "max_model_len 20,000 is read from the Maximum concurrency line (the log has no"
        " engine config line)",
        "the log's engine is V0 (no version given): predicted with kvguard's V0 rule (that of 0.7)",
    ]


def test_tensor_parallelism_over_pcie_keeps_the_one_gpu_non_torch_memory(capsys):
    """L40S and A40 report the same 44.42 GiB; only the L40S is known to lack NVLink."""
    l40s = run_json(capsys, "llama-3.1-70b", "--gpu", "L40S", "--tp", "4")
    a40 = run_json(capsys, "llama-3.1-70b", "--gpu", "A40", "--tp", "4")
    assert "no NVLink" in l40s["sources"]["overhead"]  # type: ignore[index]
    assert "NVLink" not in a40["sources"]["overhead"]  # type: ignore[index]
    freed = a40["overhead_bytes_per_gpu"] - l40s["overhead_bytes_per_gpu"]  # type: ignore[operator]
    assert freed == pytest.approx((2.1 - 0.25) * 2**30, abs=2**20)  # vLLM 0.32's figures
    assert l40s["kv_pool_bytes_per_gpu"] > a40["kv_pool_bytes_per_gpu"]  # type: ignore[operator]
    one = run_json(capsys, "llama-3.1-8b", "--gpu", "L40S")
    assert "NVLink" not in one["sources"]["overhead"]  # type: ignore[index]


def test_the_l40s_tensor_parallel_start_up_is_predicted_within_target(capsys):
    """Issue 15815 of vLLM (V0 0.7.1, 2 x L40S): 0.30 GiB non-torch and a 7.71 GiB pool."""
    log = LOGS / "vllm-15815-qwen25-32b-l40s-tp2.log"
    model = str(LOGS.parent / "models" / "qwen2.5-32b-instruct")
    data = run_json(capsys, model, "--gpu", "L40S", "--from-vllm-log", str(log))
    rows = {row["figure"]: row for row in data["comparison"]}  # type: ignore[union-attr]
    assert rows["non-torch + graphs (GiB)"]["logged"] == pytest.approx(0.30)
    assert abs(rows["non-torch + graphs (GiB)"]["difference"]) < 0.1  # it was +1.8 GiB
    assert abs(rows["KV pool (GiB)"]["difference_pct"]) < 5  # it was -22%


def test_a_yarn_override_serves_past_the_models_own_limit(capsys):
    """Qwen3-30B-A3B at 131,072 tokens: refused as it ships, budgeted with YaRN x4."""
    model = str(LOGS.parent / "models" / "qwen3-30b-a3b")
    argv = ["budget", model, "--gpu", "H100", "--max-model-len", "128K"]
    assert main(argv) == EXIT_BAD_INPUT
    assert "context limit (40,960: max_position_embeddings)" in capsys.readouterr().err
    yarn = '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0,'
    yarn += ' "original_max_position_embeddings": 32768}}'
    data = run_json(capsys, *argv[1:], "--hf-overrides", yarn)
    assert data["max_model_len"] == 131072
    assert data["model"]["context_limit"] == 131072  # type: ignore[index]
    assert data["model"]["context_limit_source"].startswith("YaRN")  # type: ignore[index]


def test_a_v0_engine_of_a_v1_release_is_predicted_with_the_v0_rule():
    """0.8 to 0.10 fell back to V0 (ROCm, features V1 lacked): the log's engine decides."""
    given = BudgetInputs()
    v0 = VllmStartupLog(source="log", version="0.8.5", engine="v0", gpu_blocks=6495)
    assert logged_inputs(v0, given).engine_version == V0_RULE_VERSION
    assert any("V0 at vLLM 0.8.5" in note for note in log_notes(v0, given))
    v1 = VllmStartupLog(source="log", version="0.8.5", engine="v1", kv_cache_tokens=1)
    assert logged_inputs(v1, given).engine_version == "0.8.5"
    old = VllmStartupLog(source="log", version="0.7.1", engine="v0", gpu_blocks=1)
    assert logged_inputs(old, given).engine_version == "0.7.1"
    assert not any("V0 at" in note for note in log_notes(old, given))
