"""The paged KV scheduler, step by step, without time or HTTP."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.sim.scheduler import Scheduler, SchedulerConfig, Sequence


def run_to_completion(sched: Scheduler, limit: int = 100_000) -> int:
    """Step until idle; returns the number of steps (bounded)."""
    steps = 0
    while sched.has_work and steps < limit:
        plan = sched.schedule()
        assert plan.crash is None
        sched.complete(plan)
        steps += 1
    return steps


def test_prefill_is_chunked_by_the_token_budget():
    """A 1,000-token prompt with a 256-token budget takes 4 steps to its first token."""
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=200, max_num_batched_tokens=256))
    seq = Sequence("a", prompt_tokens=1_000, max_tokens=3)
    sched.add(seq)
    chunks = []
    while seq.generated == 0:
        plan = sched.schedule()
        chunks.append(plan.total_tokens)
        sched.complete(plan)
    assert chunks == [256, 256, 256, 232]
    assert seq.blocks == 63  # ceil(1000 / 16)


def test_decode_grows_blocks_and_finish_frees_them():
    """Each decode step adds one token; blocks follow; finishing returns them all."""
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=100))
    seq = Sequence("a", prompt_tokens=15, max_tokens=4)
    sched.add(seq)
    sched.complete(sched.schedule())  # prefill 15 tokens, first token sampled
    assert (seq.computed, seq.generated, seq.blocks) == (15, 1, 1)
    sched.complete(sched.schedule())  # decode: the 16th token's KV, still one block
    assert (seq.computed, seq.blocks) == (16, 1)
    sched.complete(sched.schedule())  # 17th token needs a second block
    assert seq.blocks == 2
    sched.complete(sched.schedule())
    assert seq.state == "finished"
    assert seq.finish_reason == "length"
    assert sched.used_blocks == 0


def test_exhaustion_preempts_the_most_recently_admitted():
    """When a running sequence needs a block and none is free, the newest is preempted."""
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=5, block_size=16))  # 4 usable blocks
    old = Sequence("old", prompt_tokens=32, max_tokens=30)
    new = Sequence("new", prompt_tokens=32, max_tokens=30)
    sched.add(old)
    sched.add(new)
    sched.complete(sched.schedule())  # both prefilled: 4 blocks, pool full
    assert sched.free_blocks == 0
    plan = sched.schedule()  # old needs a 3rd block -> new is preempted
    assert plan.preempted == (new,)
    assert new.state == "waiting"
    assert (new.blocks, new.computed) == (0, 0)
    assert sched.preemptions_total == 1
    sched.complete(plan)
    run_to_completion(sched)
    assert old.finish_reason == new.finish_reason == "length"
    assert new.generated == 30


def test_oom_mode_crashes_instead_of_preempting():
    """With oom_on_exhaust, the same exhaustion is a crash, with a message saying so."""
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=5, oom_on_exhaust=True))
    for name in ("a", "b"):
        sched.add(Sequence(name, prompt_tokens=32, max_tokens=30))
    plan = sched.schedule()
    assert plan.crash is None  # a and b fill the pool exactly
    sched.complete(plan)
    plan = sched.schedule()
    assert plan.crash is not None
    assert plan.crash.startswith("simulated CUDA out of memory")


def test_oom_mode_keeps_a_waiting_request_that_does_not_fit_waiting():
    """oom_on_exhaust: admission checks free blocks, so a prompt that does not fit waits."""
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=5, oom_on_exhaust=True))  # 4 usable
    first = Sequence("first", prompt_tokens=48, max_tokens=2)  # 3 blocks, a 4th to grow
    second = Sequence("second", prompt_tokens=32, max_tokens=2)  # 2 blocks: 1 is free
    sched.add(first)
    sched.add(second)
    plan = sched.schedule()
    assert plan.crash is None
    assert [seq for seq, _ in plan.scheduled] == [first]
    assert list(sched.waiting) == [second]
    sched.complete(plan)
    run_to_completion(sched)  # asserts no step crashes
    assert first.finish_reason == second.finish_reason == "length"
    assert sched.preemptions_total == 0


def test_oom_mode_crashes_when_a_prefill_chunk_does_not_fit():
    """oom_on_exhaust: a running sequence's next prefill chunk that does not fit crashes."""
    config = SchedulerConfig(num_gpu_blocks=6, max_num_batched_tokens=48, oom_on_exhaust=True)
    sched = Scheduler(config)  # 5 usable blocks
    sched.add(Sequence("a", prompt_tokens=40, max_tokens=50))
    sched.add(Sequence("b", prompt_tokens=40, max_tokens=50))
    plan = sched.schedule()  # a: 40 tokens (3 blocks); b: its first 8 (1 block), 1 free
    assert plan.crash is None
    assert [n for _, n in plan.scheduled] == [40, 8]
    sched.complete(plan)
    plan = sched.schedule()  # b's next 32 tokens need 2 more blocks
    assert plan.crash == (
        "simulated CUDA out of memory: tried to allocate 2 KV blocks (32 tokens) with 1 of 5 free"
    )


