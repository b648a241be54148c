"""`kvguard loadgen` against the real simulated engine on 127.0.0.1.

The engine's own counters are the reference: what the load generator reports it
sent, got back and saw preempted must be what the engine counted.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import itertools
import json
import math
import signal
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from kvguard.cli.loadgen import parse_priority_shares, register
from kvguard.errors import InvalidInputError
from kvguard.sim.loadgen import LoadConfig, check_url, run_load
from kvguard.sim.loadgen_report import (
    ClassCounts,
    LoadReport,
    Percentiles,
    RequestOutcome,
    Slo,
    preemptions_in,
)
from kvguard.sim.traffic import PriorityShares, TrafficParams, generate
from tests.helpers import free_port

# A pool that never preempts at these sizes, and a fast clock.
ROOMY = {"kv_capacity_tokens": 65_536, "max_model_len": 4096, "max_num_seqs": 64}


async def counters(url: str) -> dict[str, float]:
    """The engine's counters, each summed over its label sets (successes: stop + length)."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        text = await response.text()
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("finished_reason") == "abort":
                continue
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    """How much one counter rose."""
    return after[name] - before[name]


def loadgen_parser() -> argparse.ArgumentParser:
    """A parser holding only the loadgen subcommand, as kvguard's CLI registers it."""
    parser = argparse.ArgumentParser(prog="kvguard")
    register(parser.add_subparsers(dest="command"))
    return parser


# ---------------------------------------------------------------- against the engine
@pytest.mark.parametrize(
    ("pattern", "endpoint", "stream"),
    [
        ("mixed", "completions", True),
        ("long_context", "chat", True),
        ("bursty_short", "completions", False),
        ("steady", "chat", False),
    ],
)
async def test_report_matches_the_engine_counters(sim_engine, pattern, endpoint, stream):
    """Successes, prompt and generated tokens in the report are the engine's own deltas."""
    url = await sim_engine(**ROOMY)
    before = await counters(url)
    report = await run_load(
        LoadConfig(
            url,
            pattern=pattern,
            duration_s=1.5,
            max_requests=80,
            scale=0.05,
            max_context=2048,
            endpoint=endpoint,
            stream=stream,
            # Loose bounds: this test is about counting, and a busy 2-core CI machine
            # once stretched one answer's TPOT past the default 0.1 s.
            slo_ttft_s=30.0,
            slo_tpot_s=5.0,
        )
    )
    after = await counters(url)
    assert report.sent > 0
    assert report.succeeded == report.sent
    assert report.failed == report.shed == 0
    assert report.succeeded == delta(before, after, "vllm:request_success_total")
    assert report.prompt_tokens == delta(before, after, "vllm:prompt_tokens_total")
    assert report.completion_tokens == delta(before, after, "vllm:generation_tokens_total")
    assert report.preemptions == 0
    assert report.status_counts == {"200": report.sent}
    assert sum(c.sent for c in report.by_priority.values()) == report.sent
    assert report.e2e_s is not None
    assert (report.ttft_s is not None) == stream
    assert report.goodput == report.sent
    assert report.goodput_ratio == 1.0


async def test_run_stops_at_max_requests_and_sends_the_planned_sizes(sim_engine, capsys):
    """The first N specs are sent, N plain words are N tokens, and nothing more is sent."""
    url = await sim_engine(**ROOMY)
    config = LoadConfig(
        url, pattern="bursty_short", duration_s=10, max_requests=25, scale=0.2, seed=3
    )
    planned = list(itertools.islice(generate("bursty_short", seed=3, params=config.traffic()), 25))
    before = await counters(url)
    report = await run_load(config)
    after = await counters(url)
    assert report.sent == report.succeeded == 25
    assert delta(before, after, "vllm:request_success_total") == 25
    assert report.prompt_tokens == sum(s.prompt_tokens for s in planned)
    assert report.completion_tokens == sum(s.output_tokens for s in planned)
    assert report.duration_s < config.duration_s  # it stopped at the count, not the clock
    assert capsys.readouterr().err == ""  # no progress line when stderr is not a terminal


async def test_run_stops_at_the_duration(sim_engine):
    """A ramp that would send thousands stops sending at the duration."""
    url = await sim_engine(**ROOMY)
    config = LoadConfig(
        url, pattern="ramp", duration_s=1.0, max_requests=10_000, scale=0.02, grace_s=0.5
    )
    planned = list(generate("ramp", seed=0, params=config.traffic()))
    report = await run_load(config)
    assert 0 < report.sent <= len(planned) < 10_000
    assert report.sent >= len(planned) - 3  # the last arrivals may meet the deadline
    assert report.duration_s < config.duration_s + config.grace_s + 1.0


