"""Bad input, fuzzed with hypothesis, bounded in examples so the file runs in well under a minute.

- Exposition text (real captured fixtures, mutated, and junk) into every engine adapter:
  a result or :class:`ProbeError`, never another exception.
- TOML configs (schema-shaped and mutated text) into the loader: a config or one
  :class:`ConfigError` whose every problem names its field, never a traceback.
- Request bodies and headers into the proxy, in front of a recording upstream: never
  a 5xx from the proxy itself, and nothing malformed reaches the upstream.
- ``/admission`` and ``/control/*`` inputs: never a 5xx, never a control action
  without the token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvguard.actuators.mitigations import Mitigations
from kvguard.actuators.proxy import MAX_TOKENS_LIMIT, AdmissionProxy, ProxySettings
from kvguard.api.app import build_app
from kvguard.config.secrets import CONTROL_TOKEN_ENV
from kvguard.config.settings import _SCHEMA, load_config, parse_config
from kvguard.core.snapshot import EngineStats
from kvguard.errors import ConfigError, ProbeError
from kvguard.probes.engine import EngineProbe
from kvguard.probes.engines import ADAPTERS, EngineScrape
from kvguard.runtime.daemon import Daemon
from kvguard.runtime.probing import Probes

FIXTURES = Path(__file__).parents[1] / "fixtures" / "engines"
EXAMPLE = Path(__file__).parents[2] / "systemd" / "kvguard.toml"
TOKEN = "fuzz-control-token-0123456789"
# Bounded: examples, not time, so a slow CI machine runs the same inputs, only slower.
PURE = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)
SERVED = settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)

# ---------------------------------------------------------------------- engine adapters
METRIC_TEXTS = [p.read_text() for p in sorted(FIXTURES.glob("*.txt"))]
JSON_BODIES = [json.loads(p.read_text()) for p in sorted(FIXTURES.glob("*.json"))]
EXPOSITION_CHARS = st.sampled_from(
    [*'abcdefghijklmnopqrstuvwxyz_:{}="#, \n\t.0123456789-+eEInfNa\\', "\x00", "é", "\r"]
)


@st.composite
def mutated_exposition(draw: st.DrawFn) -> str:
    """A real engine's /metrics text, cut, spliced or with a value replaced; or junk."""
    kind = draw(st.sampled_from(["truncate", "insert", "value", "junk", "lines"]))
    text = draw(st.sampled_from(METRIC_TEXTS))
    if kind == "truncate":
        return text[: draw(st.integers(0, len(text)))]
    if kind == "insert":
        at = draw(st.integers(0, len(text)))
        return text[:at] + draw(st.text(EXPOSITION_CHARS, max_size=40)) + text[at:]
    if kind == "value":
        lines = text.splitlines()
        index = draw(st.integers(0, len(lines) - 1))
        name = lines[index].rsplit(" ", 1)[0]
        value = draw(
            st.one_of(
                st.sampled_from(["NaN", "+Inf", "-Inf", "1e999", "-1", "0x10", "", "None"]),
                st.floats(allow_nan=True).map(repr),
                st.text(EXPOSITION_CHARS, max_size=10),
            )
        )
        lines[index] = f"{name} {value}"
        return "\n".join(lines)
    if kind == "lines":
        lines = text.splitlines()
        return "\n".join(draw(st.lists(st.sampled_from(lines), max_size=30)))
    return draw(st.text(EXPOSITION_CHARS, max_size=300))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)


@st.composite
def slot_lists(draw: st.DrawFn) -> Any:
    """llama.cpp /slots and /props bodies: real ones with fields replaced, or any JSON."""
    if draw(st.booleans()):
        return draw(json_values)
    body = json.loads(json.dumps(draw(st.sampled_from(JSON_BODIES))))
    rows = body if isinstance(body, list) else [body]
    for row in rows:
        if isinstance(row, dict) and row and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(row)))
            row[key] = draw(json_values)
    return body


