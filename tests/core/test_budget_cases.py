"""The budget against public vLLM start-ups (tests/fixtures/budget/cases.json).

Each case is a real start-up: its source, the settings it ran with, and what vLLM
printed. ``bench/budget_cases.py`` predicts each from the config and settings alone;
these tests hold the issue's targets: the pool within max(5%, 0.25 GiB) on at least
80% of the cases kvguard can model, and, given the pool vLLM logged, the tokens and
the max concurrency it printed.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.budget_cases import case_budget, case_inputs, evaluate, load_cases
from kvguard.core.budget import Budget
from kvguard.core.units import GiB

CASES = load_cases()
ROWS = [evaluate(case) for case in CASES]
COMPARED = [r for r in ROWS if "within_target" in r]


def test_every_case_has_a_source_and_is_compared_or_says_why_not():
    """No case is dropped silently: each is compared or skipped with a reason."""
    for case, row in zip(CASES, ROWS, strict=True):
        assert case["source"].startswith("https://")
        assert ("within_target" in row) != ("skipped" in row), row
        if "skipped" in row:
            assert row["skipped"]


def test_the_pool_is_within_five_percent_on_four_cases_in_five():
    """End to end (GPU, model, flags): max(5%, 0.25 GiB) on >= 80% of compared cases."""
    assert len(COMPARED) >= 20
    models = {r["model"] for r in COMPARED}
    assert len(models) >= 8
    hits = [r for r in COMPARED if r["within_target"]]
    assert len(hits) / len(COMPARED) >= 0.8, [r["id"] for r in COMPARED if not r["within_target"]]


def test_the_compared_cases_span_four_gpu_types():
    """The comparison is not one GPU's: at least four GPU types among the compared cases."""
    assert len({r["gpu"] for r in COMPARED}) >= 4, sorted({r["gpu"] for r in COMPARED})


@pytest.mark.xfail(
    strict=True,
    reason="vLLM PR 17122's L40S start-up (a V1 build of April 2025) holds 22% fewer tokens"
    " than predicted: which default max_num_seqs that build used is unknown; and OCI AI Quick"
    " Actions' A10 start-up (V0, 131,072-token context) logged a larger pool than predicted:"
    " kvguard's V0 activation and non-torch figures exceed what that chunked-prefill profile"
    " printed",
)
def test_no_case_is_beyond_fifteen_percent():
    """Never off by more than max(15%, 0.5 GiB)."""
    assert all(r["within_bound"] for r in COMPARED), [
        r["id"] for r in COMPARED if not r["within_bound"]
    ]


def _with_logged_pool(case_id: str) -> tuple[dict[str, object], Budget]:
    """The case's budget with its pool fixed at what vLLM logged."""
    case = next(c for c in CASES if c["id"] == case_id)
    row = next(r for r in ROWS if r["id"] == case_id)
    inputs = replace(
        case_inputs(case, row["version"]),
        kv_cache_memory_bytes=round(case["logged"]["kv_cache_gib"] * GiB),
    )
    return case, case_budget(case, inputs)


TOKEN_CASES = [
    r["id"]
    for r in COMPARED
    if r["logged_kv_gib"] is not None and r["logged_tokens"] and r["pp"] == 1
]


@pytest.mark.parametrize("case_id", TOKEN_CASES)
def test_the_logged_pool_holds_the_tokens_and_concurrency_vllm_printed(case_id):
    """Per-token bytes and layout exact: from vLLM's own pool, its tokens and concurrency.

    The pool is printed to 0.01 GiB, so the tokens may differ by what 0.005 GiB holds.
    """
    case, b = _with_logged_pool(case_id)
    logged = case["logged"]
    slack = 0.005 * GiB / b.kv_bytes_per_token_per_gpu + 2 * b.inputs.block_size
    if b.model.sliding_layers:
        # vLLM reports whole requests there (concurrency x max_model_len), so the
        # printed pool's rounding moves the figure by up to half a percent.
        slack = max(slack, 0.005 * logged["kv_tokens"])
    assert abs(b.kv_capacity_tokens - logged["kv_tokens"]) <= slack, (
        b.kv_capacity_tokens,
        logged["kv_tokens"],
    )
    if logged.get("max_concurrency"):
        assert b.max_concurrency_ratio == pytest.approx(logged["max_concurrency"], rel=0.02)
