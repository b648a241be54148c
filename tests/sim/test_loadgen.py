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
from kvguard.sim.loadgen_report import LoadReport, Percentiles, preemptions_in
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
    assert report.completion_tokens == sum(s.max_tokens for s in planned)
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

    first, second, other = await run(5), await run(5), await run(6)
    assert (first.sent, first.by_priority, first.prompt_tokens, first.completion_tokens) == (
        second.sent,
        second.by_priority,
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
        by_priority={},
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
    )
    data = json.loads(json.dumps(report.as_dict()))
    assert data["ttft_s"] == {"p50": 0.1, "p90": 0.2, "p99": 0.3, "max": 0.4}
    assert data["e2e_s"] is None
    assert data["goodput_ratio"] == 0.5
    text = report.render()
    for expected in ("sent 4  ok 2  shed 1  failed 1", "prompt 1,234", "50.0%", "503: 1"):
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