async def test_in_flight_requests_are_cancelled_after_the_grace_period(sim_engine):
    """Requests still running at deadline + grace are cancelled, counted unfinished, and aborted."""
    url = await sim_engine(**ROOMY, step_fixed_s=0.05, per_token_s=0.0)
    config = LoadConfig(
        url, pattern="bursty_short", duration_s=0.5, max_requests=8, concurrency=8, grace_s=0.2
    )
    before = await counters(url)
    report = await run_load(config)
    await asyncio.sleep(0.1)  # the engine notices the disconnects on its next step
    after = await counters(url)
    assert report.sent == 8
    assert report.failed == 0
    assert report.unfinished == 8
    assert report.status_counts == {"unfinished": 8}
    assert report.e2e_s is None
    assert report.goodput == 0
    assert delta(before, after, "vllm:request_success_total") == 0
    assert report.duration_s < config.duration_s + config.grace_s + 1.0


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


async def test_progress_line_is_drawn_on_a_terminal(sim_engine, monkeypatch):
    """On a TTY, stderr gets a line rewritten with a carriage return, ended by a newline."""
    url = await sim_engine(**ROOMY)
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    await run_load(LoadConfig(url, pattern="bursty_short", max_requests=5, scale=0.1))
    text = terminal.getvalue()
    assert text.startswith("\rloadgen bursty_short  ")
    assert text.endswith("sent 5  ok 5  shed 0  failed 0  \n")


async def test_same_seed_sends_the_same_requests(sim_engine):
    """Counts, classes and tokens repeat for a seed, and change with another seed."""
    url = await sim_engine(**ROOMY)

    async def run(seed: int) -> LoadReport:
        return await run_load(
            LoadConfig(
                url, pattern="bursty_short", duration_s=5, max_requests=30, scale=0.1, seed=seed
            )
        )

    def classes(report: LoadReport) -> dict[str, int]:
        return {name: counts.sent for name, counts in report.by_priority.items()}

    first, second, other = await run(5), await run(5), await run(6)
    assert (first.sent, classes(first), first.prompt_tokens, first.completion_tokens) == (
        second.sent,
        classes(second),
        second.prompt_tokens,
        second.completion_tokens,
    )
    assert other.prompt_tokens != first.prompt_tokens


async def test_preemptions_are_the_engine_counter_delta(sim_engine):
    """A burst into a tiny pool preempts, and the report says how often."""
    url = await sim_engine(kv_capacity_tokens=512, max_model_len=256, max_num_seqs=32)
    before = await counters(url)
    report = await run_load(
        LoadConfig(
            url, pattern="bursty_short", duration_s=5, max_requests=60, scale=0.5, max_context=256
        )
    )
    after = await counters(url)
    assert report.succeeded == 60
    assert report.preemptions is not None
    assert report.preemptions > 0
    assert report.preemptions == delta(before, after, "vllm:num_preemptions_total")


async def test_cache_usage_and_queue_are_sampled_during_the_run(sim_engine):
    """Long conversations in a small pool: the report shows a high usage peak and a queue."""
    url = await sim_engine(kv_capacity_tokens=2048, max_model_len=1024, per_token_s=0.0002)
    report = await run_load(
        LoadConfig(url, pattern="long_context", duration_s=3, max_requests=40, max_context=1024)
    )
    assert report.kv_usage_peak is not None
    assert 0.5 < report.kv_usage_peak <= 1.0
    assert report.kv_usage_mean is not None
    assert 0 < report.kv_usage_mean <= report.kv_usage_peak
    assert report.waiting_peak is not None
    assert "usage peak" in report.render()


async def test_no_usage_gauge_reports_none(sim_engine):
    """llama.cpp has no KV usage gauge: the report says so instead of inventing one."""
    url = await sim_engine(**ROOMY, flavor="llamacpp")
    report = await run_load(
        LoadConfig(url, pattern="steady", duration_s=1, max_requests=3, scale=0.1)
    )
    assert report.kv_usage_peak is None
    assert report.waiting_peak is not None


async def test_sglang_retractions_count_as_preemptions(sim_engine):
    """SGLang's retraction counter is read when vLLM's is absent."""
    url = await sim_engine(**ROOMY, flavor="sglang")
    report = await run_load(
        LoadConfig(url, pattern="bursty_short", duration_s=2, max_requests=5, scale=0.1)
    )
    assert report.succeeded == 5
    assert report.preemptions == 0


async def test_no_preemption_counter_reports_none(sim_engine):
    """llama.cpp has no preemption counter: the report says n/a, not 0."""
    url = await sim_engine(**ROOMY, flavor="llamacpp")
    report = await run_load(
        LoadConfig(url, pattern="bursty_short", duration_s=2, max_requests=5, scale=0.1)
    )
    assert report.succeeded == 5
    assert report.preemptions is None
    assert "n/a" in report.render()


