"""`kvguard demo`: the same seeded burst crashes the engine without kvguard, not with it."""

from __future__ import annotations

import argparse
import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvguard.cli.demo import (
    EXIT_BAD_INPUT,
    SUMMARY_KEYS,
    add_demo_parser,
    main,
    run_demo,
)
from kvguard.cli.demo_view import LiveView, StatusSample, format_tte, render_summary

# The demo as a newcomer runs it: the installed `kvguard` command.
DEMO = [str(Path(sys.executable).parent / "kvguard"), "demo"]


def _sample(t_s: float, **guarded: object) -> StatusSample:
    return StatusSample(
        t_s=t_s, duration_s=30.0, kv_usage=0.5, running=3, waiting=1, completed=7, **guarded
    )


@pytest.mark.slow  # a long run: scripts/test.sh's second stage
def test_demo_crashes_unguarded_and_not_guarded(tmp_path):
    """Default seed and pattern, 20 s per run: unguarded crashes, guarded does not.

    The guarded run completes requests; the JSON holds both runs with every summary key.
    """
    out = tmp_path / "demo.json"
    proc = subprocess.run(
        [*DEMO, "--duration", "20", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(out.read_text())
    assert set(summary) == {"unguarded", "guarded"}
    for run in summary.values():
        assert set(SUMMARY_KEYS) <= set(run)
    unguarded, guarded = summary["unguarded"], summary["guarded"]
    assert unguarded["engine_crashes"] >= 1, unguarded
    assert unguarded["crashed_at_s"] < 20
    # The crash's own words first: pytest cuts a long dict short.
    assert guarded["engine_crashes"] == 0, (
        guarded["crashed_at_s"],
        guarded["crash_message"],
        guarded["cancelled"],
    )
    assert guarded["completed"] > 0
    assert 0 <= guarded["shed_no_room"] <= guarded["shed"]
    # The terminal shows both runs as they happen, then the table (not a TTY: plain lines).
    assert "Run 1 of 2" in proc.stdout
    assert "Run 2 of 2" in proc.stdout
    assert "ENGINE CRASHED" in proc.stdout
    assert "without kvguard" in proc.stdout
    assert "\r" not in proc.stdout


def test_ctrl_c_stops_cleanly_with_130():
    """SIGINT during a run stops the engine and kvguard and exits 130 within seconds."""
    with subprocess.Popen(
        [*DEMO, "--duration", "60", "--pattern", "steady"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            assert proc.stdout is not None
            first = proc.stdout.readline()  # the first run's header: the load is starting
            assert "Run 1 of 2" in first
            time.sleep(1.0)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=15)
        finally:
            proc.kill()
    assert proc.returncode == 130
    assert "interrupted" in err


def test_zero_duration_is_a_one_line_error(capsys):
    """--duration 0: exit 2, one line naming the flag and what it allows."""
    assert main(["--duration", "0"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--duration" in err
    assert "> 0 and <= 600" in err


def test_json_in_a_missing_directory_is_refused_before_any_run(tmp_path, capsys):
    """A --json path that cannot be written fails at once, not after a minute of runs."""
    started = time.monotonic()
    assert main(["--json", str(tmp_path / "nope" / "demo.json")]) == EXIT_BAD_INPUT
    assert time.monotonic() - started < 5
    assert "--json" in capsys.readouterr().err


def test_unknown_pattern_is_an_argparse_error(capsys):
    """--pattern must name a loadgen pattern; the error lists them on one line."""
    with pytest.raises(SystemExit) as exc:
        main(["--pattern", "nope"])
    assert exc.value.code == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "mixed" in err


def test_subcommand_registers_with_the_handler():
    """add_demo_parser adds `demo` with run_demo as its handler and the documented defaults."""
    parser = argparse.ArgumentParser()
    add_demo_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["demo"])
    assert args.handler is run_demo
    assert (args.pattern, args.seed, args.json, args.quiet) == ("mixed", 1, None, False)
    assert args.duration > 0


def test_plain_view_writes_at_most_one_line_per_second():
    """Off a terminal: status offered every 0.1 s becomes one line a second, events folded in."""
    out = io.StringIO()
    view = LiveView(out, terminal=False)
    for step in range(31):  # 3 s
        t = step / 10
        if step == 12:
            view.event(t, "level ok -> high")
        view.status(100.0 + t, _sample(t))
    view.end_run()
    lines = out.getvalue().splitlines()
    assert len(lines) == 4  # at 0, 1, 2 and 3 s
    assert sum("level ok -> high" in line for line in lines) == 1
    assert "\r" not in out.getvalue()


def test_terminal_view_redraws_one_status_line_and_keeps_events():
    """On a terminal the status line is redrawn in place; each event gets a line of its own."""
    out = io.StringIO()
    view = LiveView(out, terminal=True)
    view.status(0.0, _sample(0.0, level="ok", pattern="steady"))
    view.event(0.5, "shed sheddable traffic and below")
    view.status(1.0, _sample(1.0, level="high", pattern="bursty_short"))
    view.end_run()
    text = out.getvalue()
    assert text.count("\n") == 2  # the event, and the final status kept on screen
    assert "\r\x1b[K" in text
    assert "level high" in text


def test_quiet_view_writes_nothing():
    """--quiet: nothing but the summary."""
    out = io.StringIO()
    view = LiveView(out, terminal=False, quiet=True)
    view.line("Run 1 of 2")
    view.status(0.0, _sample(0.0))
    view.event(0.0, "x")
    view.end_run()
    assert out.getvalue() == ""


def test_summary_is_side_by_side():
    """Both columns, the crash time, and what it means."""
    base = dict.fromkeys(SUMMARY_KEYS, 0) | {"duration_s": 30.0, "crashed_at_s": None}
    unguarded = base | {"engine_crashes": 1, "crashed_at_s": 2.5, "completed": 12}
    guarded = base | {
        "completed": 300,
        "shed": 40,
        "shed_no_room": 25,
        "p50_latency_s": 0.8,
        "p99_latency_s": 3.1,
    }
    text = render_summary(unguarded, guarded)
    assert "25 of the shed found no room in the engine's pool" in text
    assert "the other 15 were shed by the pressure level" in text
    # All of them for want of room: no "rest" to speak of.
    alone = render_summary(unguarded, guarded | {"shed_no_room": 40})
    assert "All of the shed found no room in the engine's pool" in alone
    assert "pressure level" not in alone.split("All of the shed")[1]
    assert any(
        line.startswith("  no room in the pool") and "25" in line for line in text.splitlines()
    )
    assert "without kvguard" in text
    assert "with kvguard" in text
    assert "1 (at 2.5 s)" in text
    assert "3.10 s" in text
    assert "crashed after 2.5 s" in text
    assert format_tte(float("inf")) == "none"
