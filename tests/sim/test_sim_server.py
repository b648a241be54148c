"""The simulated engine served on 127.0.0.1, exercised over HTTP like a real vLLM."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvguard.config.model_files import load_model_files
from kvguard.core.budget import BudgetInputs, plan_budget
from kvguard.core.units import GiB
from tests.helpers import until

VLLM_TYPES = {
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:cache_config_info": "gauge",
}


async def scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """GET /metrics and parse it with prometheus_client: {sample name: {labels: value}}."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def value(samples, name: str, **labels: str) -> float:
    """Sum of a sample's values over label sets that include ``labels``."""
    return sum(v for key, v in samples.get(name, {}).items() if set(labels.items()) <= set(key))


async def complete(
    http: aiohttp.ClientSession, url: str, prompt_words: int, max_tokens: int, **extra
):
    """POST /v1/completions with a prompt of exactly ``prompt_words`` tokens."""
    body = {"prompt": " ".join(["word"] * prompt_words), "max_tokens": max_tokens, **extra}
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        return resp.status, await resp.json()


async def test_metrics_have_vllm_names_types_and_labels(sim_engine):
    """/metrics parses with prometheus_client and carries the vLLM v1 series."""
    url = await sim_engine(kv_capacity_tokens=4096, max_model_len=2048)
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in VLLM_TYPES.items():
        assert families[name].type == kind, name
    usage = families["vllm:kv_cache_usage_perc"].samples[0]
    assert usage.labels == {"model_name": "kvguard-sim", "engine": "0"}
    info = families["vllm:cache_config_info"].samples[0].labels
    assert info["block_size"] == "16"
    assert info["num_gpu_blocks"] == "256"
    assert {"cache_dtype", "gpu_memory_utilization"} <= info.keys()
    assert "model_name" not in info


async def test_usage_rises_with_load_and_falls_when_requests_finish(sim_engine):
    """KV usage goes up while requests run and returns to zero after them."""
    url = await sim_engine(kv_capacity_tokens=8192, per_token_s=0.0005)
    peak = 0.0
    async with aiohttp.ClientSession() as http:
        burst = asyncio.gather(*(complete(http, url, 200, 60) for _ in range(8)))

        async def rising() -> bool:
            nonlocal peak
            peak = max(peak, value(await scrape(url), "vllm:kv_cache_usage_perc"))
            return peak > 0.1

        await until(rising)
        results = await burst
    assert all(status == 200 for status, _ in results)
    after = await scrape(url)
    assert value(after, "vllm:kv_cache_usage_perc") == 0.0
    assert value(after, "vllm:request_success_total", finished_reason="length") == 8
    assert value(after, "vllm:prompt_tokens_total") == 8 * 200
    assert value(after, "vllm:generation_tokens_total") == 8 * 60


async def test_long_context_burst_on_a_small_pool_preempts(sim_engine):
    """Six long sequences in a pool that holds two: preemptions, and all still finish."""
    url = await sim_engine(kv_capacity_tokens=2048, max_model_len=1024)
    async with aiohttp.ClientSession() as http:
        results = await asyncio.gather(*(complete(http, url, 500, 400) for _ in range(6)))
    assert all(status == 200 for status, _ in results)
    assert all(body["usage"]["completion_tokens"] == 400 for _, body in results)
    samples = await scrape(url)
    assert value(samples, "vllm:num_preemptions_total") > 0


async def test_oom_mode_crashes_under_the_same_burst(sim_server):
    """With --oom-on-exhaust the burst kills the engine: requests fail, /health 503."""
    server = await sim_server(kv_capacity_tokens=2048, max_model_len=1024, oom_on_exhaust=True)
    async with aiohttp.ClientSession() as http:
        results = await asyncio.gather(*(complete(http, server.url, 500, 400) for _ in range(6)))
        assert {status for status, _ in results} == {500}
        assert "simulated CUDA out of memory" in results[0][1]["message"]
        async with http.get(f"{server.url}/health") as resp:
            assert resp.status == 503
        status, _ = await complete(http, server.url, 10, 10)
        assert status == 503
    assert server.crashed.is_set()
    assert server.engine.dead_reason is not None


