"""`kvguard budget`, `kvguard status` over several kvguards, and the top-level command."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from kvguard import __version__
from kvguard.api.app import build_app
from kvguard.cli import probe as probe_cli
from kvguard.cli import status as status_cli
from kvguard.cli.main import EXIT_BAD_INPUT, EXIT_DOES_NOT_FIT, EXIT_OK, build_parser, main
from kvguard.cli.probe import normalize_url
from kvguard.cli.status import FleetRow, fetch_fleet, fleet_row, pressure_lines, render_fleet
from kvguard.config.settings import parse_config
from kvguard.probes.engine import EngineProbe
from kvguard.probes.nvml import NvmlProbe
from kvguard.runtime.assembly import listen
from kvguard.runtime.daemon import Daemon
from kvguard.runtime.probing import Probes
from kvguard.testing import FakeGpu, FakeNvml
from tests.helpers import free_port, strict_json

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
    ("typed", "tokens"),
    [("32768", 32_768), ("32k", 32_000), ("32K", 32_768), ("128K", 131_072), ("25.6k", 25_600)],
)
def test_max_model_len_as_vllm_reads_it(capsys, typed, tokens):
    """--max-model-len takes vLLM's forms: k = 1000, K = 1024."""
    data = run_json(capsys, "llama-3.1-8b", "--max-model-len", typed)
    assert data["max_model_len"] == tokens


def test_max_num_batched_tokens_takes_the_same_forms(capsys):
    """--max-num-batched-tokens 16K is 16,384 tokens and 16k 16,000, as vLLM reads them."""
    small = run_json(capsys, "llama-3.1-8b", "--max-num-batched-tokens", "8K")
    large = run_json(capsys, "llama-3.1-8b", "--max-num-batched-tokens", "16K")
    assert small["inputs"]["max_num_batched_tokens"] == 8_192
    assert large["inputs"]["max_num_batched_tokens"] == 16_384
    decimal = run_json(capsys, "llama-3.1-8b", "--max-num-batched-tokens", "16k")
    assert decimal["inputs"]["max_num_batched_tokens"] == 16_000


@pytest.mark.parametrize(
    ("typed", "size"),
    [("24G", 24 * 1024**3), ("24Gi", 24 * 1024**3), ("24GiB", 24 * 1024**3), ("24g", 24 * 10**9)],
)
def test_sizes_as_people_type_them(capsys, typed, size):
    """24G means 24 GiB, as in `vllm serve --kv-cache-memory-bytes 24G`; 24g is decimal."""
    data = run_json(capsys, "llama-3.1-8b", "--kv-cache-memory-bytes", typed)
    assert data["kv_pool_bytes_per_gpu"] == size
    assert data["inputs"]["kv_cache_memory_bytes"] == size
    data = run_json(capsys, "llama-3.1-8b", "--gpu-memory", typed)
    assert data["gpu_memory_bytes"] == size


def test_gpu_aliases_as_nvidia_smi_prints_them(capsys):
    """--gpu takes the device name torch prints; the JSON names the canonical preset."""
    data = run_json(capsys, "llama-3.1-8b", "--gpu", "NVIDIA H100 80GB HBM3")
    assert data["inputs"]["gpu"] == "H100-SXM"
    assert (
        data["gpu_memory_bytes"]
        == run_json(capsys, "llama-3.1-8b", "--gpu", "h100")["gpu_memory_bytes"]
    )