async def test_refused_requests_count_as_shed(sim_engine):
    """A paused engine answers 503: every request is shed, per class too."""
    url = await sim_engine(**ROOMY)
    async with aiohttp.ClientSession() as session, session.post(url + "/pause?mode=abort") as r:
        assert r.status == 200
    report = await run_load(
        LoadConfig(url, pattern="bursty_short", duration_s=2, max_requests=20, scale=0.1)
    )
    assert report.sent == report.shed == 20
    assert report.succeeded == report.failed == 0
    assert report.status_counts == {"503": 20}
    assert sum(c.shed for c in report.by_priority.values()) == 20
    assert report.goodput_ratio == 0.0


async def test_unreachable_server_fails_requests_or_refuses_to_start():
    """Connection errors count as failed; without a model name the run cannot start."""
    url = f"http://127.0.0.1:{free_port()}"
    report = await run_load(
        LoadConfig(url, pattern="bursty_short", duration_s=1, max_requests=5, scale=0.1, model="m")
    )
    assert report.sent == report.failed == 5
    assert report.status_counts == {"connection_error": 5}
    assert report.preemptions is None
    with pytest.raises(InvalidInputError) as caught:
        await run_load(LoadConfig(url, duration_s=1))
    assert caught.value.field == "url"


async def test_conversation_turns_wait_for_and_extend_the_previous_turn(recording_server):
    """A turn is sent after its previous turn answered; its prompt extends that prompt + answer."""
    url, seen = recording_server
    config = LoadConfig(
        url,
        pattern="long_context",
        duration_s=4.0,
        max_requests=200,
        scale=0.02,
        max_context=120,
        stream=False,
        model="m",
    )
    report = await run_load(config)
    assert report.sent == report.succeeded == len(seen) >= 8
    followers = 0
    for request in seen:
        words = request["prompt"].split()
        earlier = [
            other
            for other in seen
            if other is not request
            and len(other["prompt"].split()) < len(words)
            and words[: len(other["prompt"].split())] == other["prompt"].split()
        ]
        if not earlier:
            continue  # a first turn
        followers += 1
        previous = max(earlier, key=lambda other: len(other["prompt"].split()))
        assert previous["answered_at"] <= request["received_at"]
        grown = len(words) - len(previous["prompt"].split()) - previous["max_tokens"]
        assert grown >= 1  # a new user message after the previous answer
        assert len(words) + request["max_tokens"] <= config.max_context
    assert followers >= 4


@pytest.fixture
async def recording_server():
    """A minimal OpenAI-style server that records each request and answers after 0.2 s."""
    seen: list[dict] = []
    loop = asyncio.get_running_loop()

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        record = {**body, "received_at": loop.time()}
        await asyncio.sleep(0.2)
        prompt = len(body["prompt"].split())
        record["answered_at"] = loop.time()
        seen.append(record)
        usage = {"prompt_tokens": prompt, "completion_tokens": body["max_tokens"]}
        text = " word" * body["max_tokens"]
        return web.json_response(
            {"choices": [{"text": text, "finish_reason": "length"}], "usage": usage}
        )

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}", seen
    await runner.cleanup()


# ---------------------------------------------------------------- the command
async def test_json_file_holds_the_report(sim_engine, tmp_path, capsys):
    """--json OUT writes the whole report; the table still goes to stdout; exit 0."""
    url = await sim_engine(**ROOMY)
    out = tmp_path / "report.json"
    args = loadgen_parser().parse_args(
        [
            "loadgen",
            "--url",
            url,
            "--pattern",
            "bursty_short",
            "--max-requests",
            "10",
            "--duration",
            "3",
            "--scale",
            "0.1",
            "--priority-shares",
            "critical=1",
            "--seed",
            "2",
            "--json",
            str(out),
        ]
    )
    assert await asyncio.to_thread(args.handler, args) == 0
    data = json.loads(out.read_text())
    assert data["pattern"] == "bursty_short"
    assert data["seed"] == 2
    assert data["sent"] == data["succeeded"] == 10
    assert data["by_priority"]["critical"]["sent"] == 10
    assert data["by_priority"]["standard"]["sent"] == 0
    assert data["status_counts"] == {"200": 10}
    assert set(data["ttft_s"]) == {"p50", "p90", "p99", "max"}
    assert data["preemptions"] == 0
    assert "Requests     sent 10  ok 10" in capsys.readouterr().out
    assert set(data) >= NEW_KEYS
    assert (data["client_max_tokens"], data["output_length"], data["retries_allowed"]) == (
        2048,
        "sim-field",
        0,
    )
    assert (data["trace"], data["speed"], data["start_s"], data["slo_tpot_s"]) == (
        None,
        1.0,
        0.0,
        0.1,
    )
    assert data["slo_e2e_s"] is None
    assert data["slo_attainment"] == data["slo_met"] / data["sent"] == data["goodput_ratio"]
    for counts in data["by_priority"].values():
        assert set(counts) == CLASS_KEYS
        assert counts["sent"] == sum(counts[k] for k in ENDINGS)
    critical = data["by_priority"]["critical"]
    assert critical["completed"] == critical["succeeded"] == 10
    assert critical["requested_max_tokens"] > critical["completion_tokens"]  # it over-asked
    assert data["by_priority"]["standard"]["slo_attainment"] is None  # none sent


