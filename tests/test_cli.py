"""`kvguard budget` and the top-level command, as an operator runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvguard import __version__
from kvguard.cli import EXIT_BAD_INPUT, EXIT_DOES_NOT_FIT, EXIT_OK, main

KVGUARD = str(Path(sys.executable).parent / "kvguard")

JSON_KEYS = {
    "kv_bytes_per_token",
    "kv_bytes_per_token_per_gpu",
    "kv_bytes_per_sequence",
    "weights_bytes_per_gpu",
    "activation_bytes_per_gpu",
    "overhead_bytes_per_gpu",
    "kv_pool_bytes_per_gpu",
    "kv_capacity_tokens",
    "worst_case_kv_bytes_per_gpu",
    "max_concurrency",
    "max_model_len_at_concurrency",
    "fits",
    "headroom_bytes_per_gpu",
}


def run_json(capsys, *argv: str) -> dict:
    """Run `kvguard budget --json` in-process and parse what it printed."""
    assert main(["budget", *argv, "--json"]) == EXIT_OK
    return json.loads(capsys.readouterr().out)


def test_installed_entry_point_prints_a_table():
    """The console script runs the budget and prints the lines, verdict and fp8 comparison."""
    out = subprocess.run(
        [
            KVGUARD,
            "budget",
            "llama-3.1-8b",
            "--gpu",
            "H100-80GB",
            "--max-model-len",
            "32768",
            "--concurrency",
            "8",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for expected in (
        "KV per token     128.0 KiB whole model (131,072 B)",
        "weights",
        "KV cache pool",
        "Verdict          FITS",
        "Max concurrency",
        "Max context",
        "With fp8 KV      64.0 KiB per token",
    ):
        assert expected in out


def test_json_has_every_documented_key_with_integer_figures(capsys):
    """--json prints one object with the contract's keys; figures are integers."""
    data = run_json(capsys, "llama-3.1-70b", "--tp", "8", "--gpu", "H100-80GB")
    assert data.keys() >= JSON_KEYS
    assert data["kv_bytes_per_token"] == 327_680
    assert data["kv_bytes_per_token_per_gpu"] == 40_960
    for key in JSON_KEYS - {"fits"}:
        assert isinstance(data[key], int), key
    assert isinstance(data["fits"], bool)
    assert data["fp8"]["kv_bytes_per_token"] == 163_840


def test_json_figures_are_consistent(capsys):
    """Worst case = concurrency x per-sequence; headroom = pool - worst case when it fits."""
    data = run_json(
        capsys,
        "llama-3.1-8b",
        "--gpu-memory",
        "80GiB",
        "--concurrency",
        "3",
        "--max-model-len",
        "65536",
    )
    assert data["worst_case_kv_bytes_per_gpu"] == 3 * data["kv_bytes_per_sequence_per_gpu"]
    assert data["headroom_bytes_per_gpu"] == (
        data["kv_pool_bytes_per_gpu"] - data["worst_case_kv_bytes_per_gpu"]
    )
    assert data["kv_capacity_tokens"] == data["kv_pool_bytes_per_gpu"] // (16 * 131_072) * 16


def test_fixed_kv_pool_replaces_the_utilization(capsys):
    """--kv-cache-memory-bytes fixes the pool, as vLLM's flag does."""
    data = run_json(
        capsys, "llama-3.1-8b", "--kv-cache-memory-bytes", "2GiB", "--max-model-len", "4096"
    )
    assert data["kv_pool_bytes_per_gpu"] == 2 * 1024**3
    assert data["kv_capacity_tokens"] == 16_384
    assert data["max_concurrency"] == 4


def test_overrides_replace_the_estimates(capsys):
    """--activation-bytes and --overhead-bytes replace the documented estimates."""
    data = run_json(
        capsys, "llama-3.1-8b", "--activation-bytes", "3GiB", "--overhead-bytes", "2GiB"
    )
    assert data["activation_bytes_per_gpu"] == 3 * 1024**3
    assert data["overhead_bytes_per_gpu"] == 2 * 1024**3


