"""The GPU check (scripts/gpu-check.sh, bench/gpu_check.py) in fake mode, as CI runs it.

The fake run is the real driver end to end: kvguard's daemon and its HTTP API on
127.0.0.1 watching the fake NVML, a load whose KV grows through a simulated CUDA
caching allocator until it runs out, on an injected clock (a minute of filling
takes about a second). The real-GPU run is owed (docs/gpu-check.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvguard.runtime.decision
from bench.gpu_check import (
    FakeClock,
    Settings,
    SimulatedBackend,
    check,
    guard_config,
    main,
    to_toml,
)
from bench.gpu_load import KvLoad, KvShape, LoadError, run_until_oom
from bench.gpu_report import compare_probe, parse_nvidia_smi
from kvguard.config.model_files import BUNDLED_MODELS_DIR
from kvguard.config.settings import load_config
from kvguard.core.forecast import ResourceForecast
from kvguard.testing import (
    FakeGpu,
    FakeNvml,
    FakeOutOfMemoryError,
    SimulatedAllocator,
    nvidia_smi_csv,
)

ROOT = Path(__file__).resolve().parents[1]
GiB, MiB = 2**30, 2**20
LLAMA_8B = BUNDLED_MODELS_DIR / "llama-3.1-8b"

# What a real driver printed for `nvidia-smi --query-gpu=index,memory.total,memory.used
# --format=csv` on an idle H100 (80 GB HBM3) and a busy one.
REAL_SMI = (
    "index, memory.total [MiB], memory.used [MiB]\n0, 81559 MiB, 0 MiB\n1, 81559 MiB, 70452 MiB\n"
)


async def test_fake_run_sees_the_oom_coming_and_agrees_with_the_load(tmp_path):
    """Every check passes: lead time before the OOM, bytes per token, NVML vs nvidia-smi."""
    report, path = await check(Settings(fake=True, fill_s=60.0, out=str(tmp_path)))
    events, checks = report["events"], report["checks"]
    assert report["passed"], checks
    assert events["load_end"] == "oom"
    # The load fills ~22 GiB in ~60 s; kvguard's forecast crosses 30 s and 10 s to
    # exhaustion before the allocator fails, by about those margins.
    assert 50 < events["oom_at_s"] < 70
    assert 0 < events["first_tte_under_30s_at_s"] < events["first_tte_under_10s_at_s"]
    assert events["first_tte_under_10s_at_s"] < events["oom_at_s"]
    assert 20 < events["lead_time_30s_s"] < 40
    assert 5 < events["lead_time_10s_s"] < 15
    assert report["bytes_per_token"] == {
        "kvguard": 131_072,
        "load_measured": 131_072,
        "load_shape": 131_072,
        "difference_ratio": 0.0,
    }
    gpu = report["probe"]["gpus"][0]
    assert (gpu["nvml_total_bytes"], gpu["smi_total_bytes"]) == (24 * GiB, 24 * GiB)
    assert gpu["used_diff_ratio"] <= 0.01
    assert report["used_vs_reserved"]["ramp_deviation_max_ratio"] <= 0.02
    # kvguard's used bytes rise with the allocator's reserved bytes, tick by tick.
    ramp = [r for r in report["timeline"] if 0 <= r["t_s"] <= events["oom_at_s"]]
    assert len(ramp) > 100
    # A tick whose NVML read timed out (a loaded CI host) has no figure: the others
    # must rise, and nearly every tick must have one.
    used = [r["kvguard_gpu_used_bytes"] for r in ramp if r["kvguard_gpu_used_bytes"] is not None]
    assert len(used) >= 0.95 * len(ramp)
    assert used == sorted(used)
    assert used[-1] - used[0] > 20 * GiB
    names = {Path(f).name for f in report["files"]}
    assert names == {
        "gpu-check.json",
        "timeline.csv",
        "probe.json",
        "nvidia-smi-before.csv",
        "nvidia-smi-after.csv",
    }
    assert path == tmp_path / "gpu-check.json"
    assert json.loads(path.read_text())["checks"] == checks
    assert (tmp_path / "timeline.csv").read_text().count("\n") == len(report["timeline"]) + 1
    assert json.loads((tmp_path / "probe.json").read_text())["gpus"][0]["name"] == (
        "NVIDIA H200 (fake)"
    )


def test_the_check_fails_without_kvguards_gpu_forecast(tmp_path, monkeypatch, capsys):
    """With the GPU forecast gone (never rising), the lead-time checks fail and so does the run."""
    real_forecast = kvguard.runtime.decision.forecast

    def no_gpu_trend(samples, settings):
        fc = real_forecast(samples, settings)
        flat = ResourceForecast(fc.gpu.level, fc.gpu.capacity, fc.gpu.limit, 0.0)
        return type(fc)(**{**fc.__dict__, "gpu": flat})

    monkeypatch.setattr(kvguard.runtime.decision, "forecast", no_gpu_trend)
    assert main(["--fake", "--out", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["checks"]["tte_under_30s_before_oom"] is False
    assert report["checks"]["tte_under_10s_before_oom"] is False
    assert report["events"]["first_tte_under_30s_at_s"] is None
    assert report["events"]["load_end"] == "oom"  # the OOM still came, unannounced
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-2] == "FAILED"
    assert out[-1] == f"results: {tmp_path / 'gpu-check.json'}"


async def test_the_check_fails_when_bytes_per_token_disagree(tmp_path):
    """A load shaped like Qwen2.5-7B (57,344 B/token) against kvguard's Llama budget fails."""
    report, _ = await check(
        Settings(fake=True, fill_s=30.0, load_model="qwen2.5-7b-instruct", out=str(tmp_path))
    )
    assert report["bytes_per_token"]["kvguard"] == 131_072
    assert report["bytes_per_token"]["load_measured"] == 57_344
    assert report["checks"]["bytes_per_token_agree"] is False
    assert report["checks"]["tte_under_30s_before_oom"] is True
    assert report["passed"] is False


