"""The fast path of parse_exposition (kvguard/probes/engines/wanted.py) against the strict one.

On every fixture, for every adapter's reads, the fast path must give exactly what
prometheus_client's parser gives after keep_lines (names, labels, values and their
types, order); on text that is not plainly exposition it must step aside (None) so
the strict path judges it as before.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.errors import ProbeError
from kvguard.probes.engines import ADAPTERS
from kvguard.probes.engines.base import Samples, keep_lines
from kvguard.probes.engines.wanted import FamilyCache, parse_wanted

ROOT = Path(__file__).parent.parent / "fixtures"
EXPOSITIONS = sorted(
    [*(ROOT / "engines").glob("*.txt"), ROOT / "bench" / "vllm-cpu-dp4.txt"],
    key=lambda p: p.name,
)
READS = {kind: adapter.reads for kind, adapter in ADAPTERS.items() if adapter.reads is not None}


def strict(text: str, reads: frozenset[str]) -> dict[str, list[tuple[dict[str, str], float]]]:
    """What the strict path gives: prometheus_client after keep_lines."""
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(keep_lines(text, reads)):
        for sample in family.samples:
            by_name.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return by_name


def same(
    fast: dict[str, list[tuple[dict[str, str], float]]],
    slow: dict[str, list[tuple[dict[str, str], float]]],
) -> bool:
    """Equal names, series in order, labels, values, and value types (int or float)."""
    if fast.keys() != slow.keys():
        return False
    for name, series in slow.items():
        if len(fast[name]) != len(series):
            return False
        for (fl, fv), (sl, sv) in zip(fast[name], series, strict=True):
            both_nan = math.isnan(fv) and math.isnan(sv)
            if fl != sl or type(fv) is not type(sv) or not (fv == sv or both_nan):
                return False
    return True


@pytest.mark.parametrize("path", EXPOSITIONS, ids=lambda p: p.name)
@pytest.mark.parametrize("kind", sorted(READS))
def test_every_fixture_reads_the_same_both_ways(path, kind):
    """Real captures and fixtures take the fast path and agree with prometheus_client."""
    text = path.read_text()
    fast = parse_wanted(text, READS[kind])
    assert fast is not None, "a well-formed fixture took the strict path"
    assert same(fast, strict(text, READS[kind]))


VLLM = (ROOT / "engines" / "vllm-cpu-busy.txt").read_text()


@pytest.mark.parametrize(
    "text",
    [
        "<html><body><h1>502 Bad Gateway</h1></body></html>\n",
        VLLM[: VLLM.index("vllm:num_requests_running{") + 30],  # cut mid-line, no newline
        VLLM.replace(
            'vllm:num_requests_running{engine="0"', 'vllm:num_requests_running{engine="0"x', 1
        ),
        VLLM.replace(
            "vllm:num_requests_waiting{", "vllm:num_requests_wait{", 1
        ),  # not its family's
        "stray text before the families\n" + VLLM,
        VLLM + "garbage at the end\n",  # the last family is always checked
    ],
    ids=["html", "cut", "bad-labels", "foreign-sample", "prefix", "tail"],
)
def test_text_that_is_not_plainly_exposition_takes_the_strict_path(text):
    """The fast path steps aside; the strict path keeps judging such text as before."""
    assert parse_wanted(text, READS["vllm"]) is None


def test_a_counter_without_total_is_named_as_prometheus_client_names_it():
    """TGI's exporter writes counters without _total; both paths add it."""
    text = (
        "# HELP tgi_request_success ok\n# TYPE tgi_request_success counter\ntgi_request_success 5\n"
    )
    fast = parse_wanted(text, READS["tgi"])
    assert fast == {"tgi_request_success_total": [({}, 5)]}
    assert same(fast, strict(text, READS["tgi"]))


def test_escaped_label_values_read_as_prometheus_client_reads_them():
    """Backslash, quote and newline escapes in a label value, unescaped alike."""
    text = (
        "# HELP vllm:num_requests_running r\n# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="a\\\\b \\"q\\" \\n z",engine="0"} 3\n'
    )
    fast = parse_wanted(text, READS["vllm"])
    assert fast is not None
    assert fast["vllm:num_requests_running"] == [
        ({"model_name": 'a\\b "q" \n z', "engine": "0"}, 3)
    ]
    assert same(fast, strict(text, READS["vllm"]))


