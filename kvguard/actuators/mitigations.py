"""What is in force right now: the shed floor, the window cap, pending cancellations.

The daemon applies each :class:`~kvguard.core.policy.Decision`'s plan here (live
mode); the proxy, ``/admission`` and ``/readyz`` read it. In dry-run mode the plan is
still recorded — so ``/status`` shows what *would* be in force — but ``enforcing`` is
false and nothing reads it as a rule.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

from kvguard.core.policy import Action

Priority = Literal["critical", "standard", "sheddable"]
# What became of an action: in force now (applied), handed to an asynchronous
# actuator whose result comes later (started), or nothing could act on it.
Outcome = Literal["applied", "started", "not_applied"]
ASYNC_ACTIONS = frozenset({"evict", "kv_fp8", "revert_kv_fp8"})
PRIORITIES: tuple[Priority, ...] = ("sheddable", "standard", "critical")  # low to high


def rank(priority: str) -> int:
    """Order of a priority class: sheddable 0, standard 1, critical 2 (unknown: standard)."""
    return PRIORITIES.index(priority) if priority in PRIORITIES else 1


# Where a request's API key can be, as the engines read it: vLLM, SGLang and TGI take
# `Authorization: Bearer <key>` (a scheme RFC 7235 makes case-insensitive); llama-server
# also takes a bare `Authorization: <key>` and `X-Api-Key: <key>` (Anthropic's header).
# The map must see every spelling an engine accepts, or a client mapped to sheddable
# could pass the engine's check under a spelling the map misses, and escape its class.
_API_KEY_HEADER = "x-api-key"
_AUTHORIZATION = "authorization"
# RFC 7235: the scheme is case-insensitive and followed by one or more spaces; tabs
# tolerated too (only a mapped key ever matches, so tolerance cannot lift a client).
_WHITESPACE = re.compile(r"[ \t]+")


def request_priority(
    headers: Mapping[str, str],
    header: str,
    api_keys: Mapping[str, str] | None,
    default: str,
    *,
    trust_header: bool = True,
) -> str:
    """A request's class: its API key's mapping, else the priority header, else ``default``.

    The key is looked for wherever an engine reads one: ``Authorization: Bearer <key>``
    (the scheme in any case, any run of blanks), a bare ``Authorization: <key>`` and
    ``X-Api-Key: <key>``, in every copy of those headers. When several mapped keys are
    present the lowest class wins, so adding a header can never raise a request.

    With ``trust_header`` false the header is ignored: any client can send it, and
    ``critical`` is never shed.
    """
    if api_keys:
        mapped = [api_keys[key] for key in _presented_keys(headers) if key in api_keys]
        if mapped:
            return min(mapped, key=rank)
    if not trust_header:
        return default
    value = headers.get(header, "").strip().lower()
    return value if value in PRIORITIES else default


def _presented_keys(headers: Mapping[str, str]) -> Iterator[str]:
    """Every credential the request carries where an engine would read an API key."""
    # items(), not get(): a multidict yields every copy of a repeated header, and a
    # plain mapping (tests, callers) is matched without regard to the name's case.
    for name, value in headers.items():
        lowered = name.lower()
        if lowered == _API_KEY_HEADER:
            yield value.strip(" \t")
        elif lowered == _AUTHORIZATION:
            parts = _WHITESPACE.split(value.strip(" \t"))
            if len(parts) == 2 and parts[0].lower() == "bearer":
                yield parts[1]
            elif len(parts) == 1:
                yield parts[0]  # llama-server accepts the key without a scheme


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
    # The engine's own count of KV tokens in use at the last tick: admission's floor
    # for what is in flight (traffic past the proxy, answers over their reservation).
    engine_used_tokens: int | None = None
    # What the engine does when its pool runs out (kvguard.core.admission.kv_exhaustion)
    # and why that is believed: with "fail", the proxy cancels before it runs out; an
    # engine that preempts resumes the request later, which costs less than a cancel.
    kv_exhaustion: str = "fail"
    kv_exhaustion_reason: str = "the engine's kind is not known yet"
    # The longest sequence the engine serves ([model] max_model_len), when known: the
    # ceiling of an answer that sets no max_tokens.
    context_tokens: int | None = None
    # What a typical request of the current traffic needs, prompt + answer (the
    # proxy's learned lengths; None: not enough seen): the floor of a window cap.
    typical_request_tokens: Callable[[], int | None] | None = field(default=None, repr=False)
    # Requests the proxy holds at the door for KV room now (its own queue).
    admission_waiting: Callable[[], int] | None = field(default=None, repr=False)
    # Whether the proxy's admission checks each request against the pool now.
    admission_guards: Callable[[], bool] | None = field(default=None, repr=False)
    # The fp8 switch's drain: every generation request is refused until it ends.
    draining: bool = False
    drain_retry_after_s: int = 60
    # Starts an asynchronous action (evict, kv_fp8, revert_kv_fp8, and the engine-side
    # shed); returns whether it started. Connected by the assembly when actuators exist.
    launch: Callable[[Action], bool] | None = field(default=None, repr=False)
    # Who says the engine is restarting now ("crash": the supervisor; "reconfigure": the
    # fp8 switch) -> the seconds to tell clients. Not a rule, a fact: the proxy's 502s
    # meanwhile carry Retry-After, in dry-run too.
    restarting: dict[str, int] = field(default_factory=dict)

    def connect(self, *, launch: Callable[[Action], bool]) -> None:
        """Start asynchronous actions through ``launch`` (the actuators, built after this).

        The one link :func:`kvguard.runtime.assembly.build_guard` makes after building:
        the actuators need the mitigations (the proxy's drain), and the mitigations
        start the actuators' actions.
        """
        self.launch = launch

    def engine_restarting(self, source: str, retry_after_s: int | None) -> None:
        """Mark the engine restarting, as ``source`` knows it (None: no longer)."""
        if retry_after_s is None:
            self.restarting.pop(source, None)
        else:
            self.restarting[source] = max(1, retry_after_s)

    @property
    def restart_retry_after_s(self) -> int | None:
        """Retry-After for kvguard's own errors while the engine restarts; None when not."""
        return max(self.restarting.values()) if self.restarting else None

    def apply(
        self, actions: Iterable[Action], level: str, retry_after_s: int
    ) -> list[tuple[Action, Outcome]]:
        """Put a plan in force; returns each action with what became of it."""
        self.level = level
        self.retry_after_s = max(1, retry_after_s)
        return [(action, self._apply_one(action)) for action in actions]

    def _apply_one(self, action: Action) -> Outcome:
        if action.kind == "shed" or (action.kind == "release" and action.target == "shed"):
            self._launch_quietly(action)  # the engine-side shed follows the floor
        if action.kind == "shed":
            self.shed_floor = action.priority
            return "applied"
        if action.kind == "tighten_window":
            self.max_prompt_tokens, self.max_tokens = action.max_prompt_tokens, action.max_tokens
            return "applied"
        if action.kind == "release":
            if action.target == "shed":
                self.shed_floor = None
            elif action.target == "tighten_window":
                self.max_prompt_tokens = self.max_tokens = None
            return "applied"
        if action.kind == "cancel_largest":
            cancel = self.cancel_largest
            return (
                "applied" if self.enforcing and cancel is not None and cancel() else "not_applied"
            )
        if action.kind in ASYNC_ACTIONS and self.enforcing and self.launch is not None:
            return "started" if self.launch(action) else "not_applied"
        return "not_applied"

    def _launch_quietly(self, action: Action) -> None:
        """Tell the asynchronous actuators about a shed or release (they may pause the engine)."""
        if self.enforcing and self.launch is not None:
            self.launch(action)

    def set_enforcing(self, enforcing: bool, reason: str) -> bool:
        """Enforce the plan in force (live) or only show it (dry-run); True when it changed.

        Stopping resumes an engine kvguard paused: dry-run changes nothing, so nothing
        it did may stay in force. Starting again enforces the plan the ladder keeps
        recording in dry-run, the engine-side shed included.
        """
        if enforcing == self.enforcing:
            return False
        if not enforcing and self.launch is not None:
            self.launch(Action("release", reason, target="shed"))
        self.enforcing = enforcing
        floor = self.shed_floor
        if enforcing and floor in ("sheddable", "standard"):
            self._launch_quietly(Action("shed", reason, priority=floor))
        return True

    def release_all(self, reason: str) -> list[str]:
        """Lift every mitigation in force now; returns what was lifted.

        The shed floor and the window caps go at once (``shed``, ``tighten_window``);
        an engine kvguard paused is resumed in the background (``engine_pause``:
        the resume started). Resuming is always safe, so it is asked for even in
        dry-run. The fp8 switch is a restart, not a mitigation in force: it is not
        reverted here, and a running drain is not interrupted.
        """
        released: list[str] = []
        if self.shed_floor is not None:
            self.shed_floor = None
            released.append("shed")
        if self.max_prompt_tokens is not None or self.max_tokens is not None:
            self.max_prompt_tokens = self.max_tokens = None
            released.append("tighten_window")
        if self.launch is not None and self.launch(Action("release", reason, target="shed")):
            released.append("engine_pause")
        return released

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