NEW_KEYS = {
    *("completed", "slo_met", "slo_attainment", "goodput_tokens", "refused", "clamped"),
    *("requested_max_tokens", "ttft_p99_s", "tpot_p99_s", "retries", "slo_tpot_s"),
    *("client_max_tokens", "retries_allowed", "speed", "trace", "start_s", "output_length"),
    "tpot_s",
}
ENDINGS = ("completed", "shed", "refused", "failed", "unfinished")
CLASS_KEYS = {
    *("sent", "succeeded", "completed", "failed", "shed", "refused", "unfinished", "clamped"),
    *("slo_met", "slo_attainment", "goodput_tokens", "completion_tokens"),
    *("requested_max_tokens", "ttft_p99_s", "tpot_p99_s", "retries"),
}


async def test_json_dash_prints_only_json(sim_engine, capsys):
    """--json - prints the report as JSON on stdout and nothing else."""
    url = await sim_engine(**ROOMY)
    args = loadgen_parser().parse_args(
        [
            *("loadgen", "--url", url, "--pattern", "bursty_short", "--max-requests", "3"),
            *("--scale", "0.1", "--no-stream", "--endpoint", "chat", "--json", "-"),
        ]
    )
    assert await asyncio.to_thread(args.handler, args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["succeeded"] == 3
    assert data["ttft_s"] is None


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--url", "ftp://127.0.0.1:21"], "--url"),
        (["--url", "127.0.0.1:8000"], "--url"),
        (["--url", "http://:8000"], "--url"),
        (["--url", "http://127.0.0.1:99999"], "--url"),
        (["--duration", "0"], "--duration"),
        (["--duration", "nan"], "--duration"),
        (["--max-requests", "0"], "--max-requests"),
        (["--concurrency", "0"], "--concurrency"),
        (["--scale", "-1"], "--scale"),
        (["--max-context", "1"], "--max-context"),
        (["--slo-ttft", "0"], "--slo-ttft"),
        (["--slo-e2e", "inf"], "--slo-e2e"),
        (["--priority-shares", "urgent=1"], "--priority-shares"),
        (["--priority-shares", "critical=0,standard=0"], "--priority-shares"),
        (["--priority-shares", "critical=x"], "--priority-shares"),
        (["--priority-shares", "critical=-1,standard=2"], "--priority-shares"),
        (["--priority-shares", "critical=1,critical=2"], "--priority-shares"),
        (["--json", "/nonexistent-dir/report.json"], "--json"),
        (["--model", " "], "--model"),
        (["--slo-tpot", "0"], "--slo-tpot"),
        (["--slo-e2e", "-1"], "--slo-e2e"),
        (["--retries", "-1"], "--retries"),
        (["--retry-cap", "nan"], "--retry-cap"),
        (["--client-max-tokens", "0"], "--client-max-tokens"),
        (["--client-max-tokens", "lots"], "--client-max-tokens"),
        (["--speed", "2"], "--speed"),
        (["--start-s", "1"], "--start-s"),
        (["--trace-format", "azure"], "--trace-format"),
        (["--trace", " "], "--trace"),
    ],
)
def test_bad_flags_name_the_flag(flags, field):
    """Each bad value raises InvalidInputError naming its flag, before any request."""
    argv = ["loadgen", "--url", "http://127.0.0.1:1", *flags]
    args = loadgen_parser().parse_args(argv)
    with pytest.raises(InvalidInputError) as caught:
        args.handler(args)
    assert caught.value.field == field


def test_unknown_pattern_is_an_argparse_error():
    """--pattern only takes the documented names."""
    with pytest.raises(SystemExit):
        loadgen_parser().parse_args(["loadgen", "--url", "http://h:1", "--pattern", "nope"])


# ---------------------------------------------------------------- pure helpers
def test_priority_shares_parse_and_default_missing_classes_to_zero():
    """Names map to shares; a class not named has share 0."""
    assert parse_priority_shares("critical=0.1,standard=0.6,sheddable=0.3") == PriorityShares()
    assert parse_priority_shares("standard=2") == PriorityShares(0, 2, 0)


def test_percentiles_are_nearest_rank():
    """p50/p90/p99/max of 1..100 are 50, 90, 99, 100; no data is None."""
    assert Percentiles.of([float(v) for v in range(100, 0, -1)]) == Percentiles(50, 90, 99, 100)
    assert Percentiles.of([0.5]) == Percentiles(0.5, 0.5, 0.5, 0.5)
    assert Percentiles.of([]) is None


