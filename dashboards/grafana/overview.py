"""kvguard / Overview: one kvguard sidecar and its engine, panel by panel.

docs/monitoring.md describes every panel; keep the two in step.
"""

from __future__ import annotations

from panels import (
    LEVEL_MAPPINGS,
    LEVEL_THRESHOLDS,
    NOT_RISING_MAPPING,
    TTE_CAP_S,
    Json,
    by_query,
    dashboard,
    decisions_annotation,
    heatmap,
    increase,
    layout,
    level_change_annotation,
    rate,
    sel,
    sized,
    stat,
    state_timeline,
    target,
    timeseries,
    variables,
)

LADDER_USAGE = ("green", None), ("yellow", 0.8), ("orange", 0.9), ("red", 0.97)
LADDER_TTE = ("red", None), ("orange", 15), ("yellow", 60), ("green", 300)
LADDER_PREEMPTIONS = ("green", None), ("yellow", 0.05), ("orange", 0.5), ("red", 2)
DASHED: Json = {"dash": [10, 10], "fill": "dash"}
ONE_IS: Json = {"type": "value", "options": {"0": {"text": " ", "color": "transparent"}}}
DETECTED: Json = {
    "type": "value",
    "options": {"0": {"text": " ", "color": "transparent"}, "1": {"text": "detected"}},
}


def now_row() -> list[Json]:
    """The headline figures, as of now."""
    return [
        sized(
            stat(
                "Pressure level",
                "kvguard's ladder level now (kvguard_pressure_level): ok, elevated (alerts "
                "only), high (the traffic pattern's first response), critical (escalation). "
                "See docs/how-it-works.md for the thresholds.",
                "none",
                [target(sel("kvguard_pressure_level"), "level", instant=True)],
                steps=LEVEL_THRESHOLDS,
                mappings=LEVEL_MAPPINGS,
            ),
            4,
            4,
        ),
        sized(
            stat(
                "KV cache usage",
                "Share of the engine's KV cache in use now (kvguard_kv_cache_usage_ratio). "
                "Colours follow the ladder's usage thresholds: 0.80 elevated, 0.90 high, "
                "0.97 critical.",
                "percentunit",
                [target(sel("kvguard_kv_cache_usage_ratio"), "usage", instant=True)],
                steps=LADDER_USAGE,
            ),
            4,
            4,
        ),
        sized(
            stat(
                "Time to KV exhaustion",
                "Forecast seconds until the KV cache is full at the current trend "
                '(kvguard_time_to_exhaustion_seconds{resource="kv_cache"}); "not rising" '
                "when the trend is flat or falling (+Inf). Counts towards the ladder only "
                "with usage at 0.5 or more.",
                "s",
                [
                    target(
                        sel("kvguard_time_to_exhaustion_seconds", 'resource="kv_cache"'),
                        "kv_cache",
                        instant=True,
                    )
                ],
                steps=LADDER_TTE,
                mappings=[NOT_RISING_MAPPING],
            ),
            4,
            4,
        ),
        sized(
            stat(
                "KV headroom per GPU",
                "KV bytes per GPU left at the first forecast horizon: (limit - projected "
                "demand) x KV bytes per token per GPU (kvguard_headroom_bytes). Negative: "
                "the projection no longer fits. Needs [model] config.",
                "bytes",
                [target(sel("kvguard_headroom_bytes"), "headroom", instant=True)],
                steps=(("red", None), ("green", 0)),
            ),
            4,
            4,
        ),
        sized(
            stat(
                "Traffic pattern, what binds",
                "The traffic pattern kvguard detects now (kvguard_traffic_pattern == 1); "
                "it picks the ladder's first response (docs/how-it-works.md section 2). "
                "Below it, what limits the engine (kvguard_binding_resource == 1): "
                "kv_cache, compute (a queue with room in the cache: kvguard does not "
                "shed for it) or none.",
                "none",
                [
                    target(f"{sel('kvguard_traffic_pattern')} == 1", "{{pattern}}", instant=True),
                    target(
                        f"{sel('kvguard_binding_resource')} == 1",
                        "binds: {{resource}}",
                        instant=True,
                    ),
                ],
                text_mode="name",
            ),
            4,
            4,
        ),
        sized(
            stat(
                "Engine",
                "1 when the engine's metrics answered this tick and its health endpoint "
                "is 2xx (kvguard_engine_up).",
                "none",
                [target(sel("kvguard_engine_up"), "engine", instant=True)],
                steps=(("red", None), ("green", 1)),
                mappings=[
                    {
                        "type": "value",
                        "options": {
                            "0": {"text": "down", "color": "red", "index": 0},
                            "1": {"text": "up", "color": "green", "index": 1},
                        },
                    }
                ],
            ),
            4,
            4,
        ),
    ]


