"""Budget keeping: the VRAM budget of ``[model]``, kept true to the GPUs and the engine.

The daemon (:class:`~kvguard.runtime.daemon.Daemon`) inherits :class:`BudgetKeeping`:
every tick it refreshes the budget with NVML's total (when ``[gpu]`` sets none),
follows an 8-bit KV cache the engine reports, and reconciles the predicted KV
capacity with the engine's. Apart from the loop so each half reads on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog

from kvguard.config.model_files import load_model_files
from kvguard.config.settings import Config
from kvguard.core.budget import BudgetReport, budget_inputs_from, plan_budget
from kvguard.core.snapshot import EngineStats
from kvguard.core.units import DTYPE_BYTES
from kvguard.errors import KvguardError
from kvguard.runtime.probing import DaemonState

log = structlog.get_logger("kvguard.daemon")

# A reported KV capacity this far from the budget's prediction is logged.
RECONCILIATION_TOLERANCE = 0.05


def budget_for(
    config: Config, gpu_memory_bytes: int | None, kv_cache_dtype: str | None = None
) -> BudgetReport | None:
    """The VRAM budget of ``config``'s ``[model]`` on GPUs of ``gpu_memory_bytes``.

    ``kv_cache_dtype`` replaces ``[model] kv_cache_dtype`` (the engine's, after an fp8
    switch). None without ``model.config``; raises :class:`KvguardError` for an
    unusable one.
    """
    model = config.model
    if model.config is None:
        return None
    files = load_model_files(model.config)
    overrides: dict[str, object] = {"gpu_memory_bytes": gpu_memory_bytes}
    if kv_cache_dtype is not None:
        overrides["kv_cache_dtype"] = kv_cache_dtype
    inputs = budget_inputs_from(model, **overrides)
    return plan_budget(
        files.config, inputs, index_total_size=files.index_total_size, source=files.source
    )


@dataclass(frozen=True)
class Reconciliation:
    """The budget's predicted KV capacity against what the engine reports."""

    predicted_tokens: int
    reported_tokens: int

    @property
    def difference_tokens(self) -> int:
        """Reported minus predicted: positive when the engine got more than forecast."""
        return self.reported_tokens - self.predicted_tokens

    @property
    def difference_ratio(self) -> float | None:
        """The difference relative to the prediction."""
        return self.difference_tokens / self.predicted_tokens if self.predicted_tokens else None


class BudgetKeeping:
    """The budget half of the daemon: its state lives in ``state`` (``DaemonState``)."""

    config: Config
    state: DaemonState
    _budget_memory: int | None
    _engine_kv_dtype: str | None
    _reported_mismatch: int | None
    _engine_cache: dict[str, object] | None

    def notify(self, event: str, fields: dict[str, Any]) -> None:
        """Send an event out (the daemon sends it to the webhooks)."""
        raise NotImplementedError

    def refresh_budget(self, nvml_total: int | None = None) -> None:
        """(Re)compute the budget from the config, with NVML's total when no override."""
        model, gpu = self.config.model, self.config.gpu
        if model.config is None:
            self.state.budget = None
            return
        memory = gpu.memory_bytes or nvml_total
        if self.state.budget is not None and memory == self._budget_memory:
            return
        budget = budget_for(self.config, memory, self._engine_kv_dtype)
        assert budget is not None  # noqa: S101 - model.config is set
        self._adopt_budget(budget, memory)

    def _adopt_budget(self, report: BudgetReport, memory: int | None) -> None:
        """Make ``report`` (computed for ``memory`` bytes of GPU) the budget, and say so."""
        self.state.budget = report
        self._budget_memory = memory
        log.info(
            "budget_computed",
            model=self.config.model.config,
            gpu_memory_bytes=report.budget.gpu_memory_bytes,
            kv_capacity_tokens=report.budget.kv_capacity_tokens,
            kv_cache_dtype=report.budget.kv_cache_dtype,
            fits=report.budget.fits,
        )

    def _follow_engine_kv_dtype(self, engine: EngineStats) -> None:
        """Budget with the engine's 8-bit KV dtype while ``[model]`` names a wider one.

        After an fp8 switch (kvguard's, or an operator's restart with
        ``--kv-cache-dtype fp8``) the engine holds twice the tokens the configured
        dtype gives: without this, the budget and its reconciliation report a 2x
        mismatch for as long as the switch lasts. Back to a wider dtype, back to the
        configured one. An engine that does not say its dtype changes nothing.
        """
        reported = (engine.cache_dtype or "").strip().lower()
        if not reported:
            return
        configured = self.config.model.kv_cache_dtype.strip().lower()
        # "auto" (the model's dtype: what a revert restarts with) or any wider one: back
        # to the configured dtype.
        eight_bit = DTYPE_BYTES.get(reported) == 1
        follow = reported if eight_bit and DTYPE_BYTES.get(configured) != 1 else None
        if follow == self._engine_kv_dtype:
            return
        if self.config.model.config is None:
            self._engine_kv_dtype = follow
            return
        try:  # computed first: a failure keeps the budget there is
            budget = budget_for(self.config, self._budget_memory, follow)
        except KvguardError as exc:
            self._budget_failed(exc)
            return
        self._engine_kv_dtype = follow
        self.state.budget = budget
        self._reported_mismatch = None
        log.info(
            "budget_follows_engine_kv_dtype",
            engine_kv_cache_dtype=reported,
            configured_kv_cache_dtype=configured,
            budget_kv_cache_dtype=follow or configured,
        )

    def _refresh_budget_safely(self, nvml_total: int | None) -> None:
        try:
            self.refresh_budget(nvml_total)
        except KvguardError as exc:  # keep the previous budget; say why once
            self._budget_failed(exc)

    def _budget_failed(self, exc: KvguardError) -> None:
        """Log a budget that could not be computed, once per distinct reason."""
        if self.state.budget_error != str(exc):
            log.warning("budget_failed", error=str(exc))
        self.state.budget_error = str(exc)

    def _reconcile(self, engine: EngineStats | None) -> None:
        if engine is not None:
            self._notice_cache_change(engine)
            self._follow_engine_kv_dtype(engine)
        budget = self.state.budget
        if budget is None or engine is None or engine.kv_capacity_tokens is None:
            return
        rec = Reconciliation(budget.budget.kv_capacity_tokens, engine.kv_capacity_tokens)
        self.state.reconciliation = rec
        ratio = rec.difference_ratio
        mismatch = ratio is not None and abs(ratio) > RECONCILIATION_TOLERANCE
        if mismatch and self._reported_mismatch != rec.reported_tokens:
            log.warning(
                "budget_reconciliation_mismatch",
                predicted_kv_capacity_tokens=rec.predicted_tokens,
                reported_kv_capacity_tokens=rec.reported_tokens,
                difference_ratio=round(ratio or 0.0, 4),
            )
            self._reported_mismatch = rec.reported_tokens

    def _notice_cache_change(self, engine: EngineStats) -> None:
        """Log when the engine's KV cache changes shape: it restarted with other settings."""
        cache: dict[str, object] = {
            "kv_capacity_tokens": engine.kv_capacity_tokens,
            "block_size": engine.block_size,
            "cache_dtype": engine.cache_dtype,
        }
        if all(value is None for value in cache.values()):
            return  # this engine does not say; nothing to compare
        before = self._engine_cache
        self._engine_cache = cache
        if before is not None and before != cache:
            # Before the reconciliation line: an operator reads why the numbers moved.
            log.warning("engine_cache_changed", before=before, after=cache)
            self.notify("engine_cache_changed", {"before": before, "after": cache})