def test_activation_limit_crashes_a_large_prefill_step():
    """A step whose prefill tokens exceed the activation limit crashes."""
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=1_000, activation_limit_tokens=500))
    sched.add(Sequence("a", prompt_tokens=400, max_tokens=2))
    plan = sched.schedule()
    assert plan.crash is None
    sched.complete(plan)
    sched.add(Sequence("b", prompt_tokens=300, max_tokens=2))
    sched.add(Sequence("c", prompt_tokens=300, max_tokens=2))
    plan = sched.schedule()
    assert plan.crash is not None
    assert "a step of 600 prefill tokens" in plan.crash


def test_max_num_seqs_caps_the_running_batch():
    """Requests beyond max_num_seqs wait even with free blocks."""
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=1_000, max_num_seqs=2))
    for name in "abc":
        sched.add(Sequence(name, prompt_tokens=10, max_tokens=5))
    sched.schedule()
    assert len(sched.running) == 2
    assert len(sched.waiting) == 1


def test_abort_frees_blocks_at_once():
    """An aborted sequence gives its blocks back and leaves the batch."""
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=100))
    seq = Sequence("a", prompt_tokens=100, max_tokens=50)
    sched.add(seq)
    sched.complete(sched.schedule())
    assert sched.used_blocks == 7
    sched.abort(seq)
    assert sched.used_blocks == 0
    assert seq.finish_reason == "abort"
    assert not sched.has_work


def test_true_length_ends_with_stop_before_max_tokens():
    """stop_after below max_tokens ends the sequence there with "stop" and frees its blocks."""
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=100))
    short = Sequence("short", prompt_tokens=10, max_tokens=500, stop_after=3)
    exact = Sequence("exact", prompt_tokens=10, max_tokens=4, stop_after=4)
    longer = Sequence("longer", prompt_tokens=10, max_tokens=5, stop_after=50)
    for seq in (short, exact, longer):
        sched.add(seq)
    run_to_completion(sched)
    assert (short.generated, short.finish_reason) == (3, "stop")
    assert (exact.generated, exact.finish_reason) == (4, "length")
    assert (longer.generated, longer.finish_reason) == (5, "length")
    assert sched.used_blocks == 0


def test_priority_policy_orders_the_waiting_queue():
    """Under "priority" a later, higher-priority request is admitted before earlier ones."""
    order = {}
    for policy in ("fcfs", "priority"):
        config = SchedulerConfig(num_gpu_blocks=100, max_num_seqs=1, scheduling_policy=policy)
        sched = Scheduler(config)
        sched.add(Sequence("blocker", prompt_tokens=10, max_tokens=2))
        sched.complete(sched.schedule())  # the blocker holds the only seat
        for name, priority in (("low-1", 5), ("low-2", 5), ("high", -1)):
            sched.add(Sequence(name, prompt_tokens=10, max_tokens=2, priority=priority))
        admitted: list[str] = []
        while sched.has_work:
            plan = sched.schedule()
            admitted += [s.request_id for s, _ in plan.scheduled if s.request_id not in admitted]
            sched.complete(plan)
        order[policy] = admitted
    assert order["fcfs"] == ["blocker", "low-1", "low-2", "high"]
    assert order["priority"] == ["blocker", "high", "low-1", "low-2"]