async def test_activation_limit_crashes_on_a_prefill_burst(sim_server):
    """A step with more prefill tokens than --activation-limit-tokens crashes the engine."""
    server = await sim_server(
        kv_capacity_tokens=65_536, max_num_batched_tokens=4096, activation_limit_tokens=1000
    )
    async with aiohttp.ClientSession() as http:
        results = await asyncio.gather(*(complete(http, server.url, 600, 5) for _ in range(4)))
    assert {status for status, _ in results} == {500}
    assert "activation limit" in (server.engine.dead_reason or "")


async def test_fp8_doubles_the_pool(sim_engine):
    """--kv-cache-dtype fp8 holds twice the tokens in the same memory."""
    auto = await scrape(await sim_engine(kv_capacity_tokens=4096, max_model_len=2048))
    fp8 = await scrape(
        await sim_engine(kv_capacity_tokens=4096, max_model_len=2048, kv_cache_dtype="fp8")
    )

    def blocks(samples) -> int:
        (labels,) = samples["vllm:cache_config_info"]
        return int(dict(labels)["num_gpu_blocks"])

    assert blocks(fp8) == 2 * blocks(auto)
    assert dict(next(iter(fp8["vllm:cache_config_info"])))["cache_dtype"] == "fp8"


async def test_pool_from_the_budget_matches_kvguard_budget(sim_engine):
    """--model + --gpu-memory sizes the pool exactly as `kvguard budget` predicts."""
    files = load_model_files("llama-3.1-8b")
    for dtype in ("auto", "fp8"):
        inputs = BudgetInputs(
            max_model_len=4096,
            gpu_memory_bytes=24 * GiB,  # utilization: vLLM's default, as the sim's
            max_num_batched_tokens=2048,
            max_num_seqs=64,
            kv_cache_dtype=dtype,
        )
        predicted = plan_budget(
            files.config, inputs, index_total_size=files.index_total_size
        ).budget
        url = await sim_engine(
            model="llama-3.1-8b", gpu_memory_bytes=24 * GiB, kv_cache_dtype=dtype
        )
        (labels,) = (await scrape(url))["vllm:cache_config_info"]
        assert int(dict(labels)["num_gpu_blocks"]) == predicted.kv_capacity_blocks


async def test_pause_wait_refuses_new_requests_and_drains(sim_server):
    """/pause?mode=wait: new requests get 503, in-flight ones finish; /resume re-admits."""
    server = await sim_server(kv_capacity_tokens=8192, per_token_s=0.0005)
    url = server.url
    async with aiohttp.ClientSession() as http:
        inflight = asyncio.ensure_future(complete(http, url, 100, 100))
        await until(lambda: _running(url))
        async with http.post(f"{url}/pause", params={"mode": "wait"}) as resp:
            assert resp.status == 200
        async with http.get(f"{url}/is_paused") as resp:
            assert (await resp.json())["is_paused"] is True
        status, body = await complete(http, url, 10, 5)
        assert status == 503
        assert body["object"] == "error"
        status, body = await inflight
        assert (status, body["choices"][0]["finish_reason"]) == (200, "length")
        async with http.post(f"{url}/resume") as resp:
            assert resp.status == 200
        status, _ = await complete(http, url, 10, 5)
        assert status == 200


async def test_pause_abort_drops_in_flight_requests(sim_engine):
    """/pause?mode=abort ends in-flight requests with finish_reason abort."""
    url = await sim_engine(kv_capacity_tokens=8192, per_token_s=0.0005)
    async with aiohttp.ClientSession() as http:
        inflight = asyncio.ensure_future(complete(http, url, 100, 1000))
        await until(lambda: _running(url))
        async with http.post(f"{url}/pause", params={"mode": "abort"}):
            pass
        _, body = await inflight
    assert body["choices"][0]["finish_reason"] == "abort"
    samples = await scrape(url)
    assert value(samples, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(samples, "vllm:kv_cache_usage_perc") == 0.0


async def test_client_disconnect_aborts_and_frees_blocks(sim_engine):
    """A streaming client that goes away frees its blocks, as vLLM aborts such requests."""
    url = await sim_engine(kv_capacity_tokens=8192, step_fixed_s=0.01)
    async with aiohttp.ClientSession() as http:
        body = {"prompt": "word " * 500, "max_tokens": 2000, "stream": True}
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            await resp.content.readline()  # the first chunk arrived: blocks are held
            assert value(await scrape(url), "vllm:kv_cache_usage_perc") > 0
        # leaving the block closes the connection mid-stream

    async def freed() -> bool:
        samples = await scrape(url)
        return value(samples, "vllm:request_success_total", finished_reason="abort") == 1

    await until(freed)
    assert value(await scrape(url), "vllm:kv_cache_usage_perc") == 0.0


async def test_streaming_chunks_and_usage(sim_engine):
    """SSE: one chunk per token, the last with finish_reason, usage when asked, then [DONE]."""
    url = await sim_engine()
    body = {
        "messages": [{"role": "user", "content": "how big is the cache?"}],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{url}/v1/chat/completions", json=body) as resp,
    ):
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        lines = [line.decode().strip() async for line in resp.content if line.strip()]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    tokens = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(tokens) == 4
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 6 + 4 + 3,
        "completion_tokens": 4,
        "total_tokens": 17,
    }


