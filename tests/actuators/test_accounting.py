"""The in-flight totals admission reads: kept as requests change, equal to a recount."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.actuators.accounting import Inflight, InflightRequest
from kvguard.actuators.mitigations import Mitigations
from kvguard.actuators.proxy.admit import Admission
from kvguard.actuators.proxy.counting import PromptCounter
from kvguard.actuators.proxy.settings import ProxyCounters, ProxySettings
from kvguard.core.admission import pooled_reservation, whole_blocks


def _summed(requests: list[InflightRequest], block: int, quantile: float) -> int:
    """What the totals must read: every request's projection summed (or pooled), afresh."""
    each = sum(whole_blocks(r.projected_tokens, block) for r in requests)
    if quantile >= 1.0:
        return each
    expected = sum(whole_blocks(r.expected_tokens, block) for r in requests)
    variance = sum(math.ceil(r.output_variance) for r in requests)  # whole tokens squared
    return pooled_reservation(each, expected, variance, quantile)


def _request(draw: st.DrawFn, name: int) -> InflightRequest:
    request = InflightRequest(
        f"r{name}",
        draw(st.sampled_from(["critical", "standard", "sheddable"])),
        draw(st.integers(1, 4000)),
        draw(st.none() | st.integers(1, 2000)),
    )
    request.streamed = draw(st.booleans())
    if draw(st.booleans()):  # reserved from learned lengths
        request.reserved_output = draw(st.integers(1, 1000))
        request.output_ceiling = draw(st.integers(request.reserved_output, 4000))
    return request


@st.composite
def _histories(draw: st.DrawFn) -> list[tuple[str, int, object]]:
    """A run of adds, changes and ends, as the proxy and the daemon's ticks make them."""
    steps = []
    for _ in range(draw(st.integers(1, 60))):
        op = draw(
            st.sampled_from(
                [
                    "add",
                    "add",
                    "chunk",
                    "chunk",
                    "chunk",
                    "chunk",
                    "jump",
                    "prompt",
                    "reserve",
                    "expect",
                    "unexpect",
                    "max_tokens",
                    "done",
                ]
            )
        )
        if op == "add":
            steps.append((op, 0, _request(draw, len(steps))))
        elif op == "chunk":
            steps.append((op, draw(st.integers(0, 50)), draw(st.integers(1, 8))))
        elif op == "jump":
            steps.append((op, draw(st.integers(0, 50)), draw(st.integers(0, 5000))))
        elif op == "prompt":
            steps.append((op, draw(st.integers(0, 50)), draw(st.integers(1, 5000))))
        elif op == "reserve":
            steps.append((op, draw(st.integers(0, 50)), draw(st.integers(1, 3000))))
        elif op == "expect":
            value = (draw(st.floats(0, 3000)), draw(st.floats(0, 1e6)))
            steps.append((op, draw(st.integers(0, 50)), value))
        elif op == "max_tokens":
            steps.append((op, draw(st.integers(0, 50)), draw(st.none() | st.integers(1, 3000))))
        else:
            steps.append((op, draw(st.integers(0, 50)), None))
    return steps


@settings(max_examples=300, deadline=None)
@given(_histories(), st.sampled_from([1, 16, 128]))
def test_the_totals_kept_as_requests_change_equal_a_recount(history, block):
    """Whatever changes and in whatever order, the kept totals are what summing afresh gives."""
    inflight = Inflight()
    live: list[InflightRequest] = []
    for op, index, value in history:
        if op == "add":
            assert isinstance(value, InflightRequest)
            inflight.add(value)
            live.append(value)
        elif live:
            request = live[index % len(live)]
            if op == "chunk":  # a stream's chunks: within the reservation, or past it
                request.generated += value
            elif op == "jump":  # a whole answer's usage, at its end
                request.generated = value
            elif op == "prompt":  # the engine's count replaces the estimate
                request.prompt_tokens = value
            elif op == "reserve":  # re-reserved after it outran its length
                request.reserved_output = value
            elif op == "expect":  # the tick re-reads where it will likely end
                request.expected_output, request.output_variance = value
            elif op == "unexpect":
                request.expected_output, request.output_variance = None, 0.0
            elif op == "max_tokens":
                request.max_tokens = value
            elif op == "done":
                inflight.done(request)
                live.remove(request)
        assert inflight.total_tokens == sum(r.footprint_tokens for r in live)
        for quantile in (1.0, 0.95):
            assert inflight.projected_tokens(block, quantile) == _summed(live, block, quantile)


def test_a_request_that_ended_no_longer_moves_the_totals():
    """Its last chunks and counts, after its end, change nothing in flight."""
    inflight = Inflight()
    ended, running = (
        InflightRequest("a", "standard", 100, 50),
        InflightRequest("b", "standard", 10, 5),
    )
    inflight.add(ended)
    inflight.add(running)
    inflight.done(ended)
    ended.generated += 40
    ended.prompt_tokens = 900
    assert inflight.total_tokens == 10
    assert inflight.projected_tokens(1) == 15


def test_the_totals_follow_a_new_block_size():
    """Engines allocate whole blocks: a new block size rounds every request again."""
    inflight = Inflight()
    for tokens in (10, 20, 30):
        inflight.add(InflightRequest(str(tokens), "standard", tokens, 1))
    assert inflight.projected_tokens(1) == 63
    assert inflight.projected_tokens(16) == 16 + 32 + 32
    assert inflight.projected_tokens(1) == 63


def test_admission_on_a_roomy_pool_does_not_need_the_peak_step_by_step(monkeypatch):
    """Where the projections summed fit, no request's growth is walked: the check is O(1).

    The peak step by step (every request in flight, sorted) is built only when the
    sum does not settle whether a request fits.
    """
    built = []
    original = Admission.envelope

    def counting(self):  # type: ignore[no-untyped-def]
        built.append(len(self._inflight))
        return original(self)

    monkeypatch.setattr(Admission, "envelope", counting)
    mitigations = Mitigations(pool_tokens=1_000_000, block_size=16)
    upstream = "http://127.0.0.1:1"  # never reached: nothing here is forwarded
    admission = Admission(
        ProxySettings(upstream=upstream, admission="projected"),
        mitigations,
        Inflight(),
        ProxyCounters(),
        PromptCounter(lambda: None, upstream),  # type: ignore[arg-type,return-value]
    )
    for i in range(200):
        request = InflightRequest(str(i), "standard", 500, 500)
        assert admission.admits_now(request)
        admission._inflight.add(request)
    assert built == []
    # A pool the sum overflows: the peak step by step decides (requests end apart).
    mitigations.pool_tokens = 200 * 1024
    newcomer = InflightRequest("new", "standard", 500, 500)
    admission.admits_now(newcomer)
    assert built == [200]