VLLM_METRICS = """\
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="a"} 3.0
vllm:num_preemptions_total{engine="1",model_name="a"} 4.0
"""
SGLANG_METRICS = """\
# TYPE sglang:num_retracted_requests_total counter
sglang:num_retracted_requests_total{model_name="b"} 2.0
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (VLLM_METRICS, 7.0),
        (SGLANG_METRICS, 2.0),
        ("# TYPE other_total counter\nother_total 5\n", None),
        ("", None),
        ("this is { not prometheus", None),
    ],
)
def test_preemptions_are_summed_over_label_sets(text, expected):
    """Every label set counts; a missing counter or unparsable text is None."""
    assert preemptions_in(text) == expected


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:8000", "https://engine.internal", "http://h:8000/prefix/"]
)
def test_good_urls_are_accepted(url):
    """http(s) with a host, an optional port and an optional path prefix."""
    check_url(url)
    assert not LoadConfig(url).base_url.endswith("/")


def test_report_json_and_table_carry_every_figure():
    """as_dict is JSON-ready and render shows each line."""
    report = LoadReport(
        pattern="steady",
        seed=1,
        model="m",
        duration_s=2.0,
        sent=4,
        succeeded=2,
        failed=1,
        shed=1,
        unfinished=0,
        by_priority={"critical": ClassCounts(sent=4, succeeded=2, slo_met=1)},
        ttft_s=Percentiles(0.1, 0.2, 0.3, 0.4),
        e2e_s=None,
        prompt_tokens=1234,
        completion_tokens=56,
        slo_ttft_s=2.0,
        slo_e2e_s=30.0,
        goodput=2,
        goodput_ratio=0.5,
        preemptions=3.0,
        status_counts={"200": 2, "503": 1, "timeout": 1},
        trace="azure.csv",
        speed=4.0,
        client_max_tokens="trace",
        output_length="ignore-eos",
    )
    data = json.loads(json.dumps(report.as_dict()))
    assert data["by_priority"]["critical"]["slo_attainment"] == 0.25
    assert data["ttft_s"] == {"p50": 0.1, "p90": 0.2, "p99": 0.3, "max": 0.4}
    assert data["e2e_s"] is None
    assert data["goodput_ratio"] == 0.5
    text = report.render()
    for expected in (
        *("sent 4  ok 2  shed 1  failed 1", "prompt 1,234", "50.0%", "503: 1"),
        *("azure.csv  from 0 s  speed x4", "max_tokens trace  output length ignore-eos"),
        *("E2E <= 30 s", "SLO met", "25.0%"),
    ):
        assert expected in text
    assert math.isclose(data["duration_s"], 2.0)


def test_traffic_params_follow_the_config():
    """The config's scale, context cap and shares reach the pattern."""
    config = LoadConfig(
        "http://h:1", scale=0.5, max_context=100, priority_shares=PriorityShares(1, 0, 0)
    )
    assert config.traffic() == TrafficParams(60.0, 0.5, 100, PriorityShares(1, 0, 0))