async def test_same_seed_same_text(sim_engine):
    """Generated text is reproducible with a seed."""
    texts = []
    for _ in range(2):
        url = await sim_engine(seed=7)
        async with aiohttp.ClientSession() as http:
            _, body = await complete(http, url, 5, 12)
        texts.append(body["choices"][0]["text"])
    assert texts[0] == texts[1]
    assert len(texts[0].split()) == 12


async def test_too_long_requests_and_bad_bodies_get_400(sim_engine):
    """A request over max_model_len gets vLLM's 400; so does a body that is not JSON."""
    url = await sim_engine(max_model_len=1024)
    async with aiohttp.ClientSession() as http:
        status, body = await complete(http, url, 1000, 100)
        assert status == 400
        assert "maximum context length is 1024 tokens" in body["message"]
        async with http.post(f"{url}/v1/completions", data=b"{not json") as resp:
            assert resp.status == 400
        async with http.post(f"{url}/tokenize", json={"prompt": "Hello, world!"}) as resp:
            assert (await resp.json())["count"] == 4


async def test_reset_prefix_cache_fails_while_blocks_are_held(sim_engine):
    """reset_prefix_cache answers success false while requests hold blocks; forced, it preempts."""
    url = await sim_engine(kv_capacity_tokens=8192, per_token_s=0.0005)
    async with aiohttp.ClientSession() as http:
        inflight = asyncio.ensure_future(complete(http, url, 100, 300))
        await until(lambda: _running(url))
        async with http.post(f"{url}/reset_prefix_cache") as resp:
            assert (await resp.json()) == {"success": False}
        params = {"reset_running_requests": "true"}
        async with http.post(f"{url}/reset_prefix_cache", params=params) as resp:
            assert (await resp.json()) == {"success": True}
        status, _ = await inflight
    assert status == 200
    assert value(await scrape(url), "vllm:num_preemptions_total") == 1


async def test_dev_endpoints_can_be_hidden(sim_engine):
    """Without dev mode, vLLM's admin endpoints answer 404, as the real server does."""
    url = await sim_engine(dev_endpoints=False)
    async with aiohttp.ClientSession() as http:
        for path in ("/pause", "/resume", "/reset_prefix_cache", "/abort_requests"):
            async with http.post(f"{url}{path}") as resp:
                assert resp.status == 404, path


@pytest.mark.parametrize(
    ("flavor", "expected"),
    [
        (
            "sglang",
            {
                "sglang:token_usage": "gauge",
                "sglang:num_retracted_requests": "counter",
                "sglang:max_total_num_tokens": "gauge",
                "sglang:num_queue_reqs": "gauge",
            },
        ),
        (
            "llamacpp",
            {
                "llamacpp:prompt_tokens": "counter",
                "llamacpp:tokens_predicted": "counter",
                "llamacpp:requests_processing": "gauge",
                "llamacpp:requests_deferred": "gauge",
            },
        ),
    ],
)
async def test_other_flavors_use_their_engines_names(sim_engine, flavor, expected):
    """--flavor sglang / llamacpp expose the same model under those engines' names."""
    url = await sim_engine(
        flavor=flavor, kv_capacity_tokens=4096, max_num_seqs=4, max_model_len=1024
    )
    async with aiohttp.ClientSession() as http:
        await complete(http, url, 50, 10)
        async with http.get(f"{url}/metrics") as resp:
            families = {f.name: f.type for f in text_string_to_metric_families(await resp.text())}
    assert expected.items() <= families.items()
    assert not any(name.startswith("vllm:") for name in families)