@PURE
@given(
    kind=st.sampled_from(sorted(ADAPTERS)),
    text=mutated_exposition(),
    slots=slot_lists(),
    props=slot_lists(),
    healthy=st.booleans(),
)
def test_adapters_return_stats_or_a_probe_error(kind, text, slots, props, healthy):
    """Any exposition text (and llama.cpp JSON) gives EngineStats or ProbeError, nothing else."""
    # As the probe hands them over (kvguard/probes/engine.py): a list of objects, an object.
    listed = isinstance(slots, list) and all(isinstance(item, dict) for item in slots)
    scrape = EngineScrape(
        text,
        slots=slots if listed else None,
        props=props if isinstance(props, dict) else None,
        healthy=healthy,
    )
    try:
        stats = ADAPTERS[kind].parse(scrape)
    except ProbeError:
        return  # the project's own error, with its message: what the daemon expects
    assert isinstance(stats, EngineStats)
    for name in ("kv_cache_usage_ratio", "kv_capacity_tokens", "kv_used_tokens"):
        value = getattr(stats, name)
        assert value is None or math.isfinite(value), (name, value)


# ---------------------------------------------------------------------- config loader
toml_scalars = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=20),
    st.sampled_from(["80GiB", "1e3", "http://127.0.0.1:8000", "127.0.0.1:9108", "/", "auto"]),
)
toml_values = st.one_of(
    toml_scalars,
    st.lists(toml_scalars, max_size=4),
    st.dictionaries(st.text(min_size=1, max_size=8), toml_scalars, max_size=3),
)
SECTIONS = sorted(_SCHEMA)


@st.composite
def config_tables(draw: st.DrawFn) -> dict[str, Any]:
    """Schema-shaped tables: known and unknown sections and keys, values of any TOML type."""
    data: dict[str, Any] = {}
    for _ in range(draw(st.integers(0, 5))):
        section = draw(st.sampled_from([*SECTIONS, "nonsense"]))
        keys = sorted(_SCHEMA.get(section, {})) or ["x"]
        body = {
            draw(st.sampled_from([*keys, "typo_key"])): draw(toml_values)
            for _ in range(draw(st.integers(0, 4)))
        }
        top, _, sub = section.partition(".")
        if sub:
            data.setdefault(top, {})
            if isinstance(data[top], dict):
                data[top][sub] = body
        else:
            data[top] = body if draw(st.integers(0, 9)) else draw(toml_scalars)
    if draw(st.booleans()):
        engine = data.setdefault("engine", {})
        if isinstance(engine, dict):
            engine.setdefault("url", "http://127.0.0.1:8000")
    return data


def _problems_name_fields(err: ConfigError) -> None:
    assert err.problems
    for field, _value, allowed in err.problems:
        assert isinstance(field, str)
        assert field.strip()
        assert isinstance(allowed, str)
        assert allowed.strip()
    assert "Traceback" not in str(err)


@PURE
@given(data=config_tables())
def test_config_tables_give_a_config_or_errors_naming_fields(data):
    """parse_config never raises anything but ConfigError, and every problem names a field."""
    try:
        parse_config(data, env={})
    except ConfigError as err:
        _problems_name_fields(err)