def test_nvidia_smi_output_is_parsed_and_compared_within_one_percent():
    """Real nvidia-smi text parses to bytes; 1% of total is the line between ok and not."""
    rows = parse_nvidia_smi(REAL_SMI)
    assert rows == [
        {"index": 0, "total_bytes": 81559 * MiB, "used_bytes": 0},
        {"index": 1, "total_bytes": 81559 * MiB, "used_bytes": 70452 * MiB},
    ]

    def doc(used, reserved):
        return {
            "gpus": [
                {
                    "index": 1,
                    "total_bytes": 81559 * MiB,
                    "used_bytes": used,
                    "reserved_bytes": reserved,
                }
            ]
        }

    exact = compare_probe(doc(70452 * MiB, 500 * MiB), rows)
    assert exact["ok"]
    assert exact["gpus"][0]["used_compared"] == "used"
    # An old driver's nvidia-smi counts the reservation as used: still the same memory.
    v1 = compare_probe(doc(69952 * MiB, 500 * MiB), rows)
    assert v1["ok"]
    assert v1["gpus"][0]["used_compared"] == "used+reserved"
    off = compare_probe(doc(70452 * MiB + int(0.011 * 81559 * MiB), 0), rows)
    assert not off["ok"]
    assert off["gpus"][0]["used_diff_ratio"] > 0.01
    assert not compare_probe({"gpus": []}, rows)["ok"]  # no GPU seen is no agreement


def test_fake_nvidia_smi_prints_what_nvidia_smi_prints():
    """The fake's CSV has nvidia-smi's header and whole MiB, used without the reservation."""
    nvml = FakeNvml([FakeGpu("fake", "GPU-0", 24 * GiB, 3 * GiB + 5, 300 * MiB)])
    text = nvidia_smi_csv(nvml)
    assert text == "index, memory.total [MiB], memory.used [MiB]\n0, 24576 MiB, 3072 MiB\n"
    assert parse_nvidia_smi(text)[0]["used_bytes"] == 3 * GiB