async def test_llamacpp_slots_and_props(sim_engine):
    """llama.cpp flavor: /props gives slots and n_ctx; /slots shows a busy slot's tokens."""
    url = await sim_engine(
        flavor="llamacpp",
        kv_capacity_tokens=4096,
        max_num_seqs=4,
        max_model_len=1024,
        per_token_s=0.0005,
    )
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/props") as resp:
            props = await resp.json()
        assert props["total_slots"] == 4
        assert (
            props["default_generation_settings"]["n_ctx"] == 1020
        )  # 4,080 usable tokens / 4 slots
        inflight = asyncio.ensure_future(complete(http, url, 300, 200))

        async def busy() -> bool:
            async with http.get(f"{url}/slots") as resp:
                slots = await resp.json()
            return any(s["is_processing"] and s["next_token"][0]["n_decoded"] > 0 for s in slots)

        await until(busy)
        async with http.get(f"{url}/slots") as resp:
            slot = (await resp.json())[0]
        assert slot["n_prompt_tokens"] == 300
        async with http.post(f"{url}/slots/0", params={"action": "erase"}) as resp:
            assert resp.status == 400  # busy slots cannot be erased
        async with http.post(f"{url}/slots/3", params={"action": "erase"}) as resp:
            assert resp.status == 200
        await inflight


async def test_sglang_flush_cache_refused_while_requests_run(sim_engine):
    """SGLang's /flush_cache is refused while requests run and accepted when idle."""
    url = await sim_engine(flavor="sglang", kv_capacity_tokens=8192, per_token_s=0.0005)
    async with aiohttp.ClientSession() as http:
        inflight = asyncio.ensure_future(complete(http, url, 100, 300))

        async def running() -> bool:
            return value(await scrape(url), "sglang:num_running_reqs") > 0

        await until(running)
        async with http.post(f"{url}/flush_cache") as resp:
            assert resp.status == 400
        await inflight
        async with http.post(f"{url}/flush_cache") as resp:
            assert resp.status == 200


async def _running(url: str) -> bool:
    return value(await scrape(url), "vllm:num_requests_running") > 0