def test_a_budget_that_does_not_fit_is_a_result_not_an_error(capsys):
    """Exit 0 without --check; exit 3 with it, saying by how much."""
    args = ["budget", "llama-3.1-70b", "--gpu", "L4", "--json"]
    assert main(args) == EXIT_OK
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is False
    assert data["headroom_bytes_per_gpu"] < 0
    assert main([*args, "--check"]) == EXIT_DOES_NOT_FIT
    assert "short by" in capsys.readouterr().err
    assert main(["budget", "llama-3.1-8b", "--gpu", "H100-80GB", "--check"]) == EXIT_OK


def test_table_says_does_not_fit_and_by_how_much(capsys):
    """The human verdict names the shortfall."""
    assert main(["budget", "llama-3.1-70b", "--gpu", "A100-80GB"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "DOES NOT FIT: short by" in out
    assert "OVERCOMMITTED" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["no/such/model"], "no such file or directory"),
        (["nonexistent-model-name"], "bundled: deepseek-v2-lite"),
        (["llama-3.1-8b", "--kv-cache-dtype", "fp6"], "--kv-cache-dtype: must be one of auto"),
        (["llama-3.1-8b", "--tp", "0"], "--tp: must be an integer from 1 to 1,000,000, got 0"),
        (["llama-3.1-8b", "--tp", "3"], "--tp: must divide num_attention_heads (32) evenly"),
        (["llama-3.1-8b", "--tp", "64"], "--tp: must divide num_attention_heads (32) evenly"),
        (["llama-3.1-8b", "--pp", "33"], "--pp: must be <= the number of layers (32)"),
        (
            ["llama-3.1-8b", "--max-model-len", "200000"],
            "must be <= the model's max_position_embeddings",
        ),
        (
            ["llama-3.1-8b", "--max-model-len", "1" + "0" * 400],
            "--max-model-len: must be an integer from 1",
        ),
        (
            ["llama-3.1-8b", "--concurrency", "1" + "0" * 400],
            "--concurrency: must be an integer from 1",
        ),
        (["llama-3.1-8b", "--concurrency", "-3"], "--concurrency: must be an integer from 1"),
        (["llama-3.1-8b", "--gpu-memory=-80GiB"], "--gpu-memory: must be a size"),
        (["llama-3.1-8b", "--gpu-memory", "0"], "--gpu-memory: must be a byte count from 1 to"),
        (["llama-3.1-8b", "--gpu", "H300"], "--gpu: must be one of H100-80GB"),
        (["llama-3.1-8b", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization: must be"),
        (["llama-3.1-8b", "--tp", "two"], "argument --tp: invalid int value"),
        (["llama-3.1-8b", "--gpu", "L4", "--gpu-memory", "24GiB"], "not allowed with argument"),
    ],
)
def test_bad_input_is_one_clear_line(capsys, argv, message):
    """Every bad input exits 2 with one line on stderr that names the problem."""
    try:
        code = main(["budget", *argv])
    except SystemExit as exc:  # argparse's own syntax errors exit from inside parse_args
        code = exc.code
    assert code == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1


def test_bad_files_fail_cleanly_without_traceback(tmp_path):
    """Invalid JSON, a config without the needed fields, a bad index: one line, exit 2."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"num_hidden_layers": 32,')
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"model_type": "llama", "hidden_size": 4096}))
    indexed = tmp_path / "indexed"
    indexed.mkdir()
    (indexed / "config.json").write_text(
        (Path(__file__).parents[1] / "kvguard/models/llama-3.1-8b/config.json").read_text()
    )
    (indexed / "model.safetensors.index.json").write_text('{"metadata": {}}')
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (broken, "invalid JSON at line 1"),
        (partial, "missing field 'num_hidden_layers'"),
        (indexed, "metadata.total_size"),
        (empty, "directory holds no config.json"),
    ]
    for path, message in cases:
        result = subprocess.run(
            [KVGUARD, "budget", str(path)], capture_output=True, text=True, check=False
        )
        assert result.returncode == EXIT_BAD_INPUT, path
        assert message in result.stderr
        assert "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_version_and_help_list_subcommands():
    """--version prints the version; --help lists each subcommand with a one-line summary."""
    version = subprocess.run([KVGUARD, "--version"], capture_output=True, text=True, check=True)
    assert version.stdout.strip() == f"kvguard {__version__}"
    helptext = subprocess.run([KVGUARD, "--help"], capture_output=True, text=True, check=True)
    assert "budget" in helptext.stdout
    assert "VRAM budget of serving a model" in helptext.stdout