def vram_row() -> list[Json]:
    """The planned VRAM budget beside what the GPU and the host really hold."""
    planned = sel("kvguard_budget_bytes", 'component!="headroom"')
    return [
        timeseries(
            "VRAM budget per GPU",
            "kvguard's planned budget of one GPU (kvguard_budget_bytes by component): "
            "weights, activations, overhead and the KV pool stacked up to the memory "
            "limit. Headroom (dashed, not stacked) is the part of the KV pool beyond the "
            "configured worst case; negative means the configured concurrency does not "
            "fit. Needs [model] config.",
            "bytes",
            [
                target(planned, "{{component}}"),
                target(sel("kvguard_budget_bytes", 'component="headroom"'), "headroom"),
            ],
            stack=True,
            overrides=[
                by_query(
                    "B",
                    custom__stacking={"mode": "none", "group": "B"},
                    custom__fillOpacity=0,
                    custom__lineStyle=DASHED,
                    custom__lineWidth=2,
                )
            ],
        ),
        timeseries(
            "GPU memory: engine usage (NVML)",
            "What the GPUs really hold, beside the budget: used and total per GPU "
            "(kvguard_gpu_memory_used_bytes, _total_bytes), the driver's reservation "
            "(kvguard_gpu_memory_reserved_bytes), each process's memory "
            "(kvguard_gpu_process_memory_bytes) and the budget's total (dashed). Used "
            "well above the budget means its estimates are low. Needs NVML.",
            "bytes",
            [
                target(sel("kvguard_gpu_memory_used_bytes"), "GPU {{gpu}} used"),
                target(sel("kvguard_gpu_memory_total_bytes"), "GPU {{gpu}} total"),
                target(sel("kvguard_gpu_process_memory_bytes"), "GPU {{gpu}} pid {{pid}}"),
                target(sel("kvguard_gpu_memory_reserved_bytes"), "GPU {{gpu}} driver reserved"),
                target(f"sum without (component) ({planned})", "budget"),
            ],
            overrides=[
                by_query("B", custom__lineStyle=DASHED, custom__fillOpacity=0),
                by_query("E", custom__lineStyle=DASHED, custom__fillOpacity=0),
            ],
        ),
        timeseries(
            "Host memory and engine process",
            "Host memory total and available (kvguard_host_memory_total_bytes, "
            "_available_bytes) and the engine process's resident memory "
            "(kvguard_engine_process_resident_bytes; needs [engine] pid or process_name).",
            "bytes",
            [
                target(sel("kvguard_host_memory_total_bytes"), "host total"),
                target(sel("kvguard_host_memory_available_bytes"), "host available"),
                target(sel("kvguard_engine_process_resident_bytes"), "engine resident"),
            ],
        ),
        timeseries(
            "Engine process CPU",
            "CPU of the engine process in cores "
            "(rate of kvguard_engine_process_cpu_seconds_total).",
            "short",
            [target(rate("kvguard_engine_process_cpu_seconds_total"), "engine CPU (cores)")],
        ),
    ]