def _toml(value: Any) -> str:
    """A tiny TOML writer for the fuzzer (strings via JSON escapes, which TOML shares)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return (
            "nan"
            if math.isnan(value)
            else ("inf" if value > 0 else "-inf")
            if math.isinf(value)
            else repr(value)
        )
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + "}"


def _document(data: dict[str, Any]) -> str:
    lines: list[str] = []
    for section, body in data.items():
        if not isinstance(body, dict):
            lines.append(f"{json.dumps(section)} = {_toml(body)}")
            continue
        lines.append(f"[{json.dumps(section)}]")
        lines += [f"{json.dumps(k)} = {_toml(v)}" for k, v in body.items()]
    return "\n".join(lines) + "\n"


@st.composite
def config_documents(draw: st.DrawFn) -> bytes:
    """TOML files: generated documents, or the shipped example cut or spliced; bytes."""
    kind = draw(st.sampled_from(["generated", "truncated", "spliced", "bytes"]))
    example = EXAMPLE.read_text()
    if kind == "generated":
        return _document(draw(config_tables())).encode("utf-8", "surrogatepass")
    if kind == "truncated":
        return example[: draw(st.integers(0, len(example)))].encode()
    if kind == "spliced":
        at = draw(st.integers(0, len(example)))
        return (example[:at] + draw(st.text(max_size=30)) + example[at:]).encode(
            "utf-8", "surrogatepass"
        )
    return draw(st.binary(max_size=200))


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory) -> Path:
    """One folder for every fuzzed config file (each example overwrites it)."""
    return tmp_path_factory.mktemp("fuzz-config")


@PURE
@given(document=config_documents())
def test_config_files_give_a_config_or_errors_naming_fields(config_dir, document):
    """load_config on any bytes: a Config or a ConfigError naming fields, never a traceback."""
    path = config_dir / "kvguard.toml"
    path.write_bytes(document)
    try:
        load_config(str(path), env={})
    except ConfigError as err:
        _problems_name_fields(err)


# ---------------------------------------------------------------------- served: proxy, API
class Served:
    """An event loop with servers on 127.0.0.1, driven from a synchronous hypothesis test."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.runners: list[web.AppRunner] = []
        self.http: aiohttp.ClientSession | None = None

    def run(self, coro: Any) -> Any:
        """Run ``coro`` on this loop, bounded: a hang is a failure, not a stuck CI job."""
        return self.loop.run_until_complete(asyncio.wait_for(coro, 30))

    def serve(self, app: web.Application) -> str:
        """Serve ``app`` on a free loopback port; its base URL."""

        async def start() -> str:
            runner = web.AppRunner(app, handler_cancellation=True)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            self.runners.append(runner)
            return f"http://127.0.0.1:{runner.addresses[0][1]}"

        return str(self.run(start()))

    def session(self) -> aiohttp.ClientSession:
        """A client session on this loop (made once)."""
        if self.http is None:

            async def make() -> aiohttp.ClientSession:
                return aiohttp.ClientSession()

            self.http = self.run(make())
        return self.http

    def close(self) -> None:
        """Stop every server and the loop."""

        async def stop() -> None:
            if self.http is not None:
                await self.http.close()
            for runner in reversed(self.runners):
                await runner.cleanup()

        self.run(stop())
        self.loop.close()


@pytest.fixture
def served() -> Iterator[Served]:
    """Servers on 127.0.0.1 in an event loop of their own (hypothesis tests are synchronous)."""
    box = Served()
    yield box
    box.close()


def _recorder(seen: list[dict[str, Any]]) -> web.Application:
    async def record(request: web.Request) -> web.Response:
        if request.path == "/tokenize":
            return web.json_response({"error": "none"}, status=404)  # estimate from now on
        seen.append({"path": request.path, "body": await request.read()})
        return web.json_response({"usage": {"completion_tokens": 1}})

    app = web.Application(client_max_size=2**24)
    app.router.add_route("*", "/{tail:.*}", record)
    return app


def _strict_json(body: bytes) -> Any:
    """``body`` as strict JSON in UTF-8 whose every string encodes: what may be forwarded."""

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} forwarded")

    payload = json.loads(body.decode("utf-8"), parse_constant=refuse)
    # A lone surrogate or a number no double holds (parsed as inf) fails here.
    json.dumps(payload, ensure_ascii=False, allow_nan=False).encode("utf-8")
    return payload


# Text no UTF-8 encoder writes: lone surrogates, alone or among ordinary characters.
UNPAIRED = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1)
# Numbers at and past what a double holds, as JSON literals; the last five are no JSON
# a strict parser (or kvguard) accepts: NaN and Infinity, or too large for a double.
EXTREME_NUMBERS = ["1e308", "-1.7976931348623157e308", "-0.0", "5e-324", "0e0", "1E+2"]
UNDOUBLED_NUMBERS = ["NaN", "-Infinity", "1e999", "-1e400", "1" + "0" * 400 + ".5"]


max_tokens_values = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.booleans(),
    st.none(),
    st.lists(st.integers(), max_size=2),
)