def test_fixed_pool_table_does_not_measure_unallocated_against_the_gpu(capsys):
    """With --kv-cache-memory-bytes the utilization no longer applies: no such lines."""
    argv = ["budget", "llama-3.1-8b", "--gpu", "H100", "--kv-cache-memory-bytes", "24G"]
    assert main(argv) == EXIT_OK
    out = capsys.readouterr().out
    assert "fixed KV pool 24.0 GiB" in out
    assert "KV cache pool (fixed)" in out
    for absent in ("unallocated", "outside utilization", "gpu_memory_utilization", "OVERCOMMIT"):
        assert absent not in out
    # Without the flag, the utilization and what it leaves out are shown as before.
    assert main(["budget", "llama-3.1-8b", "--gpu", "H100"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "gpu_memory_utilization 0.9" in out
    assert "outside utilization" in out


def test_fixed_pool_that_overcommits_the_gpu_says_so(capsys):
    """A fixed pool larger than what the GPU has left: OVERCOMMITTED, does not fit."""
    argv = ["budget", "llama-3.1-8b", "--gpu", "L4", "--kv-cache-memory-bytes", "20G"]
    assert main(argv) == EXIT_OK
    out = capsys.readouterr().out
    assert "OVERCOMMITTED" in out
    assert "DOES NOT FIT" in out
    assert "unallocated" not in out


def test_header_names_the_weights_dtype_and_json_the_name(capsys):
    """DeepSeek-V3's fp8 checkpoint: weights fp8, compute bf16; model.name is filled."""
    assert main(["budget", "deepseek-v3", "--tp", "8", "--gpu", "H200"]) == EXIT_OK
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith("Model     deepseek-v3 (deepseek_v3, weights fp8, compute bf16)")
    data = run_json(capsys, "deepseek-v3", "--tp", "8", "--gpu", "H200")
    assert data["model"]["name"] == "deepseek-v3"
    assert data["model"]["weights_dtype"] == "fp8"
    assert data["model"]["dtype"] == "bf16"
    # An unquantized model keeps the short header and says its weights are bf16.
    assert main(["budget", "llama-3.1-8b"]) == EXIT_OK
    assert "(llama, bf16)" in capsys.readouterr().out.splitlines()[0]
    assert run_json(capsys, "llama-3.1-8b")["model"]["weights_dtype"] == "bf16"


def test_hf_id_from_the_local_cache(capsys, tmp_path, monkeypatch):
    """MODEL may be a Hugging Face id already in the cache; its name fills model.name."""
    snapshot = tmp_path / "models--meta-llama--Llama-3.1-8B-Instruct" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    config = json.loads(
        (Path(__file__).parents[1] / "kvguard/config/models/llama-3.1-8b/config.json").read_text()
    )
    config.pop("_name_or_path", None)
    (snapshot / "config.json").write_text(json.dumps(config))
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    data = run_json(capsys, "meta-llama/Llama-3.1-8B-Instruct", "--max-model-len", "8K")
    assert data["model"]["name"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert data["model"]["source"] == str(snapshot / "config.json")
    assert data["kv_bytes_per_token"] == 131_072


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
            "must be <= the model's context limit (131,072: max_position_embeddings)",
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
        (["llama-3.1-8b", "--gpu", "H300"], "--gpu: must be one of H100-SXM, H100-PCIE"),
        (["llama-3.1-8b", "--gpu", "A100"], "--gpu: is ambiguous: name one of A100-40GB"),
        (["llama-3.1-8b", "--gpu-memory", "24Q"], "--gpu-memory: must be a size like 80GiB"),
        (
            ["llama-3.1-8b", "--kv-cache-memory-bytes", "2 gigs"],
            "--kv-cache-memory-bytes: must be a size",
        ),
        (
            ["llama-3.1-8b", "--max-model-len", "1.5K"],
            "--max-model-len: decimals are not allowed with the binary suffix K",
        ),
        (["llama-3.1-8b", "--max-model-len", "32kb"], "--max-model-len: must be a whole number"),
        (["llama-3.1-8b", "--max-model-len", "auto"], "--max-model-len: must be a token count"),
        (["llama-3.1-8b", "--max-model-len=-1"], "--max-model-len: must be a token count"),
        (["llama-3.1-8b", "--max-model-len", "0"], "--max-model-len: must be an integer from 1"),
        (["llama-3.1-8b", "--max-model-len", "200K"], "context limit (131,072: max_position"),
        (["qwen3-8b", "--hf-overrides", "[1]"], "--hf-overrides: must be a JSON object"),
        (["qwen3-8b", "--hf-overrides", "{"], "--hf-overrides: must be JSON (Expecting"),
        (
            ["llama-3.1-8b", "--max-num-batched-tokens", "lots"],
            "--max-num-batched-tokens: must be a whole number like 32768",
        ),
        (["llama-3.1-8b", "--concurrency", "8k"], "argument --concurrency: invalid int value"),
        (["meta-llama/Not-Downloaded"], "models--meta-llama--Not-Downloaded/snapshots"),
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
        (Path(__file__).parents[1] / "kvguard/config/models/llama-3.1-8b/config.json").read_text()
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


# ------------------------------------------------------------------ status: the fleet view
GiB = 1024**3


async def start_kvguard(engine_url: str, gpu_free: list[int]) -> tuple[Daemon, web.AppRunner, str]:
    """A kvguard API on 127.0.0.1 over a real engine and fake GPUs with ``gpu_free`` bytes free."""
    gpus = [
        FakeGpu(f"Fake H100 {i}", f"GPU-{i:04d}", 80 * GiB, used_bytes=80 * GiB - free)
        for i, free in enumerate(gpu_free)
    ]
    config = parse_config({"engine": {"url": engine_url, "kind": "vllm"}}, env={})
    probes = Probes(
        engine=EngineProbe(engine_url, kind="vllm", timeout_s=2.0),
        nvml=NvmlProbe(nvml=FakeNvml(gpus)),
        host=None,
    )
    daemon = Daemon(config, probes=probes)
    for _ in range(2):
        await daemon.tick()
    runner = await listen(build_app(daemon), "127.0.0.1:0")
    return daemon, runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@pytest.fixture
async def fleet(sim_engine):
    """Two kvguards over two simulated engines (one with a nearly full GPU) and a dead URL."""
    started = []
    roomy = await start_kvguard(await sim_engine(), [40 * GiB, 40 * GiB])
    tight = await start_kvguard(await sim_engine(), [40 * GiB, 40 * GiB, 2 * GiB, 40 * GiB])
    started += [roomy, tight]
    dead = f"http://127.0.0.1:{free_port()}"
    yield roomy[2], tight[2], dead
    for daemon, runner, _ in started:
        await runner.cleanup()
        await daemon.close()


async def test_status_of_several_kvguards_ranks_them_worst_first(fleet):
    """Unreachable first (nothing is known), then the engine whose fullest GPU has least free."""
    roomy, tight, dead = fleet
    async with aiohttp.ClientSession() as session:
        rows = await asyncio.wait_for(fetch_fleet(session, [roomy, dead, tight]), 20)
    assert [r.url for r in rows] == [dead, tight, roomy]
    assert rows[0].error is not None
    assert "cannot read" in rows[0].error
    assert (rows[1].gpu_fullest, rows[1].gpu_free_bytes) == (2, 2 * GiB)
    assert rows[1].gpu_free_ratio == pytest.approx(2 / 80)
    assert (rows[2].gpu_free_ratio, rows[2].engine_kind, rows[2].engine_up) == (0.5, "vllm", True)
    lines = engine_lines(render_fleet(rows))
    assert lines[0].split()[:2] == ["KVGUARD", "LEVEL"]
    assert [line.split()[0] for line in lines[1:]] == [dead, tight, roomy]
    assert "UNREACHABLE" in lines[1]
    assert "2.0 GiB 2.5% (GPU 2)" in lines[2]
    assert lines[3].endswith("vllm up")
    # A long error is cut, so it does not widen the column for every row; watched,
    # the line says since when the engine is unreachable.
    rows[0] = dataclasses.replace(rows[0], error="cannot read " + "x" * 200)
    watched = engine_lines(render_fleet(rows, {dead: time.time() - 60}))
    assert len(watched[2]) < 180  # not 200 wide for the error alone
    assert re.search(r"UNREACHABLE +seen since \d\d:\d\d:\d\d: cannot read x+\u2026", watched[1])


def engine_lines(text: str) -> list[str]:
    """The fleet table's header and engine lines, without the indented detail lines."""
    return [line for line in text.splitlines() if not line.startswith(" ")]


async def test_status_command_with_several_urls_prints_one_line_each_and_exit_1(fleet):
    """`kvguard status --url A B --url C`: a line per engine, worst first; 1 when one is down."""
    roomy, tight, dead = fleet
    proc = await asyncio.create_subprocess_exec(
        KVGUARD, "status", "--url", roomy, tight, "--url", dead, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 1
    assert [line.split()[0] for line in engine_lines(out.decode())] == [
        "KVGUARD",
        dead,
        tight,
        roomy,
    ]
    proc = await asyncio.create_subprocess_exec(
        KVGUARD, "status", "--url", tight, roomy, "--json", stdout=asyncio.subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0
    doc = json.loads(out)
    assert [row["url"] for row in doc] == [tight, roomy]
    assert doc[0]["gpu_fullest"] == 2
    assert doc[0]["error"] is None


def row(url: str, **fields: object) -> FleetRow:
    """A reachable engine's fleet line, up, with the figures given."""
    return FleetRow(url=url, engine_up=True, **fields)  # type: ignore[arg-type]


def test_fleet_rank_orders_by_level_then_time_to_exhaustion_then_headroom():
    """Level decides first, then the soonest exhaustion, then the tightest headroom."""
    rows = [
        row("calm", level="ok", time_to_exhaustion_s=math.inf, kv_usage_ratio=0.2),
        row("full", level="ok", time_to_exhaustion_s=math.inf, kv_usage_ratio=0.7),
        row("filling-slow", level="ok", time_to_exhaustion_s=250.0, kv_usage_ratio=0.3),
        row("filling-fast", level="ok", time_to_exhaustion_s=40.0, kv_usage_ratio=0.3),
        row("gpu-tight", level="ok", time_to_exhaustion_s=math.inf, gpu_free_ratio=0.01),
        row("critical", level="critical", time_to_exhaustion_s=math.inf, kv_usage_ratio=0.98),
        row("high", level="high", time_to_exhaustion_s=30.0),
        row("down", level="ok"),
        FleetRow(url="blind", error="cannot read http://x/status: refused"),
        row("starting"),
    ]
    rows[7] = FleetRow(url="down", level="ok", engine_up=False)
    ranked = [r.url for r in sorted(rows, key=FleetRow.rank_key)]
    assert ranked == [
        "blind",
        "down",
        "critical",
        "high",
        "filling-fast",
        "filling-slow",
        "gpu-tight",
        "full",
        "calm",
        "starting",
    ]


def test_fleet_row_reads_the_sooner_resource_and_not_rising():
    """The sooner of KV and GPU exhaustion counts; a forecast of nulls is "not rising"."""
    doc = {
        "engine": {"kind": "vllm", "up": True, "kv_cache_usage_ratio": 0.5},
        "pressure": {
            "level": "elevated",
            "forecast": {"kv_time_to_exhaustion_s": 90.0, "gpu_time_to_exhaustion_s": 12.5},
        },
        "gpus": None,
    }
    line = fleet_row("http://a", doc)
    assert (line.time_to_exhaustion_s, line.exhausting) == (12.5, "gpu_memory")
    assert "12 s (gpu_memory)" in engine_lines(render_fleet([line]))[1]
    calm = fleet_row("http://b", doc | {"pressure": {"level": "ok", "forecast": {}}})
    assert calm.time_to_exhaustion_s == math.inf
    assert "not rising" in render_fleet([calm])
    assert calm.as_dict()["time_to_exhaustion_s"] is None
    assert calm.as_dict()["rising"] is False
    fresh = fleet_row("http://c", {"engine": None, "pressure": None, "gpus": None})
    assert fresh.time_to_exhaustion_s is None
    assert "unknown" in render_fleet([fresh])


def test_status_binding_is_what_binds_and_exhausts_first_is_what_runs_out_soonest():
    """The Pressure line: `binding` is pressure.binding_resource, not the soonest exhaustion.

    A cache filling while compute binds (requests queue with room in the cache) says
    both; a forecast of nulls (not rising) says nothing exhausts, whatever binds.
    """
    doc = {
        "engine": {"kind": "vllm", "up": True, "kv_cache_usage_ratio": 0.6},
        "pressure": {
            "level": "elevated",
            "level_for_s": 4.0,
            "binding_resource": "compute",
            "pattern": "steady",
            "forecast": {"kv_time_to_exhaustion_s": 42.7, "gpu_time_to_exhaustion_s": None},
        },
        "gpus": None,
    }
    first = pressure_lines(doc)[0]
    assert first.startswith("Pressure elevated for 4 s  binding compute  ")
    assert "  exhausts first kv_cache in 42 s  " in first
    full = doc | {
        "pressure": doc["pressure"]
        | {"binding_resource": "kv_cache", "forecast": {"kv_time_to_exhaustion_s": None}}
    }
    first = pressure_lines(full)[0]
    assert "  binding kv_cache  exhausts first nothing (not rising)  pattern steady" in first


# What a kvguard under pressure says in /status: what binds, the pattern, the
# mitigations in force and the decisions, newest first.
SHED = {"kind": "shed", "reason": "high pressure, bursty_short traffic", "priority": "sheddable"}
PRESSED = {
    "level": "high",
    "binding_resource": "kv_cache",
    "pattern": "bursty_short",
    "active": [
        SHED,
        {"kind": "tighten_window", "reason": SHED["reason"], "max_prompt_tokens": 2048},
    ],
    "decisions": [
        {
            "previous_level": "elevated",
            "level": "high",
            "pattern": "bursty_short",
            "crossed": ["high: kv_usage 0.930 >= 0.900"],
            "actions": [SHED],
        },
        {"previous_level": "ok", "level": "elevated", "crossed": ["elevated: x"], "actions": []},
    ],
}
PRESSED_DETAILS = [
    "    binding kv_cache  pattern bursty_short"
    "  active shed priority=sheddable, tighten_window max_prompt_tokens=2048",
    "    last elevated -> high: kv_usage 0.930 >= 0.900; high pressure, bursty_short traffic",
]


def test_fleet_row_carries_binding_pattern_mitigations_and_last_decision():
    """Each engine's line is followed by what binds, the pattern, what is done and why.

    The same words as the single view's Pressure, Active and Last lines; none of it
    for a kvguard that has not decided yet, binding and pattern unknown while the
    engine is not read, and a last decision too long for 120 columns cut there.
    """
    doc = {
        "engine": {"kind": "vllm", "up": True, "kv_cache_usage_ratio": 0.93},
        "pressure": PRESSED | {"forecast": {"kv_time_to_exhaustion_s": 30.0}},
        "gpus": None,
    }
    line = fleet_row("http://a", doc)
    assert (line.binding, line.pattern) == ("kv_cache", "bursty_short")
    assert line.active == ("shed priority=sheddable", "tighten_window max_prompt_tokens=2048")
    assert line.last_decision == PRESSED_DETAILS[1].removeprefix("    last ")
    assert f"Last     {line.last_decision}" in pressure_lines(doc)
    assert render_fleet([line]).splitlines()[2:] == PRESSED_DETAILS
    data = json.loads(json.dumps(line.as_dict()))
    assert data["binding"] == "kv_cache"
    assert data["pattern"] == "bursty_short"
    assert data["active"] == list(line.active)
    assert data["last_decision"] == line.last_decision

    calm = fleet_row("http://b", doc | {"pressure": {"level": "ok", "pattern": "steady"}})
    assert render_fleet([calm]).splitlines()[2:] == [
        "    binding unknown  pattern steady  active none"
    ]
    starting = fleet_row("http://c", {"engine": None, "pressure": None, "gpus": None})
    assert len(render_fleet([starting]).splitlines()) == 2  # header and its line
    unread = fleet_row("http://d", doc | {"sources": {"engine": {"ok": False, "age_s": 9.0}}})
    assert (unread.binding, unread.pattern, unread.time_to_exhaustion_s) == (None, None, None)
    assert (
        render_fleet([unread])
        .splitlines()[2]
        .startswith("    binding unknown  pattern unknown  active shed")
    )
    long = FleetRow(url="http://e", engine_up=True, level="high", last_decision="x" * 300)
    cut = render_fleet([long]).splitlines()[-1]
    assert (len(cut), cut[-1]) == (120, "\u2026")


async def serve_status(doc: dict) -> web.AppRunner:
    """A loopback server whose GET /status answers ``doc`` (its URL: ``status_url``)."""

    async def status(_: web.Request) -> web.Response:
        return web.json_response(doc)

    app = web.Application()
    app.router.add_get("/status", status)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


def status_url(runner: web.AppRunner) -> str:
    """Where :func:`serve_status`'s server listens."""
    return f"http://127.0.0.1:{runner.addresses[0][1]}"


async def test_status_fleet_shows_binding_pattern_mitigations_and_last_reason(fleet):
    """`kvguard status --url A B`: under each engine's line, binding, pattern, mitigations, why.

    A kvguard at high (a real /status with the pressure of one shedding) and an idle
    one: the text view and the --json rows both carry them.
    """
    roomy, _, _ = fleet
    async with aiohttp.ClientSession() as http, http.get(f"{roomy}/status") as resp:
        idle = await resp.json()
    pressed = await serve_status(idle | {"pressure": idle["pressure"] | PRESSED})
    try:
        busy = status_url(pressed)
        proc = await asyncio.create_subprocess_exec(
            KVGUARD, "status", "--url", roomy, busy, stdout=asyncio.subprocess.PIPE
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0
        lines = out.decode().splitlines()
        assert lines[1].split()[:2] == [busy, "high"]  # worst first
        assert lines[2:4] == PRESSED_DETAILS
        assert lines[4].split()[:2] == [roomy, "ok"]
        binding = idle["pressure"]["binding_resource"]
        assert lines[5] == (
            f"    binding {binding}  pattern {idle['pressure']['pattern']}  active none"
        )
        assert all(len(line) <= 120 for line in lines)
        proc = await asyncio.create_subprocess_exec(
            KVGUARD, "status", "--url", roomy, busy, "--json", stdout=asyncio.subprocess.PIPE
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0
        rows = json.loads(out)
        assert [row["url"] for row in rows] == [busy, roomy]
        assert {k: rows[0][k] for k in ("binding", "pattern", "active", "last_decision")} == {
            "binding": "kv_cache",
            "pattern": "bursty_short",
            "active": ["shed priority=sheddable", "tighten_window max_prompt_tokens=2048"],
            "last_decision": PRESSED_DETAILS[1].removeprefix("    last "),
        }
        assert (rows[1]["binding"], rows[1]["active"]) == (binding, [])
    finally:
        await pressed.cleanup()


# ------------------------------------------------ status and probe: the default config
@pytest.fixture
def default_config(tmp_path, monkeypatch) -> Path:
    """The default config path pointed at a file in tmp_path (not written), no $KVGUARD_CONFIG."""
    path = tmp_path / "etc-kvguard.toml"
    monkeypatch.setattr(probe_cli, "DEFAULT_CONFIG_PATH", str(path))
    monkeypatch.delenv("KVGUARD_CONFIG", raising=False)
    return path


def test_status_and_probe_read_the_default_config_when_it_exists(default_config, capsys):
    """Without --config and $KVGUARD_CONFIG, the service's config file when it is there.

    status reads its [server] listen (and nothing else: the engine's token is a
    systemd credential only the service can read); probe its [engine].
    """
    port, engine_port = free_port(), free_port()
    default_config.write_text(
        f'[engine]\nurl = "http://127.0.0.1:{engine_port}"\n'
        f'token_file = "{default_config.parent}/only-the-service-reads-this"\n'
        f'[server]\nlisten = "0.0.0.0:{port}"\n'
    )
    assert main(["status"]) == 1  # read the file; nothing listens there
    err = capsys.readouterr().err
    assert err.startswith(f"kvguard status: cannot read http://127.0.0.1:{port}/status:")
    default_config.write_text(f'[engine]\nurl = "http://127.0.0.1:{engine_port}"\n')
    assert main(["probe", "--json"]) == 1  # the engine of the file, not answering
    assert json.loads(capsys.readouterr().out)["engine"]["url"] == (
        f"http://127.0.0.1:{engine_port}"
    )


def test_the_default_config_is_ignored_when_absent(default_config, capsys):
    """No file there: status asks 127.0.0.1:9108, probe wants --engine-url, as before."""
    assert not default_config.exists()
    args = build_status_args()
    assert status_cli._own_url(args) == status_cli.DEFAULT_STATUS_URL
    assert main(["probe"]) == EXIT_BAD_INPUT
    assert "kvguard probe: error: --engine-url: needed without --config" in capsys.readouterr().err


def build_status_args(*argv: str) -> argparse.Namespace:
    """`kvguard status ARGV` parsed."""
    return build_parser().parse_args(["status", *argv])


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[server\n", "file: must be valid TOML"),
        ('[server]\nlisten = "127.0.0.1"\n', 'server.listen: must be "HOST:PORT"'),
    ],
)
def test_a_broken_default_config_exits_1_naming_the_file(default_config, capsys, text, problem):
    """An invalid default file: an error naming it and what to do instead, exit 1.

    Not 2: nobody typed it. --url does without it, $KVGUARD_CONFIG comes first, and
    a broken --config stays a usage error (2).
    """
    default_config.write_text(text)
    assert main(["status"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"kvguard status: error: {default_config}: {problem}")
    assert err[1] == (
        f"kvguard status: {default_config} is read when neither --config nor $KVGUARD_CONFIG"
        " says which config: fix it, or give --url, --config or $KVGUARD_CONFIG"
    )
    if problem.startswith("file"):  # probe reads the whole file: only a TOML error is one
        assert main(["probe"]) == 1
        err = capsys.readouterr().err.splitlines()
        assert err[0].startswith(f"kvguard probe: error: {default_config}: {problem}")
        assert err[1].endswith("fix it, or give --engine-url, --config or $KVGUARD_CONFIG")
    dead = f"127.0.0.1:{free_port()}"
    assert main(["status", "--url", dead]) == 1
    assert "cannot read" in capsys.readouterr().err
    assert main(["status", "--config", str(default_config)]) == 1  # invalid, as run says
    assert capsys.readouterr().err.startswith(f"kvguard status: error: {default_config}: ")


def test_kvguard_config_comes_before_the_default(default_config, tmp_path, monkeypatch):
    """$KVGUARD_CONFIG set: the default file is not read, even a broken one."""
    default_config.write_text("[server\n")
    chosen = tmp_path / "chosen.toml"
    chosen.write_text('[server]\nlisten = "127.0.0.1:9200"\n')
    monkeypatch.setenv("KVGUARD_CONFIG", str(chosen))
    assert status_cli._own_url(build_status_args()) == "http://127.0.0.1:9200"
    assert status_cli._own_url(build_status_args("--config", str(chosen))) == (
        "http://127.0.0.1:9200"
    )


# ---------------------------------------------------------------- --url: which addresses
PORT_NEEDED = (
    "has no port: give HOST:PORT, or a URL with its scheme (http://HOST means port 80,"
    " https://HOST port 443)"
)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["status", "--url", "127.0.0.1"], "--url"),
        (["status", "--url", "localhost/"], "--url"),
        (["status", "--url", "127.0.0.1:9108", "[::1]"], "--url"),
        (["probe", "--engine-url", "127.0.0.1"], "--engine-url"),
    ],
)
def test_a_bare_host_without_port_is_a_usage_error(capsys, argv, flag):
    """HOST without :PORT nor scheme would read port 80: exit 2 naming flag and value."""
    assert main(argv) == EXIT_BAD_INPUT
    assert capsys.readouterr().err == (
        f"kvguard {argv[0]}: error: {flag}: {PORT_NEEDED}, got {argv[-1]!r}\n"
    )


def test_a_url_with_a_scheme_may_leave_the_port_to_it():
    """http://HOST (behind a proxy, say) is the scheme's port: allowed, as before."""
    assert normalize_url("http://kvguard.internal/") == "http://kvguard.internal"
    assert normalize_url("https://kvguard.internal") == "https://kvguard.internal"
    assert normalize_url("127.0.0.1:9108/") == "http://127.0.0.1:9108"


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["status", "--url", "nope://x"], "--url"),
        (["status", "--url", "127.0.0.1:9108", "ftp://h:1"], "--url"),
        (["status", "--url", "http://"], "--url"),
        (["status", "--url", "127.0.0.1:99999"], "--url"),
        (["probe", "--engine-url", "nope://x"], "--engine-url"),
        (["probe", "--engine-url", "unix:///run/vllm.sock"], "--engine-url"),
    ],
)
def test_an_unsupported_url_is_a_usage_error_naming_the_flag(capsys, argv, flag):
    """`status --url`, `probe --engine-url`: another scheme, no host or a bad port: exit 2.

    One line naming the flag, the value and what is allowed; nothing is read first.
    """
    assert main(argv) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    value = argv[-1]
    assert err == (
        f"kvguard {argv[0]}: error: {flag}: must be an http:// or https:// URL with a host,"
        f" or HOST:PORT without a scheme (http:// is assumed), got {value!r}\n"
    )


# ---------------------------------------------------------------- secret files' modes
HOOK_SECRET = "0123456789abcdef0123456789abcdef-hook"


def secret_config(folder: Path, token_mode: int, hook_mode: int, extra: str = "") -> Path:
    """A config whose engine token and webhook secret files have these modes."""
    (folder / "engine.token").write_text("engine-token-5150\n")
    (folder / "engine.token").chmod(token_mode)
    (folder / "hook.secret").write_text(HOOK_SECRET + "\n")
    (folder / "hook.secret").chmod(hook_mode)
    path = folder / "kvguard.toml"
    path.write_text(
        '[engine]\nurl = "http://127.0.0.1:8000"\ntoken_file = "engine.token"\n'
        '[webhook]\nsecret_file = "hook.secret"\n' + extra
    )
    return path


def test_check_config_warns_of_secret_files_others_can_read(tmp_path, capsys):
    """A line per file group or others may read (0640, 0644), exit 0; none for 0600."""
    path = secret_config(tmp_path, token_mode=0o644, hook_mode=0o640)
    assert main(["check-config", str(path)]) == EXIT_OK
    out, err = capsys.readouterr()
    assert f"{path}: OK" in out
    assert err.splitlines() == [
        f"kvguard check-config: warning: {path}: engine.token_file: must be readable by its"
        " owner only, not mode 0644 (`chmod 600` it, or `chmod 400`), got 'engine.token'",
        f"kvguard check-config: warning: {path}: webhook.secret_file: must be readable by its"
        " owner only, not mode 0640 (`chmod 600` it, or `chmod 400`), got 'hook.secret'",
    ]
    assert "engine-token-5150" not in out + err
    assert HOOK_SECRET not in out + err
    path = secret_config(tmp_path, token_mode=0o600, hook_mode=0o600)
    assert main(["check-config", str(path), "--strict-secrets"]) == EXIT_OK
    assert capsys.readouterr().err == ""


def test_strict_secrets_refuses_every_exposed_file(tmp_path, capsys):
    """check-config and run with --strict-secrets: exit 1, one error per file, nothing started."""
    path = secret_config(tmp_path, token_mode=0o644, hook_mode=0o644)
    # An invalid config is 1 for both (2 is a usage error).
    for command in (["check-config", str(path)], ["run", "--config", str(path)]):
        assert main([*command, "--strict-secrets"]) == 1
        out, err = capsys.readouterr()
        assert out == ""
        name = command[0]
        assert [line.split(": ")[2:4] for line in err.splitlines()] == [
            [str(path), "engine.token_file"],
            [str(path), "webhook.secret_file"],
        ], err
        assert all(line.startswith(f"kvguard {name}: error: ") for line in err.splitlines())
        assert HOOK_SECRET not in err


async def read_log(proc: asyncio.subprocess.Process, until: str, timeout: float = 15) -> list[dict]:
    """JSON log events from ``proc``'s stderr, up to the first ``until`` event."""
    assert proc.stderr is not None
    events: list[dict] = []
    async with asyncio.timeout(timeout):
        while not events or events[-1]["event"] != until:
            line = await proc.stderr.readline()
            assert line, f"kvguard exited before {until!r}: {events}"
            events.append(strict_json(line))
    return events


async def test_run_logs_exposed_secret_files_and_strict_reload_refuses_them(sim_engine, tmp_path):
    """The real command: a warning per exposed file at start; --strict-secrets on SIGHUP refuses."""
    engine_url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048)
    listen = f'[server]\nlisten = "127.0.0.1:{free_port()}"\n[log]\nformat = "json"\n'
    path = secret_config(tmp_path, token_mode=0o600, hook_mode=0o644, extra=listen)
    path.write_text(path.read_text().replace("http://127.0.0.1:8000", engine_url))

    proc = await asyncio.create_subprocess_exec(
        KVGUARD, "run", "--config", str(path), stderr=asyncio.subprocess.PIPE
    )
    try:
        events = await read_log(proc, until="started")
        exposed = [e for e in events if e["event"] == "secret_file_exposed"]
        assert [(e["field"], e["path"], e["mode"], e["level"]) for e in exposed] == [
            ("webhook.secret_file", "hook.secret", "0644", "warning")
        ]
        assert HOOK_SECRET not in json.dumps(events)
    finally:
        proc.terminate()
        await proc.wait()

    (tmp_path / "hook.secret").chmod(0o600)
    proc = await asyncio.create_subprocess_exec(
        KVGUARD, "run", "--strict-secrets", "--config", str(path), stderr=asyncio.subprocess.PIPE
    )
    try:
        events = await read_log(proc, until="started")
        assert "secret_file_exposed" not in [e["event"] for e in events]
        (tmp_path / "engine.token").chmod(0o640)
        proc.send_signal(signal.SIGHUP)
        rejected = (await read_log(proc, until="config_reload_rejected"))[-1]
        assert rejected["problems"] == [
            "engine.token_file: must be readable by its owner only, not mode 0640"
            " (`chmod 600` it, or `chmod 400`), got 'engine.token'"
        ]
    finally:
        proc.terminate()
        assert await proc.wait() == 0