def test_simulated_allocator_grows_the_fake_gpu_like_pytorch():
    """20 MiB segments for 2 MiB blocks, the context on the GPU, OOM when full, then all back."""
    nvml = FakeNvml([FakeGpu("fake", "GPU-0", 1 * GiB, 100 * MiB, 24 * MiB)])
    alloc = SimulatedAllocator(nvml, 0, pid=77, context_bytes=300 * MiB)
    alloc.start()
    assert nvml.gpus[0].processes == {77: 300 * MiB}
    handles = [alloc.allocate(2 * MiB) for _ in range(11)]
    assert alloc.memory_allocated() == 22 * MiB
    assert alloc.memory_reserved() == 40 * MiB  # two 20 MiB segments
    assert nvml.gpus[0].used_bytes == 100 * MiB + 300 * MiB + 40 * MiB
    small = alloc.allocate(1000)  # rounded to 512 B, from a 2 MiB small-block segment
    assert alloc.memory_allocated() == 22 * MiB + 1024
    assert alloc.memory_reserved() == 42 * MiB
    with pytest.raises(FakeOutOfMemoryError, match=r"Tried to allocate 2\.00 MiB"):
        handles += [alloc.allocate(2 * MiB) for _ in range(300)]
    assert nvml.gpus[0].free_bytes < 20 * MiB
    alloc.free(small)
    alloc.empty_cache()
    assert alloc.memory_reserved() % (20 * MiB) == 0  # the idle small segment went back
    alloc.shutdown()
    assert nvml.gpus[0].used_bytes == 100 * MiB
    assert nvml.gpus[0].processes == {}
    with pytest.raises(ValueError, match="index: no fake GPU 3"):
        SimulatedAllocator(nvml, 3)


def test_kv_shape_comes_from_the_model_config():
    """Llama-3.1-8B: 2 x 32 x 8 x 128 x 2 B; MLA models are refused with the field named."""
    shape = KvShape.from_config(LLAMA_8B)
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.dtype) == (32, 8, 128, "bfloat16")
    assert shape.bytes_per_token == 131_072
    with pytest.raises(LoadError, match="'kv_lora_rank'"):
        KvShape.from_config(BUNDLED_MODELS_DIR / "deepseek-v3")
    with pytest.raises(LoadError, match="cannot read it"):
        KvShape.from_config(BUNDLED_MODELS_DIR / "no-such-model")


def test_the_load_loop_stops_at_the_oom_with_consistent_figures():
    """The real load's loop on a fake clock: samples, then an oom; only stored tokens count."""
    nvml = FakeNvml([FakeGpu("fake", "GPU-0", 2 * GiB)])
    alloc = SimulatedAllocator(nvml, 0, context_bytes=100 * MiB)
    load = KvLoad(
        SimulatedBackend(alloc), KvShape.from_config(LLAMA_8B), tokens_per_s=1000.0, concurrency=4
    )
    clock, events = FakeClock(0.0), []
    end = run_until_oom(load, clock=clock, sleep=clock.advance, emit=events.append, max_s=60)
    assert end["event"] == "oom"
    assert 10 < end["t"] < 20  # ~1.9 GiB at 1000 tokens/s x 128 KiB
    assert events[0]["tokens"] == 0
    assert [e["event"] for e in events] == ["sample"] * len(events)
    assert end["token_capacity"] == end["blocks"] * 16
    assert end["tokens"] > end["token_capacity"] - 16 * 4  # at most one open block per sequence
    assert end["allocated_bytes"] == end["blocks"] * 16 * 131_072
    load.release()
    assert alloc.memory_allocated() == 0
    assert alloc.memory_reserved() == 0
    with pytest.raises(LoadError, match="tokens_per_s"):
        KvLoad(SimulatedBackend(alloc), KvShape.from_config(LLAMA_8B), tokens_per_s=0)


def test_real_mode_config_is_valid_kvguard_config(tmp_path):
    """The config the real run gives `kvguard run` loads: NVML by the load's PID, 0.5 s, dry run."""
    path = tmp_path / "kvguard.toml"
    path.write_text(
        to_toml(
            guard_config(
                Settings(),
                engine_url="http://127.0.0.1:9",
                pid=4321,
                listen="127.0.0.1:9999",
                gpu_index=0,
            )
        )
    )
    config = load_config(str(path), env={})
    assert config.engine.pid == 4321
    assert config.gpu.indices == (0,)
    assert config.poll.interval_s == 0.5
    assert config.model.config == "llama-3.1-8b"
    assert config.server.listen == "127.0.0.1:9999"
    assert config.dry_run