def _two_running(policy: str, first_priority: int) -> tuple[Scheduler, Sequence, Sequence]:
    """A full 4-block pool: ``first`` (admitted a step earlier) then ``second``.

    The next step's decode leaves ``first`` in its 2 blocks but takes ``second``
    past its 2nd block, so someone must be preempted.
    """
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=5, scheduling_policy=policy))
    first = Sequence("first", prompt_tokens=20, max_tokens=30, priority=first_priority)
    second = Sequence("second", prompt_tokens=32, max_tokens=30)
    sched.add(first)
    sched.complete(sched.schedule())
    sched.add(second)
    sched.complete(sched.schedule())
    assert sched.running == [first, second]
    assert sched.free_blocks == 0
    return sched, first, second


def test_fcfs_preempts_the_most_recently_admitted():
    """fcfs: the newest sequence is the victim, even when it is the one growing."""
    sched, first, second = _two_running("fcfs", first_priority=0)
    plan = sched.schedule()
    assert plan.preempted == (second,)
    assert plan.scheduled == ((first, 1),)


def test_priority_preempts_the_lowest_priority_even_if_already_scheduled():
    """priority: the victim is the largest (priority, arrival), taken back out of the step."""
    sched, first, second = _two_running("priority", first_priority=5)
    sched.add(Sequence("mid", prompt_tokens=10, max_tokens=2, priority=1))
    sched.add(Sequence("worst", prompt_tokens=10, max_tokens=2, priority=9))
    plan = sched.schedule()
    assert plan.preempted == (first,)
    assert [(s.request_id, n) for s, n in plan.scheduled] == [("second", 1)]
    assert (first.state, first.blocks, first.computed) == ("waiting", 0, 0)
    assert sched.used_blocks == 3  # second's 3 blocks; first's 2 were given back
    # Back in the queue in its priority's place, not at the front.
    assert [s.request_id for s in sched.waiting] == ["mid", "first", "worst"]
    sched.complete(plan)
    run_to_completion(sched)
    assert all(s.finish_reason == "length" for s in (first, second))


def test_priority_ties_preempt_the_latest_arrival():
    """priority: among equal priorities the latest arrival is the victim, as in fcfs."""
    sched, first, second = _two_running("priority", first_priority=0)
    plan = sched.schedule()
    assert plan.preempted == (second,)
    assert plan.scheduled == ((first, 1),)


def test_an_unknown_scheduling_policy_is_refused():
    """A policy other than fcfs and priority is an error naming the field."""
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        SchedulerConfig(num_gpu_blocks=10, scheduling_policy="lifo")  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 300), st.integers(1, 200)), min_size=1, max_size=12),
    st.integers(20, 60),
)
def test_every_request_completes_and_blocks_balance(requests, blocks):
    """Whatever the load, preemption never loses a request and the pool never leaks."""
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=blocks, max_model_len=(blocks - 1) * 16))
    seqs = [
        Sequence(str(i), p, m) for i, (p, m) in enumerate(requests) if p + m <= (blocks - 1) * 16
    ]
    for seq in seqs:
        sched.add(seq)
    run_to_completion(sched)
    assert all(s.generated == s.max_tokens for s in seqs)
    assert sched.free_blocks == sched.config.usable_blocks


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(1, 300), st.integers(1, 200), st.integers(1, 250), st.integers(-2, 2)
        ),
        min_size=1,
        max_size=12,
    ),
    st.integers(20, 60),
    st.sampled_from(["fcfs", "priority"]),
)
def test_true_lengths_and_priorities_never_lose_a_request(requests, blocks, policy):
    """Both policies, with true lengths: every request ends at min(length, max_tokens)."""
    config = SchedulerConfig(
        num_gpu_blocks=blocks, max_model_len=(blocks - 1) * 16, scheduling_policy=policy
    )
    sched = Scheduler(config)
    seqs = [
        Sequence(str(i), p, m, stop_after=n, priority=prio)
        for i, (p, m, n, prio) in enumerate(requests)
        if p + m <= (blocks - 1) * 16
    ]
    for seq in seqs:
        sched.add(seq)
    run_to_completion(sched)
    for seq in seqs:
        assert seq.generated == min(seq.stop_after, seq.max_tokens)
        assert seq.finish_reason == ("stop" if seq.stop_after < seq.max_tokens else "length")
    assert sched.free_blocks == sched.config.usable_blocks