@st.composite
def generation_bodies(draw: st.DrawFn) -> bytes:
    """Bodies for /v1/completions: plausible ones with odd fields, broken JSON, junk bytes."""
    kind = draw(
        st.sampled_from(
            ["json", "json", "text", "bytes", "deep", "constant", "surrogate", "number", "junk"]
        )
    )
    if kind == "json":
        body: dict[str, Any] = {}
        if draw(st.booleans()):
            body["prompt"] = draw(st.one_of(st.text(max_size=50), json_values))
        if draw(st.booleans()):
            body["messages"] = draw(json_values)
        for key in ("max_tokens", "max_completion_tokens"):
            if draw(st.booleans()):
                body[key] = draw(max_tokens_values)
        if draw(st.booleans()):
            body[draw(st.text(max_size=8))] = draw(json_values)
        top = draw(st.sampled_from(["object", "object", "list", "scalar"]))
        shaped: Any = body if top == "object" else [body] if top == "list" else draw(json_values)
        return json.dumps(shaped).encode("utf-8", "surrogatepass")
    if kind == "text":
        return draw(st.text(max_size=80)).encode("utf-8", "surrogatepass")
    if kind == "deep":
        depth = draw(st.integers(100, 50_000))
        return b"[" * depth + b"]" * draw(st.sampled_from([0, depth]))
    if kind == "constant":
        value = draw(st.sampled_from(["NaN", "Infinity", "-Infinity"]))
        return f'{{"prompt": "x", "max_tokens": 5, "temperature": {value}}}'.encode()
    if kind == "surrogate":
        return draw(surrogate_bodies())
    if kind == "number":
        value = draw(st.sampled_from(EXTREME_NUMBERS + UNDOUBLED_NUMBERS))
        field = draw(st.sampled_from(["temperature", "top_p", "max_tokens", "seed", "x"]))
        return f'{{"prompt": "x", "max_tokens": 500, "{field}": {value}}}'.encode()
    if kind == "junk":  # random bytes inside an otherwise sound body
        junk = draw(st.binary(min_size=1, max_size=40))
        return b'{"prompt": "' + junk + b'", "max_tokens": 5}'
    return draw(st.binary(max_size=120))


@st.composite
def surrogate_bodies(draw: st.DrawFn) -> bytes:
    r"""A sound body with a lone surrogate in its prompt, a message, a key or a value.

    Escaped (``"\udfff"``, what json.dumps writes) or as the raw bytes a careless
    encoder writes (``surrogatepass``): both are text no engine can take.
    """
    bad = draw(
        st.builds(lambda a, b, c: a + b + c, st.text(max_size=5), UNPAIRED, st.text(max_size=5))
    )
    where = draw(st.sampled_from(["prompt", "batch", "message", "key", "stop"]))
    body: dict[str, Any] = {"prompt": "x", "max_tokens": 5}
    if where == "prompt":
        body["prompt"] = bad
    elif where == "batch":
        body["prompt"] = ["fine", bad]
    elif where == "message":
        body = {"messages": [{"role": "user", "content": bad}], "max_tokens": 5}
    elif where == "key":
        body[bad] = 1
    else:
        body["stop"] = [bad]
    if draw(st.booleans()):
        return json.dumps(body).encode()  # escaped: \udfff
    return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")


HEADER_NAME = st.text(
    st.sampled_from("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-"),
    min_size=1,
    max_size=12,
)
HEADER_VALUE = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0x2FF, exclude_characters="\x7f"),
    max_size=30,
)
proxy_headers = st.dictionaries(
    st.one_of(HEADER_NAME, st.sampled_from(["X-Priority", "Connection", "Host", "Keep-Alive"])),
    HEADER_VALUE,
    max_size=4,
)
OUR_REFUSALS = {
    "invalid_body",
    "bad_header",
    "bad_path",
    "bad_target",
    "method_not_allowed",
    "path_blocked",
    "path_not_allowed",
    "kv_window_exceeded",
    "request_too_large",
    "kv_cache_pressure",
    "kv_pool_full",
}


