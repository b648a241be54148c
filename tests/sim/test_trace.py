"""Trace replay: parsing both formats, every malformed file, offsets, and the command.

The small traces are written here, in tmp_path; the realistic one is the first 200
requests of the Azure LLM inference trace 2023 (tests/fixtures/traces/README.md).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp import web

from kvguard.cli.main import main
from kvguard.errors import InvalidInputError
from kvguard.sim.loadgen import LoadConfig, run_load
from kvguard.sim.trace import TraceFileError, detect_format, load_trace, replay
from kvguard.sim.traffic import PriorityShares, TrafficParams

FIXTURE = Path(__file__).parent.parent / "fixtures" / "traces" / "azure-llm-2023-code-head.csv"
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"
BURST_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"
ROOMY = {"kv_capacity_tokens": 65_536, "max_model_len": 4096, "max_num_seqs": 64}


def write(tmp_path: Path, text: str, name: str = "trace.csv") -> Path:
    """``text`` as a file in tmp_path."""
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------- parsing
def test_azure_offsets_are_exact_from_seven_fractional_digits(tmp_path):
    """100 ns steps survive, across midnight; sizes are read as recorded."""
    path = write(
        tmp_path,
        f"{AZURE_HEADER}\n"
        "2023-11-16 23:59:59.9999999,4808,10\n"
        "2023-11-17 00:00:00.0000001,3180,8\n"
        "2023-11-17 00:00:02.5,110,0\n",
    )
    trace = load_trace(path)
    assert trace.trace_format == "azure"
    assert [r.offset_s for r in trace.requests] == [0.0, 2e-7, 2.5000001]
    assert [(r.prompt_tokens, r.output_tokens) for r in trace.requests] == [
        (4808, 10),
        (3180, 8),
        (110, 0),
    ]
    assert [r.line for r in trace.requests] == [2, 3, 4]
    assert trace.name == "trace.csv"


def test_burstgpt_with_spaces_in_the_header_and_a_failed_request(tmp_path):
    """Offsets from the first row; a Response tokens 0 (a failed request) replays as 1 token."""
    path = write(
        tmp_path,
        "Timestamp, Model, Request tokens, Response tokens, Total tokens, Log Type\n"
        "5,ChatGPT,472,18,490,Conversation log\n"
        "6.5,GPT-4,1020,0,1020,API log\n"
        "9,ChatGPT,30,200,230,Conversation log\n",
    )
    trace = load_trace(path)
    assert trace.trace_format == "burstgpt"
    assert [(r.offset_s, r.prompt_tokens, r.output_tokens) for r in trace.requests] == [
        (0.0, 472, 18),
        (1.5, 1020, 0),
        (4.0, 30, 200),
    ]
    specs = list(replay(trace, TrafficParams(duration_s=100), seed=0))
    assert [s.output_tokens for s in specs] == [18, 1, 200]


def test_the_format_is_told_by_the_header():
    """Exactly the two headers (spaces around names ignored); anything else is neither."""
    assert detect_format(AZURE_HEADER.split(",")) == "azure"
    assert detect_format(BURST_HEADER.split(",")) == "burstgpt"
    assert detect_format([" TIMESTAMP", "ContextTokens ", "GeneratedTokens"]) == "azure"
    assert detect_format(["timestamp", "ContextTokens", "GeneratedTokens"]) is None
    assert detect_format(AZURE_HEADER.split(",")[:2]) is None


def test_a_given_format_must_match_the_header(tmp_path):
    """--trace-format burstgpt on an Azure file is refused at line 1, naming the header."""
    path = write(tmp_path, f"{AZURE_HEADER}\n2023-11-16 18:17:03.9799600,4808,10\n")
    assert load_trace(path, "azure").trace_format == "azure"
    with pytest.raises(TraceFileError) as caught:
        load_trace(path, "burstgpt")
    assert caught.value.line == 1
    assert "a burstgpt trace starts with the header Timestamp,Model," in str(caught.value)
    with pytest.raises(InvalidInputError) as unknown:
        load_trace(path, "sharegpt")
    assert unknown.value.field == "--trace-format"


def test_the_real_trace_head_reads_whole():
    """The fixture: 200 requests over 199 s, the first row as published."""
    trace = load_trace(FIXTURE)
    assert trace.trace_format == "azure"
    assert len(trace.requests) == 200
    first, second = trace.requests[:2]
    assert (first.offset_s, first.prompt_tokens, first.output_tokens) == (0.0, 4808, 10)
    assert second.offset_s == pytest.approx(0.052)
    assert trace.span_s == pytest.approx(199.089585)
    offsets = [r.offset_s for r in trace.requests]
    assert offsets == sorted(offsets)


MALFORMED = [
    pytest.param("", 1, "the file is empty", id="empty"),
    pytest.param("\n\n", 1, "the file is empty", id="blank-lines-only"),
    pytest.param(f"{AZURE_HEADER}\n", 2, "no requests", id="header-without-rows"),
    pytest.param(f"{AZURE_HEADER}\n\n", 3, "no requests", id="header-and-a-blank-line"),
    pytest.param("time,prompt,output\n1,2,3\n", 1, "the header must be", id="bad-header"),
    pytest.param("2023-11-16 18:17:03.9799600,4808,10\n", 1, "the header", id="no-header"),
    pytest.param(
        f"{AZURE_HEADER}\n2023-11-16 18:17:03.1,4808,10\n2023-11-16 18:17:04.1,abc,10\n",
        3,
        "ContextTokens must be a whole number of tokens, got 'abc'",
        id="non-numeric-size",
    ),
    pytest.param(
        f"{AZURE_HEADER}\n2023-11-16 18:17:03.1,4808,10.5\n",
        2,
        "GeneratedTokens must be a whole number",
        id="fractional-size",
    ),
    pytest.param(
        f"{AZURE_HEADER}\n2023-11-16 18:17:03.1,4808,-1\n",
        2,
        "GeneratedTokens must be a number of tokens >= 0",
        id="negative-size",
    ),
    pytest.param(
        f"{AZURE_HEADER}\n2023-11-16 18:17:03.5,1,1\n2023-11-16 18:17:04,1,1\n"
        "2023-11-16 18:17:03.9,1,1\n",
        4,
        "timestamps must not go back",
        id="out-of-order",
    ),
    pytest.param(
        f"{AZURE_HEADER}\n16/11/2023 18:17:03,1,1\n", 2, "TIMESTAMP must look like", id="bad-time"
    ),
    pytest.param(
        f"{AZURE_HEADER}\n2023-02-30 18:17:03,1,1\n", 2, "not a real date", id="no-such-date"
    ),
    pytest.param(
        f"{AZURE_HEADER}\n2023-11-16 18:17:03.1,4808\n", 2, "this has 2", id="missing-field"
    ),
    pytest.param(
        f"{BURST_HEADER}\n1,ChatGPT,10,10,20,API log\nsoon,ChatGPT,10,10,20,API log\n",
        3,
        "Timestamp must be a number of seconds",
        id="burstgpt-bad-time",
    ),
    pytest.param(
        f"{BURST_HEADER}\n1,ChatGPT,10,10,20,API log\n2,ChatGPT,-4,10,6,API log\n",
        3,
        "Request tokens must be a number of tokens >= 0",
        id="burstgpt-negative",
    ),
]


@pytest.mark.parametrize(("text", "line", "problem"), MALFORMED)
def test_a_malformed_file_names_its_line(tmp_path, text, line, problem):
    """Each malformed file is one error naming the flag, the file and the line."""
    path = write(tmp_path, text)
    with pytest.raises(TraceFileError) as caught:
        load_trace(path)
    assert caught.value.field == "--trace"
    assert caught.value.line == line
    assert f"{path} line {line}: " in str(caught.value)
    assert problem in str(caught.value)


def test_non_utf8_and_unreadable_files(tmp_path):
    """Bytes that are not UTF-8 name their line; a missing file or a directory cannot be read."""
    path = tmp_path / "latin1.csv"
    path.write_bytes(f"{AZURE_HEADER}\n2023-11-16 18:17:03.1,1,1\n".encode() + b"caf\xe9,1,1\n")
    with pytest.raises(TraceFileError) as caught:
        load_trace(path)
    assert caught.value.line == 3
    assert "is not UTF-8" in str(caught.value)
    for unreadable in (tmp_path / "missing.csv", tmp_path):
        with pytest.raises(TraceFileError) as caught:
            load_trace(unreadable)
        assert caught.value.line == 0
        assert "cannot be read" in str(caught.value)


def test_a_byte_order_mark_and_windows_line_ends_are_fine(tmp_path):
    """Spreadsheet exports start with a BOM and end lines with CRLF."""
    path = tmp_path / "excel.csv"
    path.write_bytes(f"\ufeff{AZURE_HEADER}\r\n2023-11-16 18:17:03.1,7,3\r\n".encode())
    trace = load_trace(path)
    assert [(r.prompt_tokens, r.output_tokens) for r in trace.requests] == [(7, 3)]


# ---------------------------------------------------------------- replay
def burst_trace(tmp_path: Path, rows: list[tuple[float, int, int]]) -> Path:
    """A BurstGPT file of (timestamp, request tokens, response tokens) rows."""
    lines = [BURST_HEADER] + [f"{t},ChatGPT,{p},{o},{p + o},API log" for t, p, o in rows]
    return write(tmp_path, "\n".join(lines) + "\n")


def test_speed_and_start_set_the_offsets(tmp_path):
    """--start-s skips recorded seconds; --speed divides what is left."""
    trace = load_trace(
        burst_trace(tmp_path, [(100, 1, 1), (102, 2, 2), (104, 3, 3), (110, 4, 4), (130, 5, 5)])
    )
    params = TrafficParams(duration_s=5.0)
    assert [s.at_s for s in replay(trace, params, seed=0)] == [0.0, 2.0, 4.0]
    fast = list(replay(trace, params, seed=0, speed=4))
    assert [s.at_s for s in fast] == [0.0, 0.5, 1.0, 2.5]
    late = list(replay(trace, params, seed=0, speed=2, start_s=3))
    assert [(s.at_s, s.prompt_tokens) for s in late] == [(0.5, 3), (3.5, 4)]


def test_sizes_are_scaled_and_capped_like_the_patterns(tmp_path):
    """Scale rounds (never below 1); the context cap cuts the prompt first."""
    trace = load_trace(burst_trace(tmp_path, [(0, 1000, 30), (1, 3, 0), (2, 50, 900)]))
    specs = list(replay(trace, TrafficParams(duration_s=10, scale=0.1, max_context=60), seed=0))
    assert [(s.prompt_tokens, s.output_tokens) for s in specs] == [(57, 3), (1, 1), (1, 59)]


def test_priorities_are_drawn_from_the_seed(tmp_path):
    """The same seed gives the same classes; the shares are honoured; another seed differs."""
    trace = load_trace(burst_trace(tmp_path, [(t, 10, 10) for t in range(200)]))
    params = TrafficParams(duration_s=1000)

    def classes(seed: int, shares: PriorityShares | None = None) -> list[str]:
        mix = params if shares is None else TrafficParams(duration_s=1000, shares=shares)
        return [s.priority for s in replay(trace, mix, seed=seed)]

    assert classes(1) == classes(1)
    assert classes(1) != classes(2)
    assert set(classes(3, PriorityShares(0, 0, 1))) == {"sheddable"}
    assert {"critical", "standard", "sheddable"} == set(classes(1))


def test_bad_speed_or_start_are_refused(tmp_path):
    """Speed > 0, start >= 0; both only with a trace; a start past the end replays nothing."""
    with pytest.raises(InvalidInputError) as caught:
        LoadConfig("http://h:1", speed=2.0)
    assert caught.value.field == "speed"
    for field, value in (("speed", 0.0), ("start_s", -1.0), ("speed", float("inf"))):
        with pytest.raises(InvalidInputError) as caught:
            LoadConfig("http://h:1", trace="x.csv", **{field: value})
        assert caught.value.field == field


# ---------------------------------------------------------------- against a server
@pytest.fixture
async def recorder():
    """An OpenAI-style server that records each body with its arrival time; 'vllm' card."""
    seen: list[dict] = []
    loop = asyncio.get_running_loop()

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append({**body, "received_at": loop.time()})
        tokens = body["max_tokens"]
        usage = {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": tokens}
        return web.json_response(
            {"choices": [{"text": " x" * tokens, "finish_reason": "length"}], "usage": usage}
        )

    async def models(_: web.Request) -> web.Response:
        card = {"id": "real", "object": "model", "owned_by": "vllm", "max_model_len": 100_000}
        return web.json_response({"object": "list", "data": [card]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", seen
    await runner.cleanup()


async def test_a_trace_is_replayed_at_its_recorded_times(recorder, tmp_path):
    """Arrivals keep the recorded gaps divided by --speed; sizes and true lengths are sent."""
    url, seen = recorder
    path = burst_trace(tmp_path, [(10, 5, 3), (10, 6, 4), (12, 7, 5), (14, 8, 6), (50, 9, 9)])
    report = await run_load(
        LoadConfig(url, trace=str(path), speed=4, duration_s=2.0, stream=False, grace_s=1)
    )
    assert report.sent == report.succeeded == len(seen) == 4  # the fifth is after 2 s
    assert report.pattern == "trace"
    assert (report.trace, report.speed, report.start_s) == ("trace.csv", 4, 0.0)
    # A real engine's card: the true length travels as max_tokens with ignore_eos.
    assert report.output_length == "ignore-eos"
    assert [len(s["prompt"].split()) for s in seen] == [5, 6, 7, 8]
    assert [s["max_tokens"] for s in seen] == [3, 4, 5, 6]
    assert all(s["ignore_eos"] is True and "kvguard_sim_output_tokens" not in s for s in seen)
    start = seen[0]["received_at"]
    gaps = [s["received_at"] - start for s in seen]
    assert gaps == pytest.approx([0.0, 0.0, 0.5, 1.0], abs=0.1)


async def test_the_real_trace_head_against_the_simulator(sim_server):
    """The fixture replayed fast at a simulated vLLM: every request answered, sizes as recorded."""
    server = await sim_server(kv_capacity_tokens=131_072, max_model_len=8192, max_num_seqs=64)
    trace = load_trace(FIXTURE)
    config = LoadConfig(
        server.url, trace=str(FIXTURE), speed=100, duration_s=3.0, max_requests=60, seed=4
    )
    planned = list(replay(trace, config.traffic(), seed=4, speed=100))[:60]
    report = await run_load(config)
    assert report.sent == report.succeeded == 60
    assert server.engine.stats.requests_total == 60
    assert report.output_length == "sim-field"
    assert report.prompt_tokens == sum(s.prompt_tokens for s in planned)
    assert report.completion_tokens == sum(s.output_tokens for s in planned)
    assert report.clamped == 0
    assert sum(c.sent for c in report.by_priority.values()) == 60


# ---------------------------------------------------------------- the command
async def run_cli(*argv: str) -> int:
    """``kvguard ARGV`` in a thread (it runs its own event loop); its exit code."""
    return await asyncio.to_thread(main, list(argv))


@pytest.mark.parametrize(
    ("text", "line"),
    [
        pytest.param(f"{AZURE_HEADER}\n2023-11-16 18:17:03.1,x,1\n", 2, id="non-numeric"),
        pytest.param(
            f"{AZURE_HEADER}\n" + "2023-11-16 18:17:03.1,1,1\n" * 5 + "2023-11-16 18:17:02,1,1\n",
            7,
            id="out-of-order",
        ),
        pytest.param("", 1, id="empty"),
        pytest.param(f"{AZURE_HEADER}\n", 2, id="header-only"),
    ],
)
async def test_a_bad_trace_exits_2_in_one_line_and_sends_nothing(
    sim_server, tmp_path, capsys, text, line
):
    """The whole file is checked before any request: one line naming file and line, exit 2.

    (test_a_good_trace_runs_from_the_command shows the same command does send.)
    """
    server = await sim_server(**ROOMY)
    path = write(tmp_path, text)
    code = await run_cli("loadgen", "--url", server.url, "--trace", str(path), "--duration", "1")
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1
    assert err.startswith(f"kvguard loadgen: error: --trace: {path} line {line}: ")
    assert server.engine.stats.requests_total == 0


async def test_a_good_trace_runs_from_the_command(sim_server, tmp_path, capsys):
    """The same kind of file, valid: requests reach the engine and the JSON names the trace."""
    server = await sim_server(**ROOMY)
    path = write(
        tmp_path,
        f"{AZURE_HEADER}\n" + "".join(f"2023-11-16 18:17:0{n}.5,20,4\n" for n in range(4)),
    )
    code = await run_cli(
        *("loadgen", "--url", server.url, "--trace", str(path), "--speed", "10"),
        *("--start-s", "1", "--json", "-", "--seed", "3"),
    )
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert server.engine.stats.requests_total == data["sent"] == 3  # the first second skipped
    assert (data["pattern"], data["trace"], data["speed"], data["start_s"]) == (
        "trace",
        "trace.csv",
        10.0,
        1.0,
    )


async def test_unreadable_trace_and_misplaced_flags_exit_2(tmp_path, capsys):
    """A missing file, --speed without --trace, a start past the end: each a one-line error."""
    good = write(
        tmp_path, f"{AZURE_HEADER}\n2023-11-16 18:17:03.1,1,1\n2023-11-16 18:17:13.1,1,1\n"
    )
    url = "http://127.0.0.1:1"
    cases = [
        (("--trace", str(tmp_path / "nope.csv")), f"--trace: {tmp_path / 'nope.csv'}: cannot"),
        (("--speed", "2"), "--speed: applies only when replaying a trace"),
        (("--start-s", "5"), "--start-s: applies only when replaying a trace"),
        (("--trace", str(good), "--speed", "0"), "--speed: must be a number > 0"),
        (("--trace", str(good), "--start-s", "11"), "--start-s: must be at most 10 s"),
        (("--trace", str(good), "--client-max-tokens", "many"), "--client-max-tokens: must be"),
    ]
    for flags, expected in cases:
        assert await run_cli("loadgen", "--url", url, *flags) == 2, flags
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert expected in err, err


def test_pattern_and_trace_are_exclusive(capsys):
    """Naming both a pattern and a trace is an argparse error (exit 2)."""
    with pytest.raises(SystemExit) as caught:
        main(["loadgen", "--url", "http://h:1", "--pattern", "steady", "--trace", "x.csv"])
    assert caught.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
