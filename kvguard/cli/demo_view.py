"""What ``kvguard demo`` shows: the live view while a run lasts, and the final summary.

:class:`LiveView` draws on a terminal one status line redrawn in place, with one line
per level change, action or crash above it; anywhere else (CI logs, pipes) it writes
plain lines, at most one per :data:`PLAIN_INTERVAL_S`, folding the events of that
second into the line. Quiet, it writes nothing. The text itself comes from the pure
functions below, so it can be tested without a run.
"""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
import sys
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, TextIO, cast

from kvguard.core.bars import text_bar
from kvguard.core.policy import Action, Decision
from kvguard.sim.runner import PoolSpec

PLAIN_INTERVAL_S = 1.0
TERMINAL_INTERVAL_S = 0.2
_BAR_WIDTH = 10
_CLEAR_LINE = "\r\x1b[K"  # carriage return, erase to the end of the line


@dataclass(frozen=True)
class StatusSample:
    """What the status line shows at one moment of a run.

    The engine's figures are read in-process (the ground truth the demo compares);
    ``level`` and what follows it are kvguard's view, None in the unguarded run.
    """

    t_s: float
    duration_s: float
    kv_usage: float
    running: int
    waiting: int
    completed: int
    level: str | None = None
    pattern: str | None = None
    time_to_exhaustion_s: float | None = None
    shed: int = 0


def status_text(sample: StatusSample) -> str:
    """The one-line status of a run, what matters most first (a narrow terminal cuts it)."""
    bar = text_bar(min(sample.kv_usage, 1.0), _BAR_WIDTH, fill="#", empty=".")
    kv = f"KV {sample.kv_usage:4.0%} [{bar}]"
    clock = f"{sample.t_s:5.1f}/{sample.duration_s:g}s"
    queue = f"running {sample.running}  waiting {sample.waiting}"
    if sample.level is None:
        parts = [clock, "kvguard off   ", kv, f"done {sample.completed}", queue]
    else:
        parts = [
            clock,
            f"level {sample.level:<8}",
            kv,
            f"exhaustion {format_tte(sample.time_to_exhaustion_s)}",
            f"pattern {sample.pattern or 'n/a'}",
            f"done {sample.completed}",
            f"shed {sample.shed}",
            queue,
        ]
    return "  ".join(parts)


def format_tte(tte_s: float | None) -> str:
    """Time to exhaustion for people: ``in 3.2s``, or ``none`` when usage is not rising."""
    if tte_s is None or math.isinf(tte_s):
        return "none"
    return f"in {tte_s:.1f}s"


def action_text(action: Action) -> str:
    """One action of a plan, in the operator's words."""
    if action.kind == "shed":
        return f"shed {action.priority} traffic and below"
    if action.kind == "tighten_window":
        caps = []
        if action.max_prompt_tokens is not None:
            caps.append(f"prompts <= {action.max_prompt_tokens} tokens")
        if action.max_tokens is not None:
            caps.append(f"max_tokens <= {action.max_tokens}")
        return "tighten window: " + (", ".join(caps) or "no cap")
    if action.kind == "cancel_largest":
        return "cancel the largest request"
    if action.kind == "release":
        return f"release {action.target}"
    return action.kind.replace("_", " ")


def decision_events(decision: Decision, new_counts: Counter[tuple[str, str]]) -> list[str]:
    """One line per level change and per action of a tick's decision.

    ``new_counts`` are the brain's ``(kind, mode)`` counts added this tick: an action
    that was only started, or could not be applied, says so.
    """
    events = []
    if decision.level != decision.previous_level:
        crossed = f" ({', '.join(decision.crossed[:2])})" if decision.crossed else ""
        events.append(
            f"level {decision.previous_level} -> {decision.level}"
            f"  pattern {decision.pattern}{crossed}"
        )
    for action in decision.plan:
        modes = [m for (kind, m), n in new_counts.items() if kind == action.kind and n > 0]
        note = next((f" ({m.replace('_', ' ')})" for m in modes if m != "applied"), "")
        events.append(action_text(action) + note)
    return events


def with_kvguard(sample: StatusSample, decision: Decision | None, shed: int) -> StatusSample:
    """``sample`` with kvguard's view of the same moment (unchanged before its first tick)."""
    if decision is None:
        return sample
    return replace(
        sample,
        level=decision.level,
        pattern=decision.pattern,
        time_to_exhaustion_s=decision.signals.time_to_exhaustion_s,
        shed=shed,
    )