def test_proxy_forwards_nothing_malformed(served):
    """Any body and headers: never a 5xx of the proxy's own; what reaches the upstream is sound."""
    seen: list[dict[str, Any]] = []
    upstream = served.serve(_recorder(seen))
    mitigations = Mitigations(max_prompt_tokens=4000, max_tokens=256)
    proxy = AdmissionProxy(ProxySettings(upstream=upstream, max_body_bytes=64 * 1024), mitigations)
    front = served.serve(proxy.app())
    http = served.session()

    async def send(path: str, body: bytes, headers: dict[str, str]) -> tuple[int, Any]:
        async with http.post(f"{front}{path}", data=body, headers=headers) as resp:
            text = await resp.text()
            try:
                return resp.status, json.loads(text)
            except ValueError:
                return resp.status, text

    @SERVED
    @given(
        path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
        body=generation_bodies(),
        headers=proxy_headers,
    )
    def one(path: str, body: bytes, headers: dict[str, str]) -> None:
        before = len(seen)
        status, answer = served.run(send(path, body, headers))
        forwarded = seen[before:]
        assert status < 500, (status, answer)
        if status != 200:
            assert isinstance(answer, dict), answer
            assert answer["error"]["code"] in OUR_REFUSALS, answer
            assert forwarded == [], "a refused request reached the upstream"
            return
        assert len(forwarded) == 1
        sent = forwarded[0]["body"]
        if not sent:
            return
        payload = _strict_json(sent)
        assert isinstance(payload, dict)
        for key in ("max_tokens", "max_completion_tokens"):
            value = payload.get(key)
            assert value is None or (
                isinstance(value, int)
                and not isinstance(value, bool)
                and 1 <= value <= MAX_TOKENS_LIMIT
            ), payload
        # The window cap (256) holds for the field the engine reads.
        chat_key = "max_completion_tokens" in payload and path == "/v1/chat/completions"
        assert payload["max_completion_tokens" if chat_key else "max_tokens"] <= 256

    one()


def test_unencodable_text_and_numbers_no_double_holds_are_refused(served):
    """A lone surrogate anywhere, NaN, Infinity or a number past a double: 400, never 500.

    Extreme doubles (1e308, -0.0, the smallest subnormal) pass, as strict JSON, even
    when a cap rewrites the body. Random bytes inside a string: 400 unless they are
    UTF-8 text.
    """
    seen: list[dict[str, Any]] = []
    upstream = served.serve(_recorder(seen))
    proxy = AdmissionProxy(ProxySettings(upstream=upstream), Mitigations(max_tokens=16))
    front = served.serve(proxy.app())
    http = served.session()

    async def send(path: str, body: bytes) -> tuple[int, Any]:
        async with http.post(f"{front}{path}", data=body) as resp:
            return resp.status, await resp.json()

    @SERVED
    @given(
        body=st.one_of(
            surrogate_bodies(),
            st.builds(
                lambda n: f'{{"prompt": "x", "max_tokens": 500, "temperature": {n}}}'.encode(),
                st.sampled_from(EXTREME_NUMBERS + UNDOUBLED_NUMBERS),
            ),
            st.builds(
                lambda junk: b'{"prompt": "' + junk + b'", "max_tokens": 5}',
                st.binary(min_size=1, max_size=40).filter(
                    lambda b: b'"' not in b and b"\\" not in b
                ),
            ),
        )
    )
    def one(body: bytes) -> None:
        path = "/v1/chat/completions" if b'"messages"' in body else "/v1/completions"
        before = len(seen)
        status, answer = served.run(send(path, body))
        forwarded = seen[before:]
        try:
            _strict_json(body)  # raw control characters in a string fail it too
            sound = True
        except (ValueError, AssertionError):
            sound = False
        if sound:
            assert status == 200, (body, answer)
            assert _strict_json(forwarded[0]["body"])["max_tokens"] <= 16
        else:
            assert status == 400, (body, answer)
            assert answer["error"]["code"] == "invalid_body"
            assert forwarded == []

    one()


PATH_TEXT = st.text(
    st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="#?"), max_size=20
)


