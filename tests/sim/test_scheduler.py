"""The paged KV scheduler, step by step, without time or HTTP."""

from __future__ import annotations

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