async def test_ctrl_c_ends_the_run_and_still_reports(sim_server):
    """SIGINT stops sending at once; the partial report is printed and the exit code is 130."""
    server = await sim_server(**ROOMY, per_token_s=0.001)
    url = server.url
    kvguard = str(Path(sys.executable).parent / "kvguard")
    proc = await asyncio.create_subprocess_exec(
        kvguard,
        "loadgen",
        "--url",
        url,
        "--pattern",
        "decode_heavy",
        "--duration",
        "60",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    for _ in range(1000):  # until the engine is busy with its requests (10 s at most)
        if server.engine.scheduler.running:
            break
        await asyncio.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 130
    assert "interrupted" in err.decode()
    assert "Traceback" not in err.decode()
    assert out.decode().startswith("loadgen decode_heavy")


# ---------------------------------------------------------------- benchmark truth
BURST_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"


def trace_file(tmp_path: Path, rows: list[tuple[float, int, int]]) -> str:
    """A BurstGPT trace of (seconds, prompt tokens, true output tokens) rows; its path."""
    path = tmp_path / "rows.csv"
    lines = [BURST_HEADER, *(f"{t},ChatGPT,{p},{o},{p + o},API log" for t, p, o in rows)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


@pytest.fixture
async def scripted():
    """Start an OpenAI-style server whose answer to each POST a test function decides.

    ``url, seen = await scripted(answer)``: ``answer(body, attempt)`` returns a
    response (``attempt`` counts earlier POSTs with the same prompt); ``seen`` holds
    every body (with its X-Priority header as ``x_priority``). ``GET /v1/models``
    lists a real engine's card (owned_by vllm).
    """
    runners: list[web.AppRunner] = []

    async def start(answer, max_model_len: int = 100_000):
        seen: list[dict] = []

        async def completions(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            attempt = sum(b["prompt"] == body["prompt"] for b in seen)
            seen.append({**body, "x_priority": request.headers.get("X-Priority")})
            return answer(body, attempt)

        async def models(_: web.Request) -> web.Response:
            card = {"id": "real", "owned_by": "vllm", "max_model_len": max_model_len}
            return web.json_response({"object": "list", "data": [card]})

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}", seen

    yield start
    for runner in runners:
        await runner.cleanup()


def answered(body: dict, tokens: int | None = None, reason: str = "length") -> web.Response:
    """A whole completion of ``tokens`` (default: max_tokens) tokens."""
    count = body["max_tokens"] if tokens is None else tokens
    usage = {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": count}
    return web.json_response(
        {"choices": [{"text": " x" * count, "finish_reason": reason}], "usage": usage}
    )


def refused(status: int, **headers: str) -> web.Response:
    """An OpenAI-style error answer."""
    error = {"error": {"message": "no", "type": "x", "code": "kv_window_exceeded"}}
    return web.json_response(error, status=status, headers=headers)


async def test_latency_counts_from_the_scheduled_time(sim_engine, tmp_path):
    """Two requests due at once behind one client slot: the second's TTFT holds the first's wait."""
    url = await sim_engine(**ROOMY, step_fixed_s=0.03, per_token_s=0.0)
    path = trace_file(tmp_path, [(0, 10, 8), (0, 10, 8)])

    async def run(concurrency: int) -> LoadReport:
        return await run_load(LoadConfig(url, trace=path, concurrency=concurrency, duration_s=1))

    one, two = await run(1), await run(2)
    for report in (one, two):
        assert report.succeeded == 2
        assert report.ttft_s is not None
        assert report.e2e_s is not None
    first_e2e = one.e2e_s.p50  # nearest rank of two values: the smaller, the first request's
    assert one.ttft_s.max >= first_e2e > 0.2
    assert one.e2e_s.max >= 2 * first_e2e - 0.05
    # Two slots: no wait, the first tokens come long before either answer ends.
    assert two.ttft_s.max < two.e2e_s.p50 / 2


async def test_a_request_due_but_never_given_a_slot_counts_as_unfinished(sim_engine, tmp_path):
    """Open loop: three requests due at once behind one slow slot are all sent and reported."""
    url = await sim_engine(**ROOMY, step_fixed_s=0.2, per_token_s=0.0)
    path = trace_file(tmp_path, [(0, 10, 50), (0, 10, 50), (0.1, 10, 50)])
    report = await run_load(LoadConfig(url, trace=path, concurrency=1, duration_s=0.5, grace_s=0.3))
    assert report.sent == 3
    assert report.unfinished == 3  # one cut off in flight, two still waiting for the slot
    assert sum(c.unfinished for c in report.by_priority.values()) == 3


async def test_plans_keep_a_margin_under_a_real_engines_context(scripted, tmp_path):
    """Against a real engine (ignore-eos) prompt + max_tokens stay within 95% of its context."""
    url, seen = await scripted(lambda body, attempt: answered(body), max_model_len=100)
    path = trace_file(tmp_path, [(0, 200, 50), (0, 30, 20)])
    report = await run_load(LoadConfig(url, trace=path, stream=False, duration_s=1))
    assert report.output_length == "ignore-eos"
    assert [len(b["prompt"].split()) + b["max_tokens"] for b in seen] == [95, 50]


async def test_retry_after_is_honoured_and_counted_apart(scripted, tmp_path):
    """A 503 with Retry-After is sent again after the delay: one request, one retry, completed."""

    def answer(body: dict, attempt: int) -> web.Response:
        return refused(503, **{"Retry-After": "0.2"}) if attempt == 0 else answered(body)

    url, seen = await scripted(answer)
    path = trace_file(tmp_path, [(0, 3, 4), (0.1, 5, 4)])
    report = await run_load(LoadConfig(url, trace=path, retries=1, stream=False, duration_s=1))
    assert len(seen) == 4
    assert (report.sent, report.succeeded, report.shed, report.retries) == (2, 2, 0, 2)
    assert sum(c.retries for c in report.by_priority.values()) == 2
    assert report.status_counts == {"200": 2}
    assert report.e2e_s is not None
    assert report.e2e_s.p50 >= 0.2  # the wait counts: latency runs from the scheduled time
    assert report.retries_allowed == 1


@pytest.mark.parametrize(
    "case",
    [
        pytest.param((503, {}, 3, 1, 0), id="503-without-retry-after"),
        pytest.param((429, {"Retry-After": "0"}, 2, 3, 2), id="429-retries-exhausted"),
        pytest.param((503, {"Retry-After": "0.05"}, 0, 1, 0), id="no-retries-allowed"),
        pytest.param(
            (429, {"Retry-After": "Wed, 21 Oct 2037 07:28:00 GMT"}, 3, 1, 0), id="http-date"
        ),
    ],
)
async def test_what_is_not_retried_ends_shed(scripted, tmp_path, case):
    """No hint, no budget left, or a date instead of seconds: the answer stands, as shed."""
    status, headers, retries, posts, counted = case
    url, seen = await scripted(lambda body, attempt: refused(status, **headers))
    path = trace_file(tmp_path, [(0, 3, 4)])
    report = await run_load(LoadConfig(url, trace=path, retries=retries, duration_s=1))
    assert len(seen) == posts
    assert (report.sent, report.shed, report.retries) == (1, 1, counted)
    assert report.status_counts == {str(status): 1}


async def test_retries_stop_at_the_end_of_the_run(scripted, tmp_path):
    """A retry that would start after the deadline plus grace is not made."""
    url, seen = await scripted(lambda body, attempt: refused(503, **{"Retry-After": "30"}))
    path = trace_file(tmp_path, [(0, 3, 4)])
    config = LoadConfig(url, trace=path, retries=5, retry_cap_s=20, duration_s=0.5, grace_s=0.3)
    report = await run_load(config)
    assert len(seen) == 1
    assert (report.shed, report.retries) == (1, 0)
    assert report.duration_s < 2.0


async def test_every_request_ends_one_way(scripted, tmp_path):
    """4xx is refused (kvguard's window cap, an engine's 400), 5xx failed, 503 shed."""
    endings = {1: refused(400), 2: refused(500), 3: refused(503), 4: None, 5: refused(404)}

    def answer(body: dict, attempt: int) -> web.Response:
        fixed = endings[len(body["prompt"].split())]
        return fixed if fixed is not None else answered(body)

    url, _ = await scripted(answer)
    path = trace_file(tmp_path, [(0, n, 2) for n in endings])
    report = await run_load(LoadConfig(url, trace=path, stream=False, duration_s=1))
    assert (report.sent, report.succeeded, report.refused, report.failed, report.shed) == (
        5,
        1,
        2,
        1,
        1,
    )
    assert report.unfinished == 0
    assert report.goodput == report.slo_met == 1
    for name, counts in report.by_priority.items():
        ends = counts.completed + counts.shed + counts.refused + counts.failed + counts.unfinished
        assert counts.sent == ends, name


async def test_a_clamped_answer_is_completed_but_not_good(scripted, tmp_path):
    """Someone lowered max_tokens to 2: a 10-token answer ended early; a 2-token one did not."""
    url, seen = await scripted(lambda body, attempt: answered(body, min(body["max_tokens"], 2)))
    path = trace_file(tmp_path, [(0, 3, 10), (0, 4, 2)])
    report = await run_load(LoadConfig(url, trace=path, stream=False, duration_s=1))
    assert [b["max_tokens"] for b in seen] == [10, 2]  # ignore-eos: the true length is asked
    assert (report.succeeded, report.clamped, report.slo_met) == (2, 1, 1)
    assert report.goodput_tokens == 2
    assert report.completion_tokens == 4
    assert report.requested_max_tokens == 12


async def test_the_client_over_asks_and_the_simulator_stops_at_the_true_length(
    sim_engine, tmp_path
):
    """Default: max_tokens 2048 (within the context); the answer still has its true length.

    Depends on the simulated engine honouring kvguard_sim_output_tokens.
    """
    url = await sim_engine(**ROOMY)
    path = trace_file(tmp_path, [(0, 20, 5), (0, 30, 7)])
    before = await counters(url)
    over = await run_load(LoadConfig(url, trace=path, duration_s=1))
    after = await counters(url)
    assert over.output_length == "sim-field"
    assert over.client_max_tokens == 2048
    assert over.completion_tokens == 12 == delta(before, after, "vllm:generation_tokens_total")
    assert over.requested_max_tokens == 2 * 2048
    assert over.clamped == 0
    exact = await run_load(LoadConfig(url, trace=path, duration_s=1, client_max_tokens=None))
    assert (exact.client_max_tokens, exact.requested_max_tokens) == ("trace", 12)
    assert exact.completion_tokens == 12
    # A client budget below a true length ends that answer at the budget: not a clamp.
    short = await run_load(LoadConfig(url, trace=path, duration_s=1, client_max_tokens=6))
    assert (short.completion_tokens, short.requested_max_tokens, short.clamped) == (11, 12, 0)


async def test_the_client_budget_is_capped_at_the_context_left(scripted, tmp_path):
    """sim-field sends the true length in its own field, max_tokens within the context."""
    url, seen = await scripted(lambda body, attempt: answered(body), max_model_len=1000)
    path = trace_file(tmp_path, [(0, 100, 5), (0, 998, 5)])
    report = await run_load(
        LoadConfig(url, trace=path, output_length="sim-field", stream=False, duration_s=1)
    )
    assert report.output_length == "sim-field"
    assert [b["max_tokens"] for b in seen] == [900, 5]  # 998 + 5 > 1000: the prompt gave way
    assert [len(b["prompt"].split()) for b in seen] == [100, 995]
    assert [b["kvguard_sim_output_tokens"] for b in seen] == [5, 5]
    assert all("ignore_eos" not in b for b in seen)


async def test_a_request_over_the_tpot_slo_is_not_good(sim_engine, tmp_path):
    """About 20 ms per token: good under a 0.1 s TPOT SLO, none under a 5 ms one."""
    url = await sim_engine(**ROOMY, step_fixed_s=0.02, per_token_s=0.0)
    path = trace_file(tmp_path, [(0, 10, 6), (0.05, 10, 6), (0.1, 10, 6)])
    loose = await run_load(LoadConfig(url, trace=path, duration_s=1))
    tight = await run_load(LoadConfig(url, trace=path, duration_s=1, slo_tpot_s=0.005))
    assert loose.succeeded == tight.succeeded == 3
    assert loose.slo_met == 3
    assert loose.goodput_tokens == 18
    assert tight.slo_met == tight.goodput == tight.goodput_tokens == 0
    assert tight.slo_attainment == 0.0
    assert tight.tpot_p99_s is not None
    assert tight.tpot_p99_s > 0.015
    assert "SLO met" in tight.render()


# ---------------------------------------------------------------- SLO arithmetic
def outcome(**fields: object) -> RequestOutcome:
    """A completed, streamed 11-token answer: TTFT 0.5 s, 1.5 s in all (TPOT 0.1 s)."""
    base: dict[str, object] = {
        "priority": "standard",
        "status": "200",
        "kind": "completed",
        "ttft_s": 0.5,
        "e2e_s": 1.5,
        "completion_tokens": 11,
        "finish_reason": "stop",
        "max_tokens": 2048,
        "output_tokens": 11,
    }
    return RequestOutcome(**{**base, **fields})  # type: ignore[arg-type]


def test_tpot_is_the_mean_time_per_token_after_the_first():
    """(e2e - ttft) / (tokens - 1); 0 for one token; e2e / tokens without streaming."""
    assert outcome().tpot_s == pytest.approx(0.1)
    assert outcome(completion_tokens=1).tpot_s == 0.0
    assert outcome(streamed=False, ttft_s=None).tpot_s == pytest.approx(1.5 / 11)
    assert outcome(kind="shed").tpot_s is None


@pytest.mark.parametrize(
    ("fields", "good"),
    [
        ({}, True),
        ({"e2e_s": 1.51}, False),  # TPOT just over 0.1 s
        ({"ttft_s": 2.01, "e2e_s": 2.5}, False),  # TTFT over 2 s
        # Not streamed: done by 2 s + 0.1 s x (11 - 1) tokens, as a good stream would be.
        ({"streamed": False, "ttft_s": None, "e2e_s": 2.95}, True),
        ({"streamed": False, "ttft_s": None, "e2e_s": 3.05}, False),
        ({"finish_reason": "length", "completion_tokens": 11, "output_tokens": 40}, False),
        ({"finish_reason": "length", "max_tokens": 11, "output_tokens": 40}, True),  # own cap
        ({"kind": "failed"}, False),
        ({"kind": "unfinished"}, False),
    ],
)
def test_a_good_request_meets_every_part_of_the_slo(fields, good):
    """Completed, not clamped, TTFT <= 2 s and TPOT <= 0.1 s."""
    assert Slo(ttft_s=2.0, tpot_s=0.1).met(outcome(**fields)) is good


def test_the_optional_e2e_bound_and_class_counts():
    """An e2e bound rejects slow answers; counts add up and attainment is over sent."""
    assert not Slo(2.0, 0.1, e2e_s=1.0).met(outcome())
    outcomes = [
        outcome(),
        outcome(e2e_s=3.0),  # TPOT 0.25: completed, not good
        outcome(finish_reason="length", completion_tokens=3, output_tokens=11, e2e_s=0.7),
        outcome(kind="shed", status="429", retries=2),
        outcome(kind="refused", status="400"),
    ]
    counts = ClassCounts.of(outcomes, Slo())
    assert (counts.sent, counts.completed, counts.shed, counts.refused) == (5, 3, 1, 1)
    assert (counts.clamped, counts.slo_met, counts.goodput_tokens, counts.retries) == (1, 1, 11, 2)
    assert counts.slo_attainment == pytest.approx(0.2)
    assert counts.requested_max_tokens == 3 * 2048
    assert counts.completion_tokens == 25
    assert ClassCounts.of([], Slo()).slo_attainment is None


async def test_engine_priority_sends_the_class_as_vllm_priority(scripted, tmp_path):
    """engine_priority: critical 0, standard 1, sheddable 2 in the body; off: no field."""
    url, seen = await scripted(lambda body, attempt: answered(body))
    path = trace_file(tmp_path, [(0, n, 2) for n in range(1, 31)])
    shares = PriorityShares(1, 1, 1)
    await run_load(
        LoadConfig(
            url,
            trace=path,
            stream=False,
            duration_s=1,
            engine_priority=True,
            priority_shares=shares,
        )
    )
    sent = {(b["x_priority"], b["priority"]) for b in seen}
    assert sent == {("critical", 0), ("standard", 1), ("sheddable", 2)}
    seen.clear()
    await run_load(LoadConfig(url, trace=path, stream=False, duration_s=1))
    assert all("priority" not in b for b in seen)