def test_without_nvidia_smi_the_real_run_says_why(tmp_path, monkeypatch, capsys):
    """No driver on the machine: exit 2 and one line naming what is missing and --fake."""
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "nvidia-smi not found" in err
    assert "--fake" in err


def test_bad_flags_are_refused_with_the_flag_named(capsys):
    """An unbounded fill time is refused before anything starts."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--fake", "--fill-s", "900"])
    assert exit_info.value.code == 2
    assert "--fill-s: between 5 and 150 seconds" in capsys.readouterr().err


def test_the_script_runs_the_fake_check_and_prints_the_table_last(tmp_path):
    """`bash scripts/gpu-check.sh --fake --out DIR` with CI's Python: exit 0, PASSED, files."""
    env = {**os.environ, "KVGUARD_PYTHON": sys.executable}
    env.pop("KVGUARD_GPU_CHECK_OUT", None)
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--fake", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-2:] == ["PASSED", f"results: {tmp_path / 'gpu-check.json'}"]
    assert any(line.strip().startswith("time_to_exhaustion < 30 s") for line in lines)
    assert json.loads((tmp_path / "gpu-check.json").read_text())["passed"] is True


# -- the real-GPU path, with stand-ins for the driver ------------------------------------
# No GPU here, so the real mode runs against three stand-ins written into a folder put
# first on PATH and PYTHONPATH for the child processes: `torch` (the load's
# allocator), `pynvml` (what `kvguard run` and `kvguard probe` read) and
# `nvidia-smi`. They share one state folder: each load process keeps its reserved
# bytes (plus a CUDA context) in a file named by its PID, which NVML sums.

SHIM_COMMON = """
import os
from pathlib import Path

STATE = Path(os.environ["GPU_SHIM_STATE"])
TOTAL = int(os.environ["GPU_SHIM_TOTAL"])
OTHER = 512 * 2**20  # another process already on the GPU


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def processes():
    # As the driver does, a process that has exited holds nothing.
    out = {}
    for f in STATE.glob("*"):
        if f.name.isdigit() and alive(int(f.name)):
            out[int(f.name)] = int(f.read_text() or 0)
    return out


def used():
    return OTHER + sum(processes().values())
"""

SHIM_TORCH = """
import math
import os
from gpu_shim_common import STATE, TOTAL, used

MiB = 2**20
CONTEXT = 300 * MiB
bfloat16, float16, float32 = "bfloat16", "float16", "float32"
_state = {"allocated": 0, "reserved": 0}


def _write():
    tmp = STATE / f".{os.getpid()}"
    tmp.write_text(str(CONTEXT + _state["reserved"]))
    tmp.replace(STATE / str(os.getpid()))


class OutOfMemoryError(RuntimeError):
    pass


class _Cuda:
    OutOfMemoryError = OutOfMemoryError

    def set_device(self, device):
        _write()

    def memory_allocated(self, device=None):
        return _state["allocated"]

    def memory_reserved(self, device=None):
        return _state["reserved"]

    def mem_get_info(self, device=None):
        return TOTAL - used(), TOTAL

    def synchronize(self, device=None):
        pass

    def empty_cache(self):
        _state["reserved"] = -(-_state["allocated"] // (20 * MiB)) * 20 * MiB
        _write()


cuda = _Cuda()


def device(kind, index):
    return (kind, index)


class _Tensor:
    def __init__(self, nbytes):
        self.nbytes = nbytes

    def __del__(self):
        _state["allocated"] -= self.nbytes


def zeros(shape, dtype=float32, device=None):
    size = math.prod(shape) if isinstance(shape, tuple) else shape
    nbytes = -(-size * (4 if dtype == float32 else 2) // 512) * 512
    if _state["reserved"] - _state["allocated"] < nbytes:
        if used() + 20 * MiB > TOTAL:
            raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (shim)")
        _state["reserved"] += 20 * MiB
        _write()
    _state["allocated"] += nbytes
    return _Tensor(nbytes)
"""