def _reader_gone(argv: list[str]) -> tuple[int, bytes]:
    """Run ``kvguard ARGV`` with its stdout's reader gone before the first byte."""
    reader = subprocess.Popen([KVGUARD, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert reader.stdout is not None
    reader.stdout.close()
    _, err = reader.communicate(timeout=30)
    return reader.returncode, err


def test_a_reader_that_stops_early_gets_no_traceback():
    """`kvguard budget --json | head -c 1`: exit 141 (SIGPIPE's code), nothing on stderr."""
    code, err = _reader_gone(["budget", "llama-3.1-70b", "--gpu", "H100-80GB", "--json"])
    assert code == 141, err
    assert b"Traceback" not in err
    assert b"BrokenPipeError" not in err


async def test_probe_and_status_piped_to_a_reader_that_stops_get_no_traceback(sim_engine):
    """`kvguard probe … --json | head` and `kvguard status --json | head`: the issue's pipes."""
    url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048)
    daemon, runner, status_url = await start_kvguard(url, [40 * GiB])
    try:
        for argv in (
            ["probe", "--engine-url", url, "--json"],
            ["status", "--url", status_url, "--json"],
        ):
            code, err = await asyncio.to_thread(_reader_gone, argv)
            assert code == 141, (argv, err)
            assert b"Traceback" not in err, argv
    finally:
        await runner.cleanup()
        await daemon.close()


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        ('[engine]\nurl = "nope"\n', "engine.url: must be an http(s) URL"),
        (
            '[engine]\nurl = "http://127.0.0.1:1"\n[model]\nconfig = "llama-3.1-8b"\n'
            "max_model_len = 9999999\n",
            "model.max_model_len: must be <= the model's context limit",
        ),
        (None, "file: must be readable"),
    ],
    ids=["bad-field", "bad-model-setting", "missing-file"],
)
def test_run_exits_1_for_an_invalid_config_as_check_config_does(tmp_path, capsys, config, problem):
    """A bad field, a model that cannot be budgeted, a missing file: run and check-config exit 1.

    The same lines on stderr, under each command's name; nothing is started.
    """
    path = tmp_path / "kvguard.toml"
    if config is not None:
        path.write_text(config)
    errors = {}
    for argv in (["check-config", str(path)], ["run", "--config", str(path)]):
        assert main(argv) == 1, argv
        out, err = capsys.readouterr()
        assert out == ""
        errors[argv[0]] = err.replace(f"kvguard {argv[0]}: ", "kvguard COMMAND: ")
    assert errors["run"] == errors["check-config"]
    assert f"kvguard COMMAND: error: {path}: {problem}" in errors["run"]