async def test_true_output_length_ends_with_stop(sim_engine):
    """kvguard_sim_output_tokens below max_tokens ends the request there with "stop"."""
    url = await sim_engine(kv_capacity_tokens=8192)
    async with aiohttp.ClientSession() as http:
        status, body = await complete(http, url, 20, 500, kvguard_sim_output_tokens=7)
        assert status == 200
        assert body["choices"][0]["finish_reason"] == "stop"
        assert len(body["choices"][0]["text"].split()) == 7
        assert body["usage"] == {"prompt_tokens": 20, "completion_tokens": 7, "total_tokens": 27}
        # At or past max_tokens the request ends at max_tokens, as without the field.
        status, body = await complete(http, url, 20, 5, kvguard_sim_output_tokens=9)
        assert (body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"]) == (
            "length",
            5,
        )
        chat = {
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 300,
            "kvguard_sim_output_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with http.post(f"{url}/v1/chat/completions", json=chat) as resp:
            lines = [line.decode().strip() async for line in resp.content if line.strip()]
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    tokens = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(tokens) == 3
    assert tokens[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    samples = await scrape(url)
    assert value(samples, "vllm:request_success_total", finished_reason="stop") == 2
    assert value(samples, "vllm:request_success_total", finished_reason="length") == 1
    assert value(samples, "vllm:generation_tokens_total") == 7 + 5 + 3
    # The engine was asked for the clients' max_tokens, whatever the true lengths.
    assert value(samples, "vllm:request_params_max_tokens_sum") == 500 + 5 + 300


@pytest.mark.parametrize("bad", [0, -3, "7", 2.5, True, [7]])
async def test_bad_sim_output_tokens_is_400(sim_engine, bad):
    """kvguard_sim_output_tokens must be an integer >= 1: anything else is a 400 naming it."""
    url = await sim_engine()
    async with aiohttp.ClientSession() as http:
        status, body = await complete(http, url, 5, 10, kvguard_sim_output_tokens=bad)
    assert status == 400
    assert body["message"] == f"kvguard_sim_output_tokens must be an integer >= 1, got {bad!r}"


async def test_priority_needs_the_priority_policy(sim_engine):
    """Under fcfs a non-zero priority is vLLM's 400; zero is accepted; a non-integer is a 400."""
    url = await sim_engine()
    async with aiohttp.ClientSession() as http:
        status, body = await complete(http, url, 5, 2, priority=3)
        assert status == 400
        assert body["message"] == "Got priority 3 but Priority scheduling is not enabled."
        status, _ = await complete(http, url, 5, 2, priority=0)
        assert status == 200
    url = await sim_engine(scheduling_policy="priority")
    async with aiohttp.ClientSession() as http:
        status, _ = await complete(http, url, 5, 2, priority=-4)
        assert status == 200
        status, body = await complete(http, url, 5, 2, priority="high")
        assert status == 400
        assert body["message"] == "priority must be an integer, got 'high'"
        async with http.get(f"{url}/server_info") as resp:
            assert (await resp.json())["scheduling_policy"] == "priority"


async def test_priority_request_queued_behind_others_is_served_first(sim_server):
    """One seat: a high-priority request queued after low-priority ones runs next."""
    server = await sim_server(kv_capacity_tokens=8192, max_num_seqs=1, scheduling_policy="priority")
    url, finished = server.url, []
    async with aiohttp.ClientSession() as http:

        async def send(name: str, max_tokens: int, priority: int) -> None:
            status, _ = await complete(http, url, 10, max_tokens, priority=priority)
            assert status == 200
            finished.append(name)

        tasks = [asyncio.ensure_future(send("blocker", 20, 0))]
        await until(lambda: _running(url))
        # Freeze the engine so the queue fills in a known order, whatever the timing.
        async with http.post(f"{url}/pause", params={"mode": "keep"}):
            pass
        tasks += [asyncio.ensure_future(send(f"low-{i}", 3, 10)) for i in range(3)]
        await until(lambda: len(server.engine.scheduler.waiting) == 3)
        tasks.append(asyncio.ensure_future(send("high", 3, -1)))
        await until(lambda: len(server.engine.scheduler.waiting) == 4)
        async with http.post(f"{url}/resume"):
            pass
        await asyncio.gather(*tasks)
    assert finished == ["blocker", "high", "low-0", "low-1", "low-2"]


@pytest.mark.parametrize(
    ("policy", "first_priority", "done_first"),
    [
        ("fcfs", 0, "first"),
        ("priority", 5, "second"),
    ],
)
async def test_exhaustion_preempts_by_policy(sim_server, policy, first_priority, done_first):
    """Two sequences that outgrow the pool: fcfs preempts the newer, priority the lower."""
    server = await sim_server(kv_capacity_tokens=1024, max_model_len=1000, scheduling_policy=policy)
    url, finished = server.url, []
    async with aiohttp.ClientSession() as http:

        async def send(name: str, priority: int) -> None:
            status, body = await complete(http, url, 300, 300, priority=priority)
            assert (status, body["usage"]["completion_tokens"]) == (200, 300)
            finished.append(name)

        first = asyncio.ensure_future(send("first", first_priority))
        await until(lambda: _running(url))
        second = asyncio.ensure_future(send("second", 0))
        await asyncio.gather(first, second)
    assert finished[0] == done_first
    assert value(await scrape(url), "vllm:num_preemptions_total") > 0


async def test_oom_mode_admission_waits_for_room(sim_server):
    """--oom-on-exhaust: prompts that do not fit wait at admission; no crash if growth fits."""
    server = await sim_server(kv_capacity_tokens=2048, max_model_len=1024, oom_on_exhaust=True)
    url = server.url
    async with aiohttp.ClientSession() as http:
        # All six queue before the first step: 500-token prompts into 127 blocks, so
        # three are admitted (32 blocks each) and the fourth's 32 blocks do not fit.
        async with http.post(f"{url}/pause", params={"mode": "keep"}):
            pass
        burst = asyncio.gather(
            *(complete(http, url, 500, 400, kvguard_sim_output_tokens=10) for _ in range(6))
        )
        await until(lambda: len(server.engine.scheduler.waiting) == 6)
        async with http.post(f"{url}/resume"):
            pass
        # Each stops after 10 tokens, so the growth of the running three always fits.
        results = await burst
    assert [status for status, _ in results] == [200] * 6
    assert {body["choices"][0]["finish_reason"] for _, body in results} == {"stop"}
    assert server.engine.alive
    assert not server.crashed.is_set()
    # An engine that cannot preempt shows no preemption counter (kvguard reads it so).
    assert "vllm:num_preemptions_total" not in await scrape(url)