def kv_row() -> list[Json]:
    """KV usage, its forecast, and the time left."""
    return [
        timeseries(
            "KV cache usage and forecast",
            "Share of the KV cache in use (kvguard_kv_cache_usage_ratio, solid) and the "
            "forecast demand (in use + queued prompts) at each horizon as a share of the "
            "capacity (kvguard_projected_kv_tokens / kvguard_kv_cache_capacity_tokens, "
            "dashed). Dashed lines at 0.80 / 0.90 / 0.97 are the ladder's thresholds.",
            "percentunit",
            [
                target(sel("kvguard_kv_cache_usage_ratio"), "in use"),
                target(
                    f"{sel('kvguard_projected_kv_tokens')} / ignoring(horizon) group_left "
                    f"{sel('kvguard_kv_cache_capacity_tokens')}",
                    "projected in {{horizon}} s",
                ),
            ],
            lines_at=LADDER_USAGE,
            soft_max=1,
            overrides=[by_query("B", custom__lineStyle=DASHED, custom__fillOpacity=0)],
        ),
        timeseries(
            "KV cache tokens",
            "Tokens in the KV cache (kvguard_kv_cache_used_tokens), the cache's capacity "
            "(kvguard_kv_cache_capacity_tokens) and the projected demand at each horizon "
            "(kvguard_projected_kv_tokens).",
            "short",
            [
                target(sel("kvguard_kv_cache_used_tokens"), "in use"),
                target(sel("kvguard_kv_cache_capacity_tokens"), "capacity"),
                target(sel("kvguard_projected_kv_tokens"), "projected in {{horizon}} s"),
            ],
            overrides=[by_query("C", custom__lineStyle=DASHED, custom__fillOpacity=0)],
        ),
        timeseries(
            "Time to exhaustion",
            "Forecast seconds until the KV cache and the fullest GPU's memory run out "
            f"(kvguard_time_to_exhaustion_seconds by resource), drawn at most {TTE_CAP_S} s: "
            f"a line at {TTE_CAP_S} s means not rising (+Inf). Dashed: the ladder's 300 / "
            "60 / 15 s thresholds (they count only with KV usage at 0.5 or more).",
            "s",
            [
                target(
                    f"clamp_max({sel('kvguard_time_to_exhaustion_seconds')}, {TTE_CAP_S})",
                    "{{resource}}",
                )
            ],
            lines_at=LADDER_TTE,
        ),
        timeseries(
            "Engine requests running and waiting",
            "Requests the engine is processing (kvguard_requests_running) and queued "
            "inside it (kvguard_requests_waiting). Waiting requests allocate KV the "
            "moment blocks free, so the forecast counts their prompts.",
            "short",
            [
                target(sel("kvguard_requests_running"), "running"),
                target(sel("kvguard_requests_waiting"), "waiting"),
            ],
        ),
        timeseries(
            "KV cache usage per data-parallel engine",
            "Share of each data-parallel engine's own KV cache in use "
            "(kvguard_engine_kv_cache_usage_ratio by dp_rank). The fullest one is the "
            "engine's usage above and decides the ladder. Empty for a single engine.",
            "percentunit",
            [target(sel("kvguard_engine_kv_cache_usage_ratio"), "engine {{dp_rank}}")],
            lines_at=LADDER_USAGE,
            soft_max=1,
        ),
        timeseries(
            "Requests per data-parallel engine",
            "Requests each data-parallel engine is processing "
            "(kvguard_engine_requests_running) and has queued "
            "(kvguard_engine_requests_waiting), by dp_rank: an uneven split shows one "
            "engine filling while the others have room. Empty for a single engine.",
            "short",
            [
                target(sel("kvguard_engine_requests_running"), "running {{dp_rank}}"),
                target(sel("kvguard_engine_requests_waiting"), "waiting {{dp_rank}}"),
            ],
        ),
    ]


def pressure_row() -> list[Json]:
    """The ladder, the traffic pattern and the mitigations over time."""
    return [
        sized(
            state_timeline(
                "Pressure level over time",
                "kvguard's ladder level (kvguard_pressure_level): ok, elevated, high, "
                "critical. It steps down one level per hold time (30 s) at most.",
                [target(sel("kvguard_pressure_level"), "pressure")],
                mappings=LEVEL_MAPPINGS,
                steps=LEVEL_THRESHOLDS,
            ),
            24,
            4,
        ),
        sized(
            state_timeline(
                "Traffic pattern over time",
                "One row per traffic pattern, filled while kvguard detects it "
                "(kvguard_traffic_pattern). The pattern picks the ladder's first response; "
                "it needs its 60 s window to recognise a change.",
                [target(sel("kvguard_traffic_pattern"), "{{pattern}}")],
                mappings=[DETECTED],
                steps=(("transparent", None), ("blue", 1)),
            ),
            24,
            6,
        ),
        sized(
            state_timeline(
                "Mitigation decisions",
                "Actions kvguard decided, one row per action and mode (increase of "
                "kvguard_decisions_total over the rate interval): applied (in force at the "
                "proxy, /admission, /readyz), started (handed to an asynchronous actuator), "
                "dry_run, not_applied. The same decisions are annotations on every graph.",
                [
                    target(
                        f"sum by (action, mode) ({increase('kvguard_decisions_total')})",
                        "{{action}} ({{mode}})",
                    )
                ],
                mappings=[ONE_IS],
                steps=(("transparent", None), ("orange", 0.001)),
            ),
            24,
            7,
        ),
    ]