def test_run_usage_errors_exit_2_and_its_help_says_the_codes(tmp_path, capsys, monkeypatch):
    """No config named, or supervisor mode without the engine command: 2; --help lists 0/1/2."""
    monkeypatch.delenv("KVGUARD_CONFIG", raising=False)
    assert main(["run"]) == EXIT_BAD_INPUT
    assert "--config: give a config file or set KVGUARD_CONFIG" in capsys.readouterr().err
    path = tmp_path / "kvguard.toml"
    path.write_text('[engine]\nurl = "http://127.0.0.1:1"\n[reconfigure]\nmode = "supervisor"\n')
    assert main(["run", "--config", str(path)]) == EXIT_BAD_INPUT
    assert "needs the engine command" in capsys.readouterr().err
    helptext = subprocess.run(
        [KVGUARD, "run", "--help"], capture_output=True, text=True, check=True
    ).stdout
    flat = " ".join(helptext.split())
    assert "Exit 0: stopped by SIGTERM or SIGINT; 1: the config is invalid" in flat
    assert "2: a usage error" in flat


def test_the_default_utilization_and_sampler_follow_the_engine_version(capsys):
    """Not given, the utilization is vLLM's own for the release; --sampler sizes the profile."""
    current = run_json(capsys, "llama-3.1-8b", "--gpu", "H100")
    assert current["inputs"]["gpu_memory_utilization"] == 0.92
    older = run_json(capsys, "llama-3.1-8b", "--gpu", "H100", "--engine-version", "0.19")
    assert older["inputs"]["gpu_memory_utilization"] == 0.9
    given = run_json(capsys, "llama-3.1-8b", "--gpu", "H100", "--gpu-memory-utilization", "0.8")
    assert given["inputs"]["gpu_memory_utilization"] == 0.8
    sort = run_json(capsys, "llama-3.1-8b", "--gpu", "H100", "--engine-version", "0.11")
    flashinfer = run_json(
        capsys,
        "llama-3.1-8b",
        "--gpu",
        "H100",
        "--engine-version",
        "0.11",
        "--sampler",
        "flashinfer",
    )
    assert "PyTorch sort" in sort["sources"]["activation"]
    assert "FlashInfer top-k/top-p (given)" in flashinfer["sources"]["activation"]
    assert flashinfer["activation_bytes_per_gpu"] < sort["activation_bytes_per_gpu"] / 2
    assert flashinfer["kv_pool_bytes_per_gpu"] > sort["kv_pool_bytes_per_gpu"]
    with pytest.raises(SystemExit) as exited:
        main(["budget", "llama-3.1-8b", "--sampler", "fast"])
    assert exited.value.code == 2
    assert "--sampler" in capsys.readouterr().err


@pytest.mark.parametrize("interval", ["0", "-1", "nan", "abc", "3601"])
def test_status_refuses_a_refresh_period_it_could_not_keep(interval, capsys):
    """``--interval 0`` would redraw as fast as /status answers: a usage error, exit 2."""
    with pytest.raises(SystemExit) as exc:
        main(["status", "--watch", "--interval", interval])
    assert exc.value.code == 2
    assert "--interval: must be a number of seconds over 0" in capsys.readouterr().err


def test_an_unknown_flag_points_at_the_commands_own_help(capsys):
    """``kvguard run --bogus`` names ``kvguard run --help``, where the flags are listed."""
    with pytest.raises(SystemExit) as exc:
        main(["run", "--bogus"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --bogus (see kvguard run --help)" in err
    with pytest.raises(SystemExit):
        main(["--bogus", "status"])  # before the command's name: kvguard's own
    assert "kvguard: error: unrecognized arguments: --bogus (see kvguard --help)" in (
        capsys.readouterr().err
    )