class LiveView:
    """Draws the demo's progress on ``out`` (a terminal, a pipe, or nothing when quiet)."""

    def __init__(self, out: TextIO, *, terminal: bool, quiet: bool = False) -> None:
        self.out = out
        self.terminal = terminal
        self.quiet = quiet
        self._status = ""
        self._drawn = False  # a status line is on screen (terminal only)
        self._pending: list[str] = []  # events not yet written (plain only)
        self._last_write = -math.inf

    def line(self, text: str) -> None:
        """Write a line of its own (a run's header or end) now."""
        if self.quiet:
            return
        self._flush_pending()
        self._write(text)

    def event(self, t_s: float, text: str) -> None:
        """A level change, an action or a crash at ``t_s`` seconds into the run."""
        if self.quiet:
            return
        stamped = f"{t_s:5.1f}s  {text}"
        if self.terminal:
            self._write("  " + stamped)
        else:
            self._pending.append(stamped)

    def status(self, now: float, sample: StatusSample) -> None:
        """Offer a new status at monotonic time ``now``; drawn when it is due."""
        if self.quiet:
            return
        self._status = status_text(sample)
        interval = TERMINAL_INTERVAL_S if self.terminal else PLAIN_INTERVAL_S
        if now - self._last_write < interval:
            return
        self._last_write = now
        if self.terminal:
            self._draw_status()
        else:
            events = "; ".join(self._pending)
            self._pending.clear()
            self._write("  " + self._status + (f"  | {events}" if events else ""))

    def end_run(self) -> None:
        """The run is over: keep its last status and events, then start a fresh line."""
        if self.quiet:
            return
        if self.terminal:
            if self._drawn:
                self.out.write("\n")
                self._drawn = False
        elif self._status:
            self._flush_pending()
        self._status = ""
        self._last_write = -math.inf
        self.out.flush()

    def _flush_pending(self) -> None:
        if self._pending:
            events = "; ".join(self._pending)
            self._pending.clear()
            self._write(f"  {self._status}  | {events}" if self._status else f"  {events}")

    def _write(self, text: str) -> None:
        if self.terminal and self._drawn:
            self.out.write(_CLEAR_LINE)
        self.out.write(text + "\n")
        self._drawn = False
        if self.terminal and self._status:
            self._draw_status()
        self.out.flush()

    def _draw_status(self) -> None:
        width = shutil.get_terminal_size((120, 24)).columns - 1
        self.out.write(_CLEAR_LINE + self._status[:width])
        self.out.flush()
        self._drawn = True


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Keep stderr for real errors while the runs last.

    ``run_load`` draws its own progress line when stderr is a terminal, which would
    garble the view, so stderr says it is none. aiohttp logs a traceback for each
    request whose client left just as the answer started (the load cancels what still
    runs when it ends); those go nowhere.
    """
    real = sys.stderr
    server_log = logging.getLogger("aiohttp.server")
    level = server_log.level
    sys.stderr = cast("TextIO", _NotATerminal(real))
    server_log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        sys.stderr = real
        server_log.setLevel(level)


class _NotATerminal:
    """A stream that writes through to another but says it is not a terminal."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


# ------------------------------------------------------------------ summary
def render_header(pattern: str, seed: int, duration_s: float, pool: PoolSpec) -> str:
    """The summary's first line: what was run, against what."""
    return (
        f"kvguard demo: pattern {pattern}, seed {seed}, {duration_s:g} s per run; a simulated"
        f" engine with a {pool.kv_capacity_tokens or 0:,}-token KV pool"
        f" (max_model_len {pool.max_model_len:,}) that crashes when it runs out"
    )


_ROWS: tuple[tuple[str, str], ...] = (
    ("engine crashes", "engine_crashes"),
    ("preemptions", "preemptions"),
    ("requests sent", "sent"),
    ("completed", "completed"),
    ("shed by kvguard (503)", "shed"),
    ("  no room in the pool", "shed_no_room"),
    ("clamped (max_tokens)", "clamped"),
    ("rejected (window cap)", "rejected"),
    ("cancelled by kvguard", "cancelled"),
    ("failed (errors, lost)", "failed"),
    ("unfinished at the end", "unfinished"),
    ("p50 latency", "p50_latency_s"),
    ("p99 latency", "p99_latency_s"),
)


def _cell(key: str, run: Mapping[str, Any]) -> str:
    value = run.get(key)
    if value is None:
        return "n/a"
    if key.endswith("_s"):
        return f"{value:.2f} s"
    if key == "engine_crashes" and value and run.get("crashed_at_s") is not None:
        return f"{value} (at {run['crashed_at_s']:.1f} s)"
    return f"{value:,}"


def render_summary(unguarded: Mapping[str, Any], guarded: Mapping[str, Any]) -> str:
    """The side-by-side table of both runs, and what it means in one or two sentences."""
    lines = [
        f"{'':<24}{'without kvguard':>18}{'with kvguard':>18}",
        *(
            f"{label:<24}{_cell(key, unguarded):>18}{_cell(key, guarded):>18}"
            for label, key in _ROWS
        ),
        "",
        _verdict(unguarded, guarded),
    ]
    return "\n".join(lines)


def _verdict(unguarded: Mapping[str, Any], guarded: Mapping[str, Any]) -> str:
    if unguarded["engine_crashes"]:
        first = (
            f"Without kvguard the engine ran out of KV cache and crashed after"
            f" {unguarded['crashed_at_s']:.1f} s; {unguarded['completed']:,} requests completed."
        )
    else:
        first = (
            f"Without kvguard the engine survived this run ({unguarded['completed']:,}"
            " requests completed); try another --seed or --pattern."
        )
    if guarded["engine_crashes"]:
        second = (
            f"With kvguard it still crashed, after {guarded['crashed_at_s']:.1f} s"
            f" ({guarded['completed']:,} requests completed)."
        )
    else:
        second = (
            f"With kvguard it served the whole {guarded['duration_s']:g} s without a crash:"
            f" {guarded['completed']:,} completed, {guarded['shed']:,} shed,"
            f" {guarded['clamped']:,} clamped, {guarded['cancelled']:,} cancelled."
        )
        no_room = guarded.get("shed_no_room") or 0
        if no_room:
            # Admission sheds at any level: say so, or "level ok ... shed 53" reads as a lie.
            rest = guarded["shed"] - no_room
            second += (
                f" {'All' if not rest else f'{no_room:,}'} of the shed found no room in the"
                " engine's pool (admission: whatever the level)"
                + (f"; the other {rest:,} were shed by the pressure level." if rest else ".")
            )
    return first + "\n" + second
