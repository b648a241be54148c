"""kvguard / Fleet: many sidecars (one per engine), the worst headroom first.

docs/monitoring.md describes every panel; keep the two in step.
"""

from __future__ import annotations

from panels import (
    LEVEL_MAPPINGS,
    LEVEL_THRESHOLDS,
    LEVELS,
    NOT_RISING_MAPPING,
    TTE_CAP_S,
    Json,
    bargauge,
    by_name,
    dashboard,
    decisions_annotation,
    increase,
    layout,
    rate,
    sel,
    sized,
    stat,
    state_timeline,
    table,
    target,
    timeseries,
    variables,
)

USAGE_STEPS = ("green", None), ("yellow", 0.8), ("orange", 0.9), ("red", 0.97)
TTE_STEPS = ("red", None), ("orange", 15), ("yellow", 60), ("green", 300)
BACKGROUND: Json = {"type": "color-background", "mode": "basic"}
STATE_COLORS = [by_name(name, color={"mode": "fixed", "fixedColor": c}) for name, c in LEVELS]


def per_instance(aggregation: str, expr: str) -> str:
    """``expr`` aggregated to one series per kvguard instance."""
    return f"{aggregation} by (job, instance) ({expr})"


def now_row() -> list[Json]:
    """Counts across the fleet, as of now."""
    red_from_one = (("green", None), ("red", 1))
    return [
        sized(
            stat(
                "kvguard instances",
                "kvguard sidecars reporting (count of kvguard_build_info).",
                "short",
                [target(f"count({sel('kvguard_build_info')})", "instances", instant=True)],
            ),
            3,
            5,
        ),
        sized(
            stat(
                "Instances per pressure level",
                "How many instances are at each ladder level now (sum of "
                "kvguard_pressure_state by state).",
                "short",
                [
                    target(
                        f"sum by (state) ({sel('kvguard_pressure_state')})",
                        "{{state}}",
                        instant=True,
                    )
                ],
                text_mode="value_and_name",
                overrides=STATE_COLORS,
            ),
            7,
            5,
        ),
        sized(
            stat(
                "Engines down",
                "Engines whose metrics or health check failed this tick "
                "(sum of 1 - kvguard_engine_up).",
                "short",
                [target(f"sum(1 - {sel('kvguard_engine_up')})", "down", instant=True)],
                steps=red_from_one,
            ),
            3,
            5,
        ),
        sized(
            stat(
                "kvguard down",
                "kvguard targets Prometheus cannot scrape (sum of 1 - up).",
                "short",
                [target(f"sum(1 - {sel('up')})", "down", instant=True)],
                steps=red_from_one,
            ),
            3,
            5,
        ),
        sized(
            stat(
                "Probes failing",
                "Probe reads failing now across the fleet (sum of 1 - kvguard_probe_up); "
                "an nvml probe without an NVIDIA driver counts here too.",
                "short",
                [target(f"sum(1 - {sel('kvguard_probe_up')})", "failing", instant=True)],
                steps=red_from_one,
            ),
            2,
            5,
        ),
        sized(
            stat(
                "Fleet shed rate",
                "Requests shed per second across the fleet (kvguard_requests_shed_total).",
                "reqps",
                [target(f"sum({rate('kvguard_requests_shed_total')})", "shed", instant=True)],
            ),
            3,
            5,
        ),
        sized(
            stat(
                "Fleet preemption rate",
                "Preemptions per second across the fleet's engines "
                "(kvguard_engine_preemptions_total).",
                "reqps",
                [
                    target(
                        f"sum({rate('kvguard_engine_preemptions_total')})",
                        "preemptions",
                        instant=True,
                    )
                ],
            ),
            3,
            5,
        ),
    ]