def proxy_row() -> list[Json]:
    """What the admission proxy refused, capped and cancelled, and what is in flight."""
    return [
        timeseries(
            "Requests shed by priority",
            "Requests answered 503 by shedding, per second, by priority class and reason "
            "(kvguard_requests_shed_total). critical is never shed; sheddable goes first "
            "(high), standard too at critical.",
            "reqps",
            [
                target(
                    f"sum by (priority, reason) ({rate('kvguard_requests_shed_total')})",
                    "{{priority}} ({{reason}})",
                )
            ],
        ),
        timeseries(
            "Requests clamped, rejected and cancelled",
            "Per second: requests whose max_tokens the window cap lowered "
            "(kvguard_requests_clamped_total), refused with a 4xx by reason "
            "(kvguard_requests_rejected_total: the window cap's prompt_over_window and "
            "no_room_for_completion; malformed or not forwardable: invalid_body, "
            "bad_target, bad_header, bad_path, method_not_allowed, path_not_allowed, "
            "path_blocked), and cancelled by reason (kvguard_requests_cancelled_total: "
            "largest to free KV, overrun: answers past their reservation before the pool runs "
            "out, drain). These counters have no priority label.",
            "reqps",
            [
                target(f"sum({rate('kvguard_requests_clamped_total')})", "clamped"),
                target(
                    f"sum by (reason) ({rate('kvguard_requests_rejected_total')})",
                    "rejected ({{reason}})",
                ),
                target(
                    f"sum by (reason) ({rate('kvguard_requests_cancelled_total')})",
                    "cancelled ({{reason}})",
                ),
            ],
        ),
        sized(
            timeseries(
                "In-flight KV tokens",
                "KV tokens (prompt + generated) held by the requests in flight through "
                "the proxy (kvguard_inflight_kv_tokens).",
                "short",
                [target(sel("kvguard_inflight_kv_tokens"), "in flight")],
            ),
            8,
            8,
        ),
        sized(
            timeseries(
                "In-flight KV bytes per GPU",
                "The same in bytes per GPU (kvguard_inflight_kv_bytes), against the "
                'budget\'s KV pool (kvguard_budget_bytes{component="kv_pool"}, dashed). '
                "Needs [model] config.",
                "bytes",
                [
                    target(sel("kvguard_inflight_kv_bytes"), "in flight"),
                    target(sel("kvguard_budget_bytes", 'component="kv_pool"'), "KV pool"),
                ],
                overrides=[by_query("B", custom__lineStyle=DASHED, custom__fillOpacity=0)],
            ),
            8,
            8,
        ),
        sized(
            timeseries(
                "Proxy requests in flight and held",
                "Generation requests in flight through the proxy "
                "(kvguard_inflight_requests) and held until they fit the engine's pool "
                "(kvguard_proxy_held_requests).",
                "short",
                [
                    target(sel("kvguard_inflight_requests"), "in flight"),
                    target(sel("kvguard_proxy_held_requests"), "held"),
                ],
            ),
            8,
            8,
        ),
        heatmap(
            "Per-request KV size",
            "How many KV tokens requests held when they ended: the rate of requests per "
            "bucket (kvguard_request_kv_tokens_bucket). A band moving up is longer "
            "conversations or generations.",
            "short",
            f"sum by (le) ({rate('kvguard_request_kv_tokens_bucket')})",
        ),
        heatmap(
            "Prompt size per request",
            "Prompt tokens per request: the rate of requests per bucket "
            "(kvguard_request_prompt_tokens_bucket).",
            "short",
            f"sum by (le) ({rate('kvguard_request_prompt_tokens_bucket')})",
        ),
        timeseries(
            "Per-request KV size quantiles",
            "Median and 95th percentile of the KV tokens requests held at their end and "
            "of their prompt tokens (histogram_quantile over "
            "kvguard_request_kv_tokens_bucket and kvguard_request_prompt_tokens_bucket; "
            "estimates within a bucket).",
            "short",
            [
                target(
                    "histogram_quantile(0.5, sum by (le) "
                    f"({rate('kvguard_request_kv_tokens_bucket')}))",
                    "KV p50",
                ),
                target(
                    "histogram_quantile(0.95, sum by (le) "
                    f"({rate('kvguard_request_kv_tokens_bucket')}))",
                    "KV p95",
                ),
                target(
                    "histogram_quantile(0.5, sum by (le) "
                    f"({rate('kvguard_request_prompt_tokens_bucket')}))",
                    "prompt p50",
                ),
                target(
                    "histogram_quantile(0.95, sum by (le) "
                    f"({rate('kvguard_request_prompt_tokens_bucket')}))",
                    "prompt p95",
                ),
            ],
        ),
        timeseries(
            "Proxy errors",
            "Answers the proxy gave itself, per second, by code "
            "(kvguard_proxy_errors_total): 408 body too slow, 413 body too large, "
            "503 bodies over the memory budget, 502 engine unreachable, 504 engine timeout.",
            "reqps",
            [target(f"sum by (code) ({rate('kvguard_proxy_errors_total')})", "{{code}}")],
        ),
    ]


