"""What is in force right now: the shed floor, the window cap, pending cancellations.

The daemon applies each :class:`~kvguard.model.policy.Decision`'s plan here (live
mode); the proxy, ``/admission`` and ``/readyz`` read it. In dry-run mode the plan is
still recorded — so ``/status`` shows what *would* be in force — but ``enforcing`` is
false and nothing reads it as a rule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from kvguard.model.policy import Action

Priority = Literal["critical", "standard", "sheddable"]
PRIORITIES: tuple[Priority, ...] = ("sheddable", "standard", "critical")  # low to high


def rank(priority: str) -> int:
    """Order of a priority class: sheddable 0, standard 1, critical 2 (unknown: standard)."""
    return PRIORITIES.index(priority) if priority in PRIORITIES else 1


def request_priority(
    headers: Mapping[str, str], header: str, api_keys: Mapping[str, str] | None, default: str
) -> str:
    """A request's class: its API key's mapping, else the priority header, else ``default``."""
    auth = headers.get("Authorization", "")
    if api_keys and auth.startswith("Bearer "):
        mapped = api_keys.get(auth.removeprefix("Bearer ").strip())
        if mapped:
            return mapped
    value = headers.get(header, "").strip().lower()
    return value if value in PRIORITIES else default


@dataclass
class Mitigations:
    """The mitigations in force, and whether they are enforced (live) or only shown."""

    enforcing: bool = True
    shed_floor: Priority | None = None  # shed requests of this priority and below
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None
    level: str = "ok"
    retry_after_s: int = 5
    cancel_largest: Callable[[], bool] | None = field(default=None, repr=False)
    # The engine's usable KV pool, refreshed every tick: what the proxy admits against.
    pool_tokens: int | None = None
    block_size: int = 16

    def apply(
        self, actions: Iterable[Action], level: str, retry_after_s: int
    ) -> list[tuple[Action, bool]]:
        """Put a plan in force; returns each action with whether it took effect."""
        self.level = level
        self.retry_after_s = max(1, retry_after_s)
        return [(action, self._apply_one(action)) for action in actions]

    def _apply_one(self, action: Action) -> bool:
        if action.kind == "shed":
            self.shed_floor = action.priority
            return True
        if action.kind == "tighten_window":
            self.max_prompt_tokens, self.max_tokens = action.max_prompt_tokens, action.max_tokens
            return True
        if action.kind == "release":
            if action.target == "shed":
                self.shed_floor = None
            elif action.target == "tighten_window":
                self.max_prompt_tokens = self.max_tokens = None
            return True
        if action.kind == "cancel_largest":
            cancel = self.cancel_largest
            return bool(self.enforcing and cancel is not None and cancel())
        return False  # evict, kv_fp8, revert_kv_fp8: no actuator for these yet

    def sheds(self, priority: str) -> bool:
        """Whether a request of ``priority`` is shed now (only while enforcing)."""
        floor = self.shed_floor
        return self.enforcing and floor is not None and rank(priority) <= rank(floor)

    @property
    def window(self) -> tuple[int | None, int | None]:
        """The (prompt, completion) token caps in force, None where there is none."""
        if not self.enforcing:
            return None, None
        return self.max_prompt_tokens, self.max_tokens