def worst_first_row() -> list[Json]:
    """Tables of instances, the one closest to exhaustion on top."""
    usage = per_instance("max", sel("kvguard_kv_cache_usage_ratio"))
    tte = per_instance("min", sel("kvguard_time_to_exhaustion_seconds", 'resource="kv_cache"'))
    level = per_instance("max", sel("kvguard_pressure_level"))
    usage_cells = by_name(
        "KV usage",
        unit="percentunit",
        thresholds={
            "mode": "absolute",
            "steps": [{"color": c, "value": v} for c, v in USAGE_STEPS],
        },
        custom__cellOptions=BACKGROUND,
    )
    tte_cells = by_name(
        "Time to exhaustion",
        unit="s",
        mappings=[NOT_RISING_MAPPING],
        thresholds={"mode": "absolute", "steps": [{"color": c, "value": v} for c, v in TTE_STEPS]},
        custom__cellOptions=BACKGROUND,
    )
    level_cells = by_name(
        "Pressure level",
        unit="none",
        mappings=LEVEL_MAPPINGS,
        custom__cellOptions=BACKGROUND,
    )
    return [
        sized(
            table(
                "Highest KV cache usage",
                "Instances by KV cache usage now, fullest first "
                "(kvguard_kv_cache_usage_ratio). Click an instance for its overview.",
                "percentunit",
                [target(f"sort_desc({usage})")],
                columns={"Value": "KV usage"},
                sort_by="KV usage",
                descending=True,
                overrides=[usage_cells],
            ),
            8,
            9,
        ),
        sized(
            table(
                "Shortest time to KV exhaustion",
                "Instances by forecast seconds until their KV cache is full, soonest first "
                '(kvguard_time_to_exhaustion_seconds{resource="kv_cache"}); "not rising" '
                "last.",
                "s",
                [target(f"sort({tte})")],
                columns={"Value": "Time to exhaustion"},
                sort_by="Time to exhaustion",
                descending=False,
                overrides=[tte_cells],
            ),
            8,
            9,
        ),
        sized(
            table(
                "Highest pressure level",
                "Instances by kvguard's ladder level now, critical first (kvguard_pressure_level).",
                "none",
                [target(f"sort_desc({level})")],
                columns={"Value": "Pressure level"},
                sort_by="Pressure level",
                descending=True,
                overrides=[level_cells],
            ),
            8,
            9,
        ),
        sized(
            table(
                "Instances, fullest KV cache first",
                "One row per instance: KV usage, time to KV exhaustion, pressure level, "
                "KV headroom per GPU (kvguard_headroom_bytes), preemptions and shed "
                "requests per second. Sort by any column; click an instance for its "
                "overview. Empty cells: that instance does not export the figure (no "
                "budget, no proxy, no preemption counter).",
                "short",
                [
                    target(usage),
                    target(tte),
                    target(level),
                    target(per_instance("min", sel("kvguard_headroom_bytes"))),
                    target(per_instance("sum", rate("kvguard_engine_preemptions_total"))),
                    target(per_instance("sum", rate("kvguard_requests_shed_total"))),
                ],
                columns={
                    "Value #A": "KV usage",
                    "Value #B": "Time to exhaustion",
                    "Value #C": "Pressure level",
                    "Value #D": "KV headroom per GPU",
                    "Value #E": "Preemptions",
                    "Value #F": "Shed",
                },
                sort_by="KV usage",
                descending=True,
                overrides=[
                    usage_cells,
                    tte_cells,
                    level_cells,
                    by_name("KV headroom per GPU", unit="bytes"),
                    by_name("Preemptions", unit="reqps"),
                    by_name("Shed", unit="reqps"),
                ],
            ),
            24,
            10,
        ),
    ]


def over_time_row() -> list[Json]:
    """The fleet's pressure over the dashboard's time range."""
    tte = sel("kvguard_time_to_exhaustion_seconds", 'resource="kv_cache"')
    tte_capped = f"clamp_max({tte}, {TTE_CAP_S})"
    return [
        timeseries(
            "KV cache usage by instance",
            "Share of each engine's KV cache in use (kvguard_kv_cache_usage_ratio). "
            "Dashed: the ladder's 0.80 / 0.90 / 0.97 thresholds.",
            "percentunit",
            [target(per_instance("max", sel("kvguard_kv_cache_usage_ratio")), "{{instance}}")],
            lines_at=USAGE_STEPS,
            soft_max=1,
        ),
        timeseries(
            "Instances per pressure level over time",
            "How many instances were at each ladder level (sum of kvguard_pressure_state "
            "by state), stacked.",
            "short",
            [target(f"sum by (state) ({sel('kvguard_pressure_state')})", "{{state}}")],
            stack=True,
            overrides=STATE_COLORS,
        ),
        sized(
            state_timeline(
                "Pressure level by instance",
                "Each instance's ladder level over time (kvguard_pressure_level).",
                [target(per_instance("max", sel("kvguard_pressure_level")), "{{instance}}")],
                mappings=LEVEL_MAPPINGS,
                steps=LEVEL_THRESHOLDS,
            ),
            24,
            8,
        ),
        timeseries(
            "Time to KV exhaustion, 10 soonest",
            "The ten instances closest to a full KV cache "
            f"(kvguard_time_to_exhaustion_seconds, drawn at most {TTE_CAP_S} s: a line at "
            f"{TTE_CAP_S} s means not rising).",
            "s",
            [target(f"bottomk(10, {per_instance('min', tte_capped)})", "{{instance}}")],
            lines_at=TTE_STEPS,
        ),
        timeseries(
            "KV headroom per GPU, 10 smallest",
            "The ten instances with the least KV headroom per GPU at the first forecast "
            "horizon (kvguard_headroom_bytes); below zero the projection does not fit.",
            "bytes",
            [
                target(
                    f"bottomk(10, {per_instance('min', sel('kvguard_headroom_bytes'))})",
                    "{{instance}}",
                )
            ],
        ),
    ]