def engine_row() -> list[Json]:
    """The symptoms kvguard exists to prevent."""
    return [
        sized(
            timeseries(
                "Preemptions",
                "Requests the engine preempted (recomputed), per second "
                "(kvguard_engine_preemptions_total; vLLM, SGLang). Dashed: the ladder's "
                "0.05 / 0.5 / 2 per second thresholds.",
                "reqps",
                [target(f"sum({rate('kvguard_engine_preemptions_total')})", "preemptions")],
                lines_at=LADDER_PREEMPTIONS,
            ),
            8,
            8,
        ),
        sized(
            timeseries(
                "Engine restarts",
                "Restarts of the supervised engine in each interval, by reason "
                "(kvguard_engine_restarts_total: crash, oom, reconfigure). Supervisor "
                "mode (kvguard run -- <engine command>) only.",
                "short",
                [
                    target(
                        f"sum by (reason) ({increase('kvguard_engine_restarts_total')})",
                        "{{reason}}",
                    )
                ],
                bars=True,
            ),
            8,
            8,
        ),
        sized(
            timeseries(
                "Engine CUDA out-of-memory errors",
                "CUDA out-of-memory errors in the supervised engine's output in each "
                "interval (kvguard_engine_oom_total). Supervisor mode only.",
                "short",
                [target(f"sum({increase('kvguard_engine_oom_total')})", "OOM")],
                bars=True,
            ),
            8,
            8,
        ),
    ]


def reconciliation_row() -> list[Json]:
    """The budget's predicted KV capacity against the engine's."""
    return [
        timeseries(
            "KV capacity: predicted vs reported",
            "KV tokens the budget predicts (kvguard_budget_kv_capacity_tokens) and the "
            "engine reports (kvguard_engine_kv_capacity_tokens). Apart by more than 5%: "
            "the budget's inputs (memory utilization, dtype, overhead) differ from the "
            "engine's.",
            "short",
            [
                target(sel("kvguard_budget_kv_capacity_tokens"), "predicted (budget)"),
                target(sel("kvguard_engine_kv_capacity_tokens"), "reported (engine)"),
            ],
        ),
        sized(
            timeseries(
                "Capacity difference",
                "Reported minus predicted KV capacity in tokens "
                "(kvguard_budget_kv_capacity_difference_tokens); positive: the engine "
                "holds more than the budget predicted.",
                "short",
                [target(sel("kvguard_budget_kv_capacity_difference_tokens"), "difference")],
            ),
            6,
            8,
        ),
        sized(
            stat(
                "Difference, share of predicted",
                "kvguard_budget_kv_capacity_difference_tokens / "
                "kvguard_budget_kv_capacity_tokens; beyond +/-5% kvguard logs "
                "budget_reconciliation_mismatch.",
                "percentunit",
                [
                    target(
                        f"{sel('kvguard_budget_kv_capacity_difference_tokens')} / "
                        f"{sel('kvguard_budget_kv_capacity_tokens')}",
                        "difference",
                        instant=True,
                    )
                ],
                steps=(("red", None), ("green", -0.05), ("red", 0.05)),
            ),
            3,
            8,
        ),
        sized(
            stat(
                "KV bytes per token",
                "KV bytes per token for the whole model, one replica "
                "(kvguard_kv_bytes_per_token), from the budget.",
                "bytes",
                [target(sel("kvguard_kv_bytes_per_token"), "per token", instant=True)],
            ),
            3,
            8,
        ),
    ]