SHIM_PYNVML = """
from types import SimpleNamespace
from gpu_shim_common import TOTAL, processes, used

RESERVED = 256 * 2**20
nvmlMemory_v2 = 0x02000028


class NVMLError(Exception):
    pass


def nvmlInit():
    pass


def nvmlShutdown():
    pass


def nvmlSystemGetDriverVersion():
    return "999.0 (shim)"


def nvmlSystemGetNVMLVersion():
    return "12.999 (shim)"


def nvmlDeviceGetCount():
    return 1


def nvmlDeviceGetHandleByIndex(index):
    if index != 0:
        raise NVMLError("Invalid Argument")
    return 0


def nvmlDeviceGetUUID(handle):
    return "GPU-shim-0"


def nvmlDeviceGetName(handle):
    return "NVIDIA Shim"


def nvmlDeviceGetMemoryInfo(handle, version=None):
    u = used()
    return SimpleNamespace(total=TOTAL, used=u, free=TOTAL - u - RESERVED, reserved=RESERVED)


def nvmlDeviceGetComputeRunningProcesses(handle):
    return [SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in processes().items()]
"""

SHIM_SMI = """
import sys
sys.path.insert(0, {shims!r})
from gpu_shim_common import TOTAL, used

assert sys.argv[1:] == ["--query-gpu=index,memory.total,memory.used", "--format=csv"], sys.argv
print("index, memory.total [MiB], memory.used [MiB]")
print(f"0, {{TOTAL // 2**20}} MiB, {{used() // 2**20}} MiB")
"""


@pytest.fixture
def gpu_stand_ins(tmp_path, monkeypatch):
    """A 6 GiB stand-in GPU for child processes (PATH, PYTHONPATH)."""
    shims, state = tmp_path / "shims", tmp_path / "state"
    shims.mkdir()
    state.mkdir()
    (shims / "gpu_shim_common.py").write_text(SHIM_COMMON)
    (shims / "torch.py").write_text(SHIM_TORCH)
    (shims / "pynvml.py").write_text(SHIM_PYNVML)
    smi = shims / "nvidia-smi"
    smi.write_text(f"#!{sys.executable}\n" + SHIM_SMI.format(shims=str(shims)))
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{shims}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", str(shims))
    monkeypatch.setenv("GPU_SHIM_STATE", str(state))
    monkeypatch.setenv("GPU_SHIM_TOTAL", str(6 * GiB))
    return state


@pytest.mark.usefixtures("gpu_stand_ins")
async def test_real_mode_runs_end_to_end_against_stand_ins(tmp_path):
    """The real path as it will run on a GPU, with stand-ins for torch, NVML and nvidia-smi.

    Probe and nvidia-smi, the load and `kvguard run` as child processes, /metrics read
    per tick, the OOM seen coming, everything stopped and the memory back.
    """
    out = tmp_path / "out"
    report, path = await check(Settings(fill_s=6.0, out=str(out)))
    events, checks = report["events"], report["checks"]
    assert report["mode"] == "gpu"
    assert checks == dict.fromkeys(checks, True), checks
    assert report["settings"]["gpu_selection"] == "pid"
    assert report["probe"]["nvml"]["driver_version"] == "999.0 (shim)"
    assert 3 < events["oom_at_s"] < 12
    assert 0 < events["first_tte_under_10s_at_s"] < events["oom_at_s"]
    assert report["bytes_per_token"]["load_measured"] == 131_072
    load_events = [
        json.loads(line) for line in (out / "load-events.jsonl").read_text().splitlines()
    ]
    assert [e["event"] for e in load_events][-2:] == ["oom", "released"]
    assert "probe_failed" in (out / "kvguard.log").read_text()  # no engine, said once
    names = {Path(f).name for f in report["files"]}
    assert {"gpu-check.json", "kvguard.toml", "kvguard.log", "load-stderr.log"} <= names
    assert path == out / "gpu-check.json"
