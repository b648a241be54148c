"""Shared fixtures: the model configs bundled with kvguard, loaded from disk."""

from __future__ import annotations

import pytest

from kvguard.model.budget import BudgetInputs, BudgetReport, plan_budget
from kvguard.model_files import load_model_files


@pytest.fixture
def budget_of():
    """Budget a bundled (or on-disk) model the way `kvguard budget` does."""

    def run(model: str, **inputs: object) -> BudgetReport:
        files = load_model_files(model)
        return plan_budget(
            files.config,
            BudgetInputs(**inputs),  # type: ignore[arg-type]
            index_total_size=files.index_total_size,
            source=files.source,
        )

    return run