def actions_row() -> list[Json]:
    """How kvguard's actions on the engine ended."""
    one_is_in_use: Json = {
        "type": "value",
        "options": {"1": {"text": "in use", "color": "blue"}, "0": {"text": " "}},
    }
    paused: Json = {
        "type": "value",
        "options": {
            "0": {"text": "running", "color": "green"},
            "1": {"text": "paused", "color": "orange"},
        },
    }
    return [
        sized(
            timeseries(
                "Action results",
                "How asynchronous actions on the engine ended in each interval, by action "
                "and result (kvguard_action_results_total: evict, pause, resume, kv_fp8, "
                "revert_kv_fp8; succeeded, failed).",
                "short",
                [
                    target(
                        f"sum by (action, result) ({increase('kvguard_action_results_total')})",
                        "{{action}} {{result}}",
                    )
                ],
                bars=True,
            ),
            8,
            8,
        ),
        sized(
            timeseries(
                "fp8 KV switches",
                "Drain-and-restart switches of the KV cache dtype in each interval "
                "(kvguard_reconfigure_total: kv_fp8, revert_kv_fp8; succeeded, "
                "rolled_back, failed). Needs a restart mode.",
                "short",
                [
                    target(
                        f"sum by (action, result) ({increase('kvguard_reconfigure_total')})",
                        "{{action}} {{result}}",
                    )
                ],
                bars=True,
            ),
            8,
            8,
        ),
        sized(
            timeseries(
                "Webhook deliveries",
                "Webhook events per second by result (kvguard_webhook_deliveries_total: "
                "sent, failed after the last retry, dropped). Needs [webhook] urls.",
                "ops",
                [
                    target(
                        f"sum by (result) ({rate('kvguard_webhook_deliveries_total')})",
                        "{{result}}",
                    )
                ],
            ),
            8,
            8,
        ),
        sized(
            state_timeline(
                "KV cache dtype",
                "The engine's KV cache data type over time (kvguard_kv_cache_dtype_info): "
                "as the engine reports it, else as kvguard last started it. A switch to "
                "fp8 shows as a new row.",
                [target(sel("kvguard_kv_cache_dtype_info"), "{{dtype}}")],
                mappings=[one_is_in_use],
                steps=(("transparent", None), ("blue", 1)),
            ),
            12,
            6,
        ),
        sized(
            state_timeline(
                "Engine paused by kvguard",
                "1 while kvguard holds the engine paused (kvguard_engine_paused; "
                "[engine] shed_by_pause, or a drain step).",
                [target(sel("kvguard_engine_paused"), "engine")],
                mappings=[paused],
                steps=(("green", None), ("orange", 1)),
            ),
            8,
            6,
        ),
        sized(
            stat(
                "Last drain",
                "How long the last drain before a restart took (kvguard_drain_duration_seconds).",
                "s",
                [target(sel("kvguard_drain_duration_seconds"), "drain", instant=True)],
            ),
            4,
            6,
        ),
    ]