LINES = VLLM.split("\n")
# Lines of families the vLLM adapter reads (others are skipped whole, unexamined).
WANTED_LINES = [
    i
    for i, line in enumerate(LINES)
    if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{"))
]


@settings(max_examples=150, deadline=None)
@given(
    index=st.sampled_from(WANTED_LINES),
    cut=st.integers(min_value=0, max_value=200),
    junk=st.sampled_from(['"', "{", "}", ",", " ", "x", "=", "\\", "\t", "#", "NaN", "1e5"]),
)
def test_a_damaged_read_line_is_never_read_differently(index, cut, junk):
    """Damage to a line kvguard reads: the fast path agrees with the strict one or steps aside."""
    line = LINES[index]
    at = min(cut, len(line))
    damaged = "\n".join([*LINES[:index], line[:at] + junk + line[at:], *LINES[index + 1 :]])
    fast = parse_wanted(damaged, READS["vllm"])
    if fast is None:
        return
    try:
        slow = strict(damaged, READS["vllm"])
    except (ValueError, IndexError, KeyError, TypeError):
        pytest.fail("the fast path read a line the strict parser refuses")
    assert same(fast, slow)


def test_samples_from_the_fast_path_answer_the_adapters_lookups():
    """parse_exposition's result is the same Samples either way (the vLLM adapter's view)."""
    fast = parse_wanted(VLLM, READS["vllm"])
    assert fast is not None
    running = Samples(fast).total("vllm:num_requests_running")
    assert running == Samples(strict(VLLM, READS["vllm"])).total("vllm:num_requests_running")
    with pytest.raises(ProbeError):
        Samples({"vllm:num_requests_running": [({}, -1.0)]}).total("vllm:num_requests_running")


def test_a_bad_line_in_a_family_nobody_reads_no_longer_fails_the_tick():
    """Families an adapter does not read are skipped whole (docs/engines.md says so)."""
    damaged = VLLM.replace(
        "vllm:num_requests_waiting_by_reason{", '"vllm:num_requests_waiting_by_reason{', 1
    )
    assert damaged != VLLM
    fast = parse_wanted(damaged, READS["vllm"])
    assert fast is not None
    assert same(fast, strict(VLLM, READS["vllm"]))


def test_the_family_cache_never_changes_what_is_read():
    """Scrape after scrape, a probe's cache gives what a fresh parse gives.

    The pages alternate between a busy and an idle engine (every family read changes),
    repeat (nothing changes), turn malformed in between (strict path) and change the
    names read; each answer is compared with a parse without the cache.
    """
    idle = (ROOT / "engines" / "vllm-cpu-idle.txt").read_text()
    damaged = VLLM.replace('vllm:num_requests_running{engine="0"', "vllm:num_requests_running{x", 1)
    cache = FamilyCache()
    pages = [VLLM, VLLM, idle, VLLM, damaged, VLLM, idle, idle]
    reads = [READS["vllm"]] * len(pages) + [READS["sglang"], READS["vllm"]]
    for page, read in zip([*pages, VLLM, VLLM], reads, strict=True):
        assert parse_wanted(page, read, cache) == parse_wanted(page, read)


def test_an_unchanged_family_is_not_parsed_again():
    """The second scrape of the same page reuses the first's samples (the same objects)."""
    cache = FamilyCache()
    first = parse_wanted(VLLM, READS["vllm"], cache)
    again = parse_wanted(VLLM, READS["vllm"], cache)
    assert first is not None
    assert again is not None
    name = "vllm:cache_config_info"
    assert again[name] == first[name]
    assert again[name][0][0] is first[name][0][0]  # reused: not parsed again
    idle = (ROOT / "engines" / "vllm-cpu-idle.txt").read_text()
    changed = parse_wanted(idle, READS["vllm"], cache)
    assert changed is not None
    running = "vllm:num_requests_running"
    assert changed[running] == parse_wanted(idle, READS["vllm"])[running]
