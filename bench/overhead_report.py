"""The overhead benchmark's result as the Markdown section of docs/benchmarks.md."""

from __future__ import annotations

from typing import Any

PATH_NAMES = {
    "direct": "direct to the stub",
    "kvguard": "through kvguard",
    "nginx": "through nginx",
    "nginx_admission": "through nginx asking kvguard's /admission",
    "kvguard_cached_prompt": "through kvguard, prompt cached (diagnostic)",
    "kvguard_many_in_flight": "through kvguard, 256 requests at once (diagnostic)",
    "kvguard_asyncio": "through kvguard on asyncio's loop",
    "aiohttp_floor": "through a bare aiohttp pass-through (diagnostic)",
}


def _num(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{suffix}"


def _met(met: bool | None) -> str:
    return "n/a" if met is None else ("yes" if met else "**no**")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return [*lines, ""]


def _errors(result: dict[str, Any]) -> list[str]:
    return [
        f"- **{name}** was not measured: {result[name]['error']}"
        for name in ("daemon", "proxy", "scrape", "reaction")
        if "error" in result.get(name, {})
    ]


def _machine(result: dict[str, Any]) -> list[str]:
    m = result["machine"]
    mode = "`python -m bench.overhead --quick`" if result["quick"] else "`python -m bench.overhead`"
    return [
        f"Measured {m['date']} with {mode} ({result.get('wall_s', 'n/a')} s) on"
        f" {m['cpu']}, {m['cores']} cores, Python {m['python']},"
        f" {m['nginx'] or 'no nginx'}, aiohttp {m['aiohttp']}, kvguard {m['kvguard']}."
        f" Load average at start {m['loadavg_at_start']}, at end"
        f" {m.get('loadavg_at_end', 'n/a')}: {m['note']}.",
        "",
    ]


def _targets(result: dict[str, Any]) -> list[str]:
    rows = [
        [t["name"], _num(t["value"], 3), t["target"], _met(t["met"])]
        for t in result.get("targets", [])
    ]
    met = sum(1 for t in result.get("targets", []) if t["met"])
    return [
        "### Targets",
        "",
        *_table(["figure", "measured", "target", "met"], rows),
        f"{met} of {len(rows)} targets met.",
        "",
    ]


def _daemon(result: dict[str, Any]) -> list[str]:
    daemon = result.get("daemon", {})
    if "configs" not in daemon:
        return []
    rows = [
        [
            f"{c['poll_hz']:g} Hz",
            "idle" if c["proxy"] else "off",
            _num(c["cpu_percent_of_one_core"], 2, " %"),
            _num(c["cpu_ms_per_tick"], 2),
            _num(c["ticks_per_s"], 1),
            _num(c["rss_mib"], 1),
            _num(c["rss_peak_mib"], 1),
        ]
        for c in daemon["configs"].values()
    ]
    return [
        "### Daemon cost",
        "",
        f"Four `kvguard run` processes side by side for {daemon['seconds']:g} s"
        f" (after {daemon['warmup_s']:g} s of warm-up), watching one stub engine whose"
        " `/metrics` is a 154 KB vLLM page (4 data-parallel engines) with new figures at every"
        " scrape; 2 Hz is the default poll, 10 Hz the fastest (`min_interval_s`) under pressure;"
        " CPU = user + system seconds per wall second (psutil). No GPU: the NVML probe is"
        " unavailable. Ticks start one poll interval apart (the wait is the interval less"
        " the tick's own duration), so the rate reaches the nominal one unless a tick takes"
        " longer than the interval.",
        "",
        *_table(
            [
                "poll",
                "proxy",
                "CPU (of one core)",
                "CPU ms / tick",
                "ticks / s",
                "RSS (MiB)",
                "peak RSS (MiB)",
            ],
            rows,
        ),
    ]


def _proxy(result: dict[str, Any]) -> list[str]:
    proxy = result.get("proxy", {})
    if "summary" not in proxy:
        return []
    rows = []
    for kind, per in proxy["summary"].items():
        for target, s in per.items():
            rows.append(
                [
                    "SSE stream" if kind == "stream" else "whole JSON",
                    PATH_NAMES.get(target, target),
                    _num(s["p50_ms"], 2),
                    _num(s["p99_ms"], 2),
                    _num(s.get("added_p50_ms"), 2) if target != "direct" else "",
                    _num(s.get("added_p99_ms"), 2) if target != "direct" else "",
                    _num(s["throughput_rps"], 0),
                    _num(s.get("throughput_vs_direct"), 2) if target != "direct" else "1",
                    _num(s.get("throughput_vs_nginx"), 2) if "throughput_vs_nginx" in s else "",
                ]
            )
    cpu = proxy.get("proxy_cpu", {})
    per_request = ", ".join(
        f"{PATH_NAMES.get(t, t)} {_num(c.get('cpu_ms_per_request'), 3)} ms"
        + (
            f" (kvguard's; nginx's {_num(c['nginx_cpu_ms_per_request'], 3)} ms)"
            if c.get("nginx_cpu_ms_per_request") is not None
            else ""
        )
        for t, c in cpu.items()
    )
    skipped = (
        [f"nginx was skipped: {proxy['nginx_skipped']}.", ""] if proxy.get("nginx_skipped") else []
    )
    loops = proxy.get("event_loops") or {}
    if loops:
        skipped += [
            f"kvguard ran on {loops.get('kvguard') or 'an unreported loop'}"
            + (
                " and, for comparison, on asyncio's own loop (`KVGUARD_EVENT_LOOP=asyncio`)."
                if "kvguard_asyncio" in loops
                else "."
            ),
            "",
        ]
    return [
        "### Proxy cost",
        "",
        f"A stub upstream that answers at once; client, stub and each proxy in"
        f" their own processes. Latency: open loop at {proxy['rate_per_s']:g} requests/s,"
        f" {proxy['rounds']} round(s) of {proxy['open_s']:g} s per path and kind, pooled;"
        f" added = proxied - direct at the same percentile. Throughput: closed loop at"
        f" concurrency {proxy['concurrency']}, median of rounds. nginx runs"
        f" {proxy['nginx_workers']} worker process (kvguard is one process too), upstream"
        " keep-alive, `proxy_buffering off`. kvguard counts a new prompt from the"
        " answer's `usage` (whole answers) or the upstream's `/tokenize` (streams"
        " without `include_usage`), as with vLLM. \"Through nginx asking kvguard's"
        ' /admission" is the `auth_request` site docs/integrations.md shows (engine'
        " keep-alive raised to the plain nginx's): nginx carries every request and asks the"
        " same kvguard process before each completion — the data path that scales past one"
        ' kvguard process (docs/proxy.md, "Scaling the data path").',
        "",
        *skipped,
        *_table(
            [
                "kind",
                "path",
                "p50 ms",
                "p99 ms",
                "added p50",
                "added p99",
                "req/s",
                "vs direct",
                "vs nginx",
            ],
            rows,
        ),
        f"CPU per request (warm-up excluded from the count): {per_request}.",
        "",
    ]


def _scrape(result: dict[str, Any]) -> list[str]:
    scrape = result.get("scrape", {})
    if "tick" not in scrape:
        return []

    def row(label: str, figures: dict[str, float] | None) -> list[str]:
        if not figures:
            return [label, "", "", "", ""]
        return [
            label,
            _num(figures["mean_ms"]),
            _num(figures["p50_ms"]),
            _num(figures["p99_ms"]),
            _num(figures["max_ms"]),
        ]

    turn = (
        " The stub answers the page and its twin (busy and idle engines swapped) in turn, so"
        " every family kvguard reads changes at every scrape."
        if scrape.get("pages", 1) > 1
        else ""
    )
    return [
        "### Scrape cost",
        "",
        f"kvguard's `EngineProbe` reading `{scrape['fixture']}`"
        f" ({scrape['bytes']:,} bytes, {scrape['series']:,} series, vLLM data-parallel over"
        f" {scrape['engines']} engines) from a stub in another process, {scrape['ticks']} ticks"
        f" on {scrape.get('event_loop', 'asyncio')}'s loop.{turn} A tick fetches the metrics and"
        " the health endpoint; its CPU is kvguard's own (the stub's work is not in it). The"
        " parse alone is timed on the same pages with the probe's cache of unchanged"
        " families and without it (cold).",
        "",
        *_table(
            ["per tick", "mean ms", "p50 ms", "p99 ms", "max ms"],
            [
                row("fetch + parse, wall", scrape["tick"]),
                row("fetch + parse, kvguard CPU", scrape.get("tick_cpu")),
                row("parse only", scrape["parse_only"]),
                row("parse only, cold", scrape.get("parse_cold")),
            ],
        ),
    ]


def _reaction(result: dict[str, Any]) -> list[str]:
    reaction = result.get("reaction", {})
    if "runs" not in reaction:
        return []
    rows = []
    for variant, label in (
        ("immediate", "`shed_ratio = 0`: shed the class at once"),
        ("default", "defaults: hold up to `shed_wait_s` for room first"),
    ):
        v = reaction.get(variant)
        if not v or not v["trials"]:
            continue
        runs = [r for r in reaction["runs"] if r["variant"] == variant]
        detect = [
            r["usage_high_to_high_tick_ms"]
            for r in runs
            if r["usage_high_to_high_tick_ms"] is not None
        ]
        rows.append(
            [
                label,
                str(v["trials"]),
                _num(v["reaction_ms_median"], 1),
                _num(v["reaction_ms_max"], 1),
                _num(v["from_crossing_tick_ms_median"], 0),
                _num(v["from_crossing_tick_ms_max"], 0),
                _num(max(detect), 0) if detect else "n/a",
            ]
        )
    return [
        "### Reaction",
        "",
        f"In one process: kvguard (poll {reaction['poll_interval_s']:g} s, fast"
        f" poll {reaction['min_interval_s']:g} s near exhaustion) in front of a simulated engine"
        f" with a {reaction['pool_tokens']:,}-token pool; a `sheddable` probe every"
        f" {reaction['probe_every_ms']:g} ms, then a burst of long requests sent to the engine"
        " directly (through the proxy, admission would hold it at the door and the level would"
        " not reach `high`: the ladder is for what admission cannot hold). Reaction = first"
        " 503 - the tick whose decision is `high` or worse (target: one poll interval + 50 ms ="
        f' {reaction["target_ms"]:g} ms). "From crossing" starts earlier, at the first tick'
        " whose snapshot was past a `high` threshold: the decision waits `confirm_ticks` before"
        " it says `high`. The last column is how long after the engine's own KV usage first"
        " reached 90% the decision said `high`.",
        "",
        *_table(
            [
                "proxy setting",
                "trials",
                "median ms",
                "worst ms",
                "from crossing, median ms",
                "from crossing, worst ms",
                "engine at 90% -> high, worst ms",
            ],
            rows,
        ),
        *_reaction_parts(reaction),
    ]


PART_NAMES = {
    "engine_at_high_usage_to_tick_past_high": "engine's usage at 90% -> first tick past a"
    " `high` threshold (usage counts there only while the KV cache binds)",
    "confirm_ticks": "that tick -> the tick that says `high` (`confirm_ticks`)",
    "tick_to_decision_in_force": "that tick's reading -> decision made, plan in force in the proxy",
    "in_force_to_client_503": "plan in force -> a client gets the 503",
}


def _reaction_parts(reaction: dict[str, Any]) -> list[str]:
    """The reaction split into its parts (medians), one column per proxy setting."""
    variants = [v for v in ("immediate", "default") if reaction.get(v, {}).get("parts_median_ms")]
    if not variants:
        return []
    rows = [
        [PART_NAMES[part], *(_num(reaction[v]["parts_median_ms"].get(part), 1) for v in variants)]
        for part in PART_NAMES
    ]
    return [
        "",
        "The same reaction in its parts (median ms over the trials). A part may be negative"
        " where the decision says `high` on the demand it projects before the engine's own"
        " usage gets there. The decision and putting its plan in force are one synchronous"
        " step of the tick (no wait between them).",
        "",
        *_table(["part", *(f"`{v}`" for v in variants)], rows),
    ]


def _notes(result: dict[str, Any]) -> list[str]:
    """Figures from the same run that say where the time goes (no judgement, just numbers)."""
    notes = []
    configs = result.get("daemon", {}).get("configs", {})
    if "2hz" in configs:
        c = configs["2hz"]
        notes.append(
            f"At 2 Hz one tick costs {_num(c['cpu_ms_per_tick'], 2)} ms of CPU"
            f" ({_num(c['cpu_percent_of_one_core'], 2)} % of a core at"
            f" {_num(c['ticks_per_s'], 2)} ticks/s)."
        )
    scrape = result.get("scrape", {})
    if "tick" in scrape and scrape["series"]:
        parse = scrape["parse_only"]["p50_ms"]
        notes.append(
            f"Of a {scrape['bytes'] // 1000} KB scrape's {_num(scrape['tick']['p50_ms'])} ms"
            f" (p50), parsing takes {_num(parse)} ms:"
            f" {_num(parse * 1000 / scrape['series'], 1)} µs per series."
        )
    summary = result.get("proxy", {}).get("summary", {})
    for kind, per in summary.items():
        cached, plain = per.get("kvguard_cached_prompt"), per.get("kvguard")
        if cached and plain:
            notes.append(
                f"{'SSE stream' if kind == 'stream' else 'Whole JSON'}: with the prompt's"
                " token count cached kvguard's proxy adds"
                f" {_num(cached.get('added_p50_ms'))} ms at p50 (against"
                f" {_num(plain.get('added_p50_ms'))} ms) and sustains"
                f" {_num(cached['throughput_rps'], 0)} req/s (against"
                f" {_num(plain['throughput_rps'], 0)})."
            )
    cpu = result.get("proxy", {}).get("proxy_cpu", {})
    mine, floor = cpu.get("kvguard", {}), cpu.get("aiohttp_floor", {})
    if mine.get("cpu_ms_per_request") and floor.get("cpu_ms_per_request"):
        own = mine["cpu_ms_per_request"] - floor["cpu_ms_per_request"]
        notes.append(
            f"Of kvguard's {_num(mine['cpu_ms_per_request'], 3)} ms of CPU per request, the"
            f" HTTP stack it runs on (aiohttp server and client, the bare pass-through) takes"
            f" {_num(floor['cpu_ms_per_request'], 3)} ms; kvguard's own work (screen, body"
            f" parse, admission, accounting, header rules) the other {_num(own, 3)} ms."
        )
    many = cpu.get("kvguard_many_in_flight", {})
    if mine.get("cpu_ms_per_request") and many.get("cpu_ms_per_request"):
        notes.append(
            f"With {result['proxy'].get('many_in_flight', 'n/a')} requests at once in its"
            f" closed loops rather than {result['proxy'].get('concurrency', 'n/a')}, kvguard"
            f" spends {_num(many['cpu_ms_per_request'], 3)} ms of CPU per request (against"
            f" {_num(mine['cpu_ms_per_request'], 3)}); admission reads what is in flight"
            " from totals kept as requests change, not a sum over them."
        )
    uv, plain_loop = cpu.get("kvguard", {}), cpu.get("kvguard_asyncio", {})
    if plain_loop and summary:
        rates = "; ".join(
            f"{'SSE stream' if kind == 'stream' else 'whole JSON'}"
            f" {_num(per['kvguard']['throughput_rps'], 0)} req/s against"
            f" {_num(per['kvguard_asyncio']['throughput_rps'], 0)}"
            for kind, per in summary.items()
            if "kvguard" in per and "kvguard_asyncio" in per
        )
        notes.append(
            f"uvloop against asyncio's loop: {_num(uv.get('cpu_ms_per_request'), 3)} ms of CPU"
            f" per request against {_num(plain_loop.get('cpu_ms_per_request'), 3)} ms; {rates}."
        )
    return ["### Where the time goes", "", "From the same run:", "", *[f"- {n}" for n in notes], ""]


def render(result: dict[str, Any]) -> str:
    """The docs section: targets first, then each measurement's table."""
    lines = ["## 2. Overhead (`bench/overhead.py`)", "", *_machine(result)]
    errors = _errors(result)
    if errors:
        lines += [*errors, ""]
    lines += _targets(result)
    for section in (_daemon, _proxy, _scrape, _reaction, _notes):
        lines += section(result)
    return "\n".join(lines).rstrip() + "\n"