def health_row() -> list[Json]:
    """Whether kvguard itself is reading its sources and ticking."""
    up: Json = {
        "type": "value",
        "options": {
            "0": {"text": "failing", "color": "red"},
            "1": {"text": "up", "color": "green"},
        },
    }
    return [
        sized(
            state_timeline(
                "Probes",
                "Whether each probe's last read worked (kvguard_probe_up: engine, nvml, "
                "host). nvml reads 0 also where there is no NVIDIA driver.",
                [target(sel("kvguard_probe_up"), "{{probe}}")],
                mappings=[up],
                steps=(("red", None), ("green", 1)),
            ),
            12,
            5,
        ),
        sized(
            state_timeline(
                "kvguard scraped",
                "Whether Prometheus could scrape kvguard's /metrics (up); while down, every "
                "other panel is empty.",
                [target(sel("up"), "{{instance}}")],
                mappings=[up],
                steps=(("red", None), ("green", 1)),
            ),
            12,
            5,
        ),
        sized(
            timeseries(
                "Probe age",
                "Seconds since each probe last read its source "
                "(kvguard_probe_age_seconds); it grows while the source fails, and the "
                "source's figures are left out meanwhile.",
                "s",
                [target(sel("kvguard_probe_age_seconds"), "{{probe}}")],
            ),
            8,
            8,
        ),
        sized(
            timeseries(
                "Probe errors",
                "Failed probe reads per second, timeouts included "
                "(kvguard_probe_errors_total); an unavailable source is not an error.",
                "ops",
                [target(f"sum by (probe) ({rate('kvguard_probe_errors_total')})", "{{probe}}")],
            ),
            8,
            8,
        ),
        sized(
            timeseries(
                "Tick and probe duration",
                "Duration of kvguard's last tick (kvguard_tick_duration_seconds; probes "
                "run concurrently) and of each probe's last read "
                "(kvguard_probe_duration_seconds). A tick near the poll interval (0.5 s, "
                "0.1 s under pressure) delays every decision.",
                "s",
                [
                    target(sel("kvguard_tick_duration_seconds"), "tick"),
                    target(sel("kvguard_probe_duration_seconds"), "probe {{probe}}"),
                ],
            ),
            8,
            8,
        ),
        sized(
            timeseries(
                "Poll rate",
                "Ticks per second (rate of kvguard_ticks_total): 2 at the default 0.5 s "
                "interval, up to 10 when KV usage or demand reaches 90%, a GPU has 5% free, "
                "or an escalation waits for confirmation.",
                "hertz",
                [target(f"sum({rate('kvguard_ticks_total')})", "ticks")],
            ),
            18,
            8,
        ),
        sized(
            timeseries(
                "Event loop lag",
                "How late the event loop ran the loop watchdog's latest 0.1 s timer "
                "(kvguard_event_loop_lag_seconds) and the largest such lag since start "
                "(kvguard_event_loop_lag_max_seconds). Near 0 when healthy: the ticks, the "
                "proxy and the HTTP API share this loop.",
                "s",
                [
                    target(sel("kvguard_event_loop_lag_seconds"), "lag"),
                    target(sel("kvguard_event_loop_lag_max_seconds"), "max since start"),
                ],
            ),
            12,
            8,
        ),
        sized(
            timeseries(
                "Loop stalls and tick overruns",
                "Per second: event loop wake-ups at least 1 s late "
                "(kvguard_event_loop_stalls_total) and ticks longer than poll.timeout_s + "
                "0.5 s (kvguard_tick_overruns_total). Any is something blocking the loop; "
                "the logs name it (event_loop_stalled, tick_overran).",
                "ops",
                [
                    target(f"sum({rate('kvguard_event_loop_stalls_total')})", "loop stalls"),
                    target(f"sum({rate('kvguard_tick_overruns_total')})", "tick overruns"),
                ],
            ),
            12,
            8,
        ),
        sized(
            timeseries(
                "Event loop tasks",
                "Asyncio tasks alive on kvguard's loop (kvguard_event_loop_tasks): one per "
                "open client connection of the proxy and the HTTP API, plus a few of "
                "kvguard's own. It follows the traffic; a count that keeps rising at a "
                "steady load is a leak.",
                "short",
                [target(sel("kvguard_event_loop_tasks"), "tasks")],
            ),
            12,
            8,
        ),
        sized(
            stat(
                "kvguard version",
                "The running kvguard's version (kvguard_build_info).",
                "none",
                [target(sel("kvguard_build_info"), "{{version}}", instant=True)],
                text_mode="name",
            ),
            6,
            8,
        ),
    ]


def overview() -> Json:
    """The kvguard / Overview dashboard model."""
    sections = [
        ("Now", now_row()),
        ("VRAM budget per GPU", vram_row()),
        ("KV cache", kv_row()),
        ("Pressure, traffic and mitigations", pressure_row()),
        ("Admission proxy", proxy_row()),
        ("Engine: preemptions, restarts, OOMs", engine_row()),
        ("Budget reconciliation", reconciliation_row()),
        ("Actions on the engine", actions_row()),
        ("kvguard health", health_row()),
    ]
    return dashboard(
        "kvguard-overview",
        "kvguard / Overview",
        description="One kvguard sidecar and its inference engine: VRAM budget, KV cache forecast, "
        "pressure, mitigations, proxy, engine and kvguard health. docs/monitoring.md "
        "describes every panel.",
        panels=layout(sections),
        templating=variables(multi_instance=False),
        annotations=[decisions_annotation(()), level_change_annotation()],
    )