def shedding_row() -> list[Json]:
    """Who sheds, who preempts, who mitigates."""
    return [
        sized(
            bargauge(
                "Top 10 shedding",
                "Instances shedding the most requests per second now "
                "(kvguard_requests_shed_total).",
                "reqps",
                [
                    target(
                        f"topk(10, {per_instance('sum', rate('kvguard_requests_shed_total'))})",
                        "{{instance}}",
                        instant=True,
                    )
                ],
            ),
            8,
            8,
        ),
        sized(
            bargauge(
                "Top 10 preempting",
                "Engines preempting the most requests per second now "
                "(kvguard_engine_preemptions_total).",
                "reqps",
                [
                    target(
                        "topk(10, "
                        f"{per_instance('sum', rate('kvguard_engine_preemptions_total'))})",
                        "{{instance}}",
                        instant=True,
                    )
                ],
            ),
            8,
            8,
        ),
        sized(
            bargauge(
                "Top 10 mitigating",
                "Instances deciding the most mitigations per second now "
                "(kvguard_decisions_total, every action and mode).",
                "ops",
                [
                    target(
                        f"topk(10, {per_instance('sum', rate('kvguard_decisions_total'))})",
                        "{{instance}}",
                        instant=True,
                    )
                ],
            ),
            8,
            8,
        ),
        timeseries(
            "Shed rate by instance",
            "Requests shed per second by each instance's proxy (kvguard_requests_shed_total).",
            "reqps",
            [target(per_instance("sum", rate("kvguard_requests_shed_total")), "{{instance}}")],
        ),
        timeseries(
            "Preemption rate by instance",
            "Preemptions per second of each engine (kvguard_engine_preemptions_total). "
            "Dashed: the ladder's 0.05 / 0.5 / 2 per second thresholds.",
            "reqps",
            [
                target(
                    per_instance("sum", rate("kvguard_engine_preemptions_total")),
                    "{{instance}}",
                )
            ],
            lines_at=(("green", None), ("yellow", 0.05), ("orange", 0.5), ("red", 2)),
        ),
    ]


def health_row() -> list[Json]:
    """Engine restarts, budget mismatches and kvguard's own health across the fleet."""
    up: Json = {
        "type": "value",
        "options": {
            "0": {"text": "failing", "color": "red"},
            "1": {"text": "up", "color": "green"},
        },
    }
    return [
        timeseries(
            "Engine restarts and OOMs by instance",
            "Restarts of supervised engines (kvguard_engine_restarts_total, any reason) "
            "and CUDA out-of-memory errors (kvguard_engine_oom_total) in each interval.",
            "short",
            [
                target(
                    per_instance("sum", increase("kvguard_engine_restarts_total")),
                    "{{instance}} restarts",
                ),
                target(
                    per_instance("sum", increase("kvguard_engine_oom_total")),
                    "{{instance}} OOMs",
                ),
            ],
            bars=True,
        ),
        timeseries(
            "Budget mismatch by instance",
            "Reported minus predicted KV capacity as a share of the prediction "
            "(kvguard_budget_kv_capacity_difference_tokens / "
            "kvguard_budget_kv_capacity_tokens). Beyond +/-5% the budget's inputs "
            "differ from the engine's.",
            "percentunit",
            [
                target(
                    f"{sel('kvguard_budget_kv_capacity_difference_tokens')} / "
                    f"{sel('kvguard_budget_kv_capacity_tokens')}",
                    "{{instance}}",
                )
            ],
            lines_at=(("red", None), ("green", -0.05), ("red", 0.05)),
        ),
        sized(
            state_timeline(
                "Probes by instance",
                "Whether each instance's probes read their sources (kvguard_probe_up); "
                "nvml reads 0 also where there is no NVIDIA driver.",
                [target(sel("kvguard_probe_up"), "{{instance}} {{probe}}")],
                mappings=[up],
                steps=(("red", None), ("green", 1)),
            ),
            12,
            8,
        ),
        timeseries(
            "Oldest probe reading by instance",
            "Seconds since each instance's stalest probe last read its source "
            "(max of kvguard_probe_age_seconds).",
            "s",
            [target(per_instance("max", sel("kvguard_probe_age_seconds")), "{{instance}}")],
        ),
        timeseries(
            "Poll rate by instance",
            "Ticks per second of each kvguard (rate of kvguard_ticks_total); it rises to "
            "10 under pressure.",
            "hertz",
            [target(per_instance("sum", rate("kvguard_ticks_total")), "{{instance}}")],
        ),
        stat(
            "kvguard versions",
            "How many instances run each kvguard version (kvguard_build_info).",
            "short",
            [
                target(
                    f"count by (version) ({sel('kvguard_build_info')})",
                    "{{version}}",
                    instant=True,
                )
            ],
            text_mode="value_and_name",
        ),
    ]


def fleet() -> Json:
    """The kvguard / Fleet dashboard model."""
    sections = [
        ("Fleet now", now_row()),
        ("Worst headroom first", worst_first_row()),
        ("Pressure over time", over_time_row()),
        ("Shedding, preemptions, mitigations", shedding_row()),
        ("Engines and kvguard health", health_row()),
    ]
    return dashboard(
        "kvguard-fleet",
        "kvguard / Fleet",
        description="Many kvguard sidecars (one per engine), the instances closest to KV cache "
        "exhaustion first. docs/monitoring.md describes every panel.",
        panels=layout(sections),
        templating=variables(multi_instance=True),
        annotations=[decisions_annotation(("instance",))],
    )