PATH_SEGMENT = st.one_of(
    st.sampled_from([".", "..", "%2e", "%2E%2e", ".%2e", "v1", "models", "Pause", "%2f", "\\"]),
    PATH_TEXT,
)


async def _raw_status(base: str, request: bytes) -> int:
    """Write ``request`` as bytes (no client normalises it); the answer's status code."""
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        head = await reader.readuntil(b"\r\n")
        await reader.read()  # Connection: close
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return int(head.split(b" ", 2)[1])


def test_proxy_paths_and_methods(served):
    """Odd methods and paths: a 4xx of ours or forwarded as a path on the upstream, never 5xx.

    Written raw to a socket: an HTTP client would resolve the dot segments before they
    ever reached kvguard, and the check on what is forwarded would prove nothing.
    """
    seen: list[dict[str, Any]] = []
    upstream = served.serve(_recorder(seen))
    proxy = AdmissionProxy(ProxySettings(upstream=upstream), Mitigations())
    front = served.serve(proxy.app())

    @SERVED
    @given(
        method=st.sampled_from(
            ["GET", "POST", "DELETE", "PATCH", "TRACE", "PROPFIND", "PURGE", "OPTIONS", "LOCK"]
        ),
        segments=st.lists(PATH_SEGMENT, max_size=5),
    )
    def one(method: str, segments: list[str]) -> None:
        before = len(seen)
        target = "/" + "/".join(segments)
        request = (
            f"{method} {target} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        status = served.run(_raw_status(front, request))
        assert status < 500
        forwarded = seen[before:]
        if status == 200:
            assert len(forwarded) == 1
            decoded = forwarded[0]["path"]
            assert all(part not in (".", "..") for part in decoded.split("/")), target
            assert "\\" not in decoded
        else:
            assert forwarded == []

    one()
    # Dot segments did reach kvguard, and it refused them itself.
    assert proxy.counters.rejected["bad_path"] > 0


def test_admission_and_control_inputs(served):
    """/admission answers 200 or 429; /control/* never acts without the token; never a 5xx."""
    daemon = Daemon(
        parse_config(
            {
                "engine": {"url": "http://127.0.0.1:1"},
                "proxy": {"api_key_priorities": {"sk-batch": "sheddable"}},
            },
            env={CONTROL_TOKEN_ENV: TOKEN},
        ),
        probes=Probes(engine=EngineProbe("http://127.0.0.1:1"), nvml=None, host=None),
    )
    daemon.mitigations.shed_floor = "sheddable"
    api = served.serve(build_app(daemon))
    http = served.session()

    async def send(method: str, path: str, headers: dict[str, str]) -> tuple[int, str]:
        async with http.request(method, f"{api}{path}", headers=headers) as resp:
            return resp.status, await resp.text()

    auth = st.one_of(
        HEADER_VALUE,
        st.builds(lambda t: f"Bearer {t}", HEADER_VALUE),
        st.sampled_from([f"Bearer {TOKEN[:-1]}", f"bearer  {TOKEN}x", "Bearer sk-batch"]),
    )

    @SERVED
    @given(
        method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD"]),
        path=st.one_of(
            st.sampled_from(["/admission", "/control", "/control/dry-run", "/control/release"]),
            st.builds(lambda p: f"/admission/{p}", PATH_TEXT),
            st.builds(lambda p: f"/control/{p}", PATH_TEXT),
        ),
        authorization=auth,
        priority=HEADER_VALUE,
    )
    def one(method: str, path: str, authorization: str, priority: str) -> None:
        headers = {"Authorization": authorization, "X-Priority": priority}
        try:
            status, text = served.run(send(method, path, headers))
        except (aiohttp.InvalidURL, ValueError):
            return
        assert status < 500, text
        if path.startswith("/control"):
            assert status in (401, 403, 404, 405), (status, text)
            assert daemon.mitigations.enforcing
            assert daemon.mitigations.shed_floor == "sheddable"
        elif method in ("GET", "POST"):
            assert status in (200, 429, 404), (status, text)

    one()
    served.run(daemon.close())
