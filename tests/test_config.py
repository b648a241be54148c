"""The TOML config: defaults, every problem at once, secrets kept out of sight."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import tomllib

from kvguard.config.model_files import BUNDLED_MODELS_DIR
from kvguard.config.secrets import CONTROL_TOKEN_ENV, TOKEN_ENV, Secret
from kvguard.config.settings import CONFIG_ENV, exposed_secrets, load_config, parse_config
from kvguard.errors import ConfigError, InvalidInputError

KVGUARD = str(Path(sys.executable).parent / "kvguard")
EXAMPLE = Path(__file__).parents[1] / "systemd" / "kvguard.toml"


def test_only_the_engine_url_is_required():
    """A one-line config gets every documented default."""
    config = parse_config({"engine": {"url": "http://127.0.0.1:8000/"}}, env={})
    assert config.engine.url == "http://127.0.0.1:8000"
    assert config.engine.kind == "auto"
    assert config.poll.interval_s == 0.5
    assert config.server.listen == "127.0.0.1:9108"
    assert (config.server.host, config.server.port) == ("127.0.0.1", 9108)
    assert config.model.config is None


def test_every_problem_is_reported_at_once():
    """Unknown keys, bad values and a missing url come back together, each named."""
    data = {
        "engine": {"kind": "vlm", "metrics_path": "metrics"},
        "model": {"tp": 0, "kv_cache_dtype": "fp6", "max_num_seq": 8},
        "poll": {"interval_s": -1},
        "server": {"listen": "9108"},
        "gpus": {},
    }
    with pytest.raises(ConfigError) as info:
        parse_config(data, source="k.toml", env={})
    fields = [field for field, _, _ in info.value.problems]
    assert fields == [
        "engine.kind",
        "engine.metrics_path",
        "model.tp",
        "model.kv_cache_dtype",
        "model.max_num_seq",
        "poll.interval_s",
        "server.listen",
        "gpus",
        "engine.url",
    ]
    lines = info.value.lines()
    assert "model.max_num_seq: unknown key (known in [model]: config, tp," in lines[4]
    assert lines[0].startswith(
        "engine.kind: must be one of auto, vllm, sglang, tgi, llamacpp, trtllm"
    )


@pytest.mark.parametrize(
    ("section", "values", "field"),
    [
        ("engine", {"url": "ftp://x"}, "engine.url"),
        ("engine", {"url": "http://[127.0.0.1:8000"}, "engine.url"),  # an unclosed IPv6 "["
        ("proxy", {"upstream": "http://[::1"}, "proxy.upstream"),
        ("engine", {"url": "http://127.0.0.1:8000", "pid": 1, "process_name": "x"}, "engine.pid"),
        ("gpu", {"indices": [0], "uuids": ["GPU-1"]}, "gpu.indices"),
        ("gpu", {"memory": "-3GiB"}, "gpu.memory"),
        ("gpu", {"indices": [0, "one"]}, "gpu.indices[1]"),
        ("poll", {"interval_s": 0.2, "min_interval_s": 0.5}, "poll.min_interval_s"),
        ("model", {"gpu_memory_utilization": 1.5}, "model.gpu_memory_utilization"),
        ("log", {"level": "loud"}, "log.level"),
        ("proxy", {"upstream_keepalive_s": -1}, "proxy.upstream_keepalive_s"),
    ],
)
def test_bad_values_name_their_field(section, values, field):
    """Each invalid value is reported under its dotted field name."""
    data = {"engine": {"url": "http://127.0.0.1:8000"}} | {section: values}
    if section == "engine":
        data = {"engine": values}
    with pytest.raises(ConfigError) as info:
        parse_config(data, env={})
    assert field in [f for f, _, _ in info.value.problems]


def test_token_from_file_relative_to_the_config(tmp_path):
    """token_file is read relative to the config file and held as a Secret."""
    (tmp_path / "token").write_text("s3cret\n")
    path = tmp_path / "kvguard.toml"
    path.write_text('[engine]\nurl = "http://127.0.0.1:8000"\ntoken_file = "token"\n')
    config = load_config(str(path), env={})
    assert config.engine.token == Secret("s3cret")
    assert "s3cret" not in repr(config)
    assert config.redacted()["engine"]["token"] == "***"
    assert "s3cret" not in str(config.redacted())


def test_token_from_environment_and_missing_file(tmp_path):
    """Without token_file the environment provides it; an unreadable file is a problem."""
    config = parse_config({"engine": {"url": "http://h:1"}}, env={TOKEN_ENV: "from-env"})
    assert config.engine.token is not None
    assert config.engine.token.reveal() == "from-env"
    with pytest.raises(ConfigError, match=r"engine\.token_file: must be a readable file"):
        parse_config(
            {"engine": {"url": "http://h:1", "token_file": str(tmp_path / "nope")}}, env={}
        )


def test_config_path_from_environment(tmp_path):
    """$KVGUARD_CONFIG names the file when --config is not given."""
    path = tmp_path / "k.toml"
    path.write_text('[engine]\nurl = "http://127.0.0.1:8000"\n')
    assert load_config(None, env={CONFIG_ENV: str(path)}).source == str(path)
    # No file named is a usage error (exit 2), not an invalid config (exit 1).
    with pytest.raises(InvalidInputError, match="--config"):
        load_config(None, env={})


def test_invalid_toml_is_one_problem(tmp_path):
    """A file that is not TOML says so, with the parser's position."""
    path = tmp_path / "k.toml"
    path.write_text("[engine\nurl = 1\n")
    with pytest.raises(ConfigError, match="must be valid TOML"):
        load_config(str(path), env={})


def test_the_shipped_example_is_valid_and_documents_every_key():
    """systemd/kvguard.toml parses, and names every key of the schema."""
    from kvguard.config.settings import _SCHEMA  # noqa: PLC0415 - the schema is private on purpose

    load_config(str(EXAMPLE), env={})
    text = EXAMPLE.read_text()
    for section, keys in _SCHEMA.items():
        assert f"[{section}]" in text
        for key in keys:
            documented = rf"^#? ?{key} = |^\[{re.escape(section)}\.{key}\]"
            assert re.search(documented, text, re.MULTILINE), f"{section}.{key}"


def test_check_config_cli_lists_every_problem(tmp_path):
    """`kvguard check-config` prints one line per problem and exits 1; OK prints the config."""
    bad = tmp_path / "bad.toml"
    bad.write_text('[engine]\nkind = "vlm"\n[poll]\ninterval_s = "fast"\n')
    result = subprocess.run(
        [KVGUARD, "check-config", str(bad)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 1  # an invalid config; 2 is a usage error
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 3
    assert all(line.startswith(f"kvguard check-config: error: {bad}: ") for line in lines)
    assert "Traceback" not in result.stderr
    ok = subprocess.run(
        [KVGUARD, "check-config", str(EXAMPLE)], capture_output=True, text=True, check=True
    )
    assert ok.stdout.startswith(f"# {EXAMPLE}: OK")


def test_check_config_output_reads_back_as_the_same_config(tmp_path):
    """The resolved TOML (and --json) use the file's keys: fed back, the same config."""
    source = tmp_path / "kvguard.toml"
    source.write_text(
        '[engine]\nurl = "http://127.0.0.1:8000"\n[model]\nconfig = "llama-3.1-8b"\n'
        '[gpu]\nmemory = "80GiB"\n[policy]\ndry_run = true\ndisabled_actions = ["evict"]\n'
        "[policy.high]\nkv_usage = 0.85\n[policy.cooldowns]\nshed = 7\n"
        '[forecast]\ngpu_reserve = "1GiB"\n[pattern]\nwindow_s = 20\n'
    )
    original = load_config(str(source), env={})
    for extra in ([], ["--json"]):
        done = subprocess.run(
            [KVGUARD, "check-config", str(source), *extra],
            capture_output=True,
            text=True,
            check=True,
        )
        data = json.loads(done.stdout) if extra else tomllib.loads(done.stdout)
        assert parse_config(data, source=str(source), env={}) == original
        assert data["gpu"]["memory"] == 80 * 1024**3  # the file's key, not memory_bytes
        assert data["policy"]["disabled_actions"] == ["evict"]
        assert data["policy"]["dry_run"] is True
        assert data["policy"]["cooldowns"]["shed"] == 7.0
        assert "dry_run" not in data  # no key the file would refuse
    echoed = tmp_path / "echoed.toml"
    echoed.write_text(
        subprocess.run(
            [KVGUARD, "check-config", str(source)], capture_output=True, text=True, check=True
        ).stdout
    )
    assert load_config(str(echoed), env={}) == replace(original, source=str(echoed))


def test_check_config_says_which_settings_it_left_out_and_they_read_back_once_copied(tmp_path):
    """Settings that may hold secrets are not printed: the header names them.

    Fed back as printed, they would read as their defaults (no webhooks, no restart
    command) without a word; with them copied from the source, the same config.
    """
    source = tmp_path / "kvguard.toml"
    secrets = (
        '[webhook]\nurls = ["https://hooks.example.com/T0/s3cr3t-path"]\n'
        '[reconfigure]\nmode = "command"\ncommand = ["/bin/true", "--token", "x"]\n'
    )
    source.write_text('[engine]\nurl = "http://127.0.0.1:8000"\n' + secrets)
    done = subprocess.run(
        [KVGUARD, "check-config", str(source)], capture_output=True, text=True, check=True
    )
    header = "".join(line for line in done.stdout.splitlines(keepends=True)[:3])
    assert "but for webhook.urls, reconfigure.command: left out" in header
    assert "reads\n# back as the same configuration once they are copied from" in header
    assert "s3cr3t" not in done.stdout
    assert "--token" not in done.stdout
    data = tomllib.loads(done.stdout)
    assert "urls" not in data["webhook"]
    assert "command" not in data["reconfigure"]
    data["webhook"]["urls"] = ["https://hooks.example.com/T0/s3cr3t-path"]
    data["reconfigure"]["command"] = ["/bin/true", "--token", "x"]
    original = load_config(str(source), env={})
    assert parse_config(data, source=str(source), env={}) == original


def test_check_config_reports_a_bad_model_beside_a_bad_url(tmp_path):
    """Every problem at once: a bad URL does not hide a model that cannot be budgeted."""
    path = tmp_path / "k.toml"
    path.write_text('[engine]\nurl = "not a url"\n[model]\nconfig = "no-such-model"\n')
    result = subprocess.run(
        [KVGUARD, "check-config", str(path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 1
    fields = [line.split(": ")[3] for line in result.stderr.splitlines()]
    assert fields == ["engine.url", "model.config"]


def test_check_config_validates_the_model_budget(tmp_path):
    """A model config that cannot be budgeted is a check-config problem too."""
    path = tmp_path / "k.toml"
    path.write_text(
        '[engine]\nurl = "http://127.0.0.1:8000"\n[model]\nconfig = "llama-3.1-8b"\ntp = 3\n'
    )
    result = subprocess.run(
        [KVGUARD, "check-config", str(path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 1
    assert (
        "model.tp: must divide num_attention_heads (32) evenly (model.config = 'llama-3.1-8b'),"
        " got 3" in result.stderr
    )


def test_check_config_refuses_an_engine_version_it_cannot_read(tmp_path):
    """[model] engine_version picks the vLLM rule; an unreadable one names the key."""
    path = tmp_path / "k.toml"
    path.write_text(
        '[engine]\nurl = "http://127.0.0.1:8000"\n[model]\nconfig = "llama-3.1-8b"\n'
        'engine_version = "latest"\n'
    )
    result = subprocess.run(
        [KVGUARD, "check-config", str(path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 1
    assert "model.engine_version: must be a vLLM version" in result.stderr


def test_the_daemon_budget_follows_the_configured_engine_version(tmp_path):
    """[model] engine_version reaches the budget; unset batch limits are vLLM's defaults."""
    from kvguard.runtime.budget_keeping import budget_for  # noqa: PLC0415 - the daemon's path

    def config(version: str) -> dict[str, object]:
        return {
            "engine": {"url": "http://127.0.0.1:8000"},
            "model": {"config": "llama-3.1-8b", "engine_version": version},
        }

    old = budget_for(parse_config(config("0.11")), 80 * 2**30)
    new = budget_for(parse_config(config("0.19")), 80 * 2**30)
    assert old is not None
    assert new is not None
    assert old.budget.engine_rule.startswith("vLLM 0.11")
    assert (new.budget.max_num_batched_tokens, new.budget.max_num_seqs) == (8192, 1024)
    # 0.11's sampler profile is heavier than 0.19's: a smaller pool on the same GPU.
    assert old.budget.kv_pool_bytes_per_gpu < new.budget.kv_pool_bytes_per_gpu


def check_config_errors(path: Path) -> tuple[list[str], str]:
    """Run the real ``kvguard check-config`` on ``path``: each error's field, and stderr.

    Asserts exit 1 (an invalid config) and one ``error`` line per problem, no traceback.
    """
    result = subprocess.run(
        [KVGUARD, "check-config", str(path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert all(line.startswith(f"kvguard check-config: error: {path}: ") for line in lines)
    return [line.split(": ")[3] for line in lines], result.stderr


@pytest.mark.parametrize(
    ("url", "fields"),
    [
        ("http://127.0.0.1:8000", ["model.tp", "model.max_model_len"]),
        ("not a url", ["engine.url", "model.tp", "model.max_model_len"]),
    ],
)
def test_check_config_a_bad_tp_does_not_hide_a_bad_max_model_len(tmp_path, url, fields):
    """The budget stops at its first error; check-config goes on to every [model] one.

    tp = 3 does not divide llama-3.1-8b's 32 heads and max_model_len = 999999 is past
    its context: both are reported, each under its own key, beside a bad URL too.
    """
    path = tmp_path / "k.toml"
    path.write_text(
        f'[engine]\nurl = "{url}"\n'
        '[model]\nconfig = "llama-3.1-8b"\ntp = 3\nmax_model_len = 999999\n'
    )
    found, stderr = check_config_errors(path)
    assert found == fields
    bundled = json.loads((BUNDLED_MODELS_DIR / "llama-3.1-8b" / "config.json").read_text())
    context = bundled["max_position_embeddings"]
    assert context < 999999
    assert (
        f"model.max_model_len: must be <= the model's context limit ({context:,}:"
        " max_position_embeddings); vLLM serves longer only with a rope scaling such as"
        " YaRN in the config (kvguard budget --hf-overrides adds one, as vLLM's flag does)"
        " (model.config = 'llama-3.1-8b'), got 999999"
    ) in stderr


def test_check_config_a_bad_max_model_len_does_not_hide_a_bad_model(tmp_path):
    """A [model] value refused on parsing left the model unchecked: now both are reported."""
    path = tmp_path / "k.toml"
    path.write_text(
        '[engine]\nurl = "not a url"\n[model]\nconfig = "no-such-model"\nmax_model_len = 0\n'
    )
    found, _ = check_config_errors(path)
    assert found == ["engine.url", "model.max_model_len", "model.config"]


def test_check_config_a_bad_weight_index_does_not_hide_the_model_settings(tmp_path):
    """A broken model.safetensors.index.json is reported, and [model] still checked."""
    model = tmp_path / "model"
    model.mkdir()
    config_json = BUNDLED_MODELS_DIR / "llama-3.1-8b" / "config.json"
    (model / "config.json").write_text(config_json.read_text())
    (model / "model.safetensors.index.json").write_text('{"metadata": {}}')
    path = tmp_path / "k.toml"
    path.write_text(
        f'[engine]\nurl = "not a url"\n[model]\nconfig = "{model}"\n'
        "tp = 3\nmax_model_len = 999999\n"
    )
    found, stderr = check_config_errors(path)
    assert found == ["engine.url", "model.config", "model.tp", "model.max_model_len"]
    assert "weight index has no positive integer metadata.total_size" in stderr


def test_a_token_with_control_characters_is_refused(tmp_path):
    """A token that cannot travel in an HTTP header is a config problem, not a crash later."""
    with pytest.raises(
        ConfigError, match="KVGUARD_ENGINE_TOKEN: must be one line of printable text"
    ):
        parse_config({"engine": {"url": "http://h:1"}}, env={TOKEN_ENV: "abc\ndef"})
    (tmp_path / "t").write_text("abc\x01def")
    with pytest.raises(ConfigError, match="must hold one line of printable text"):
        parse_config({"engine": {"url": "http://h:1", "token_file": str(tmp_path / "t")}}, env={})


def test_reconfigure_and_webhook_sections(tmp_path):
    """Required keys per mode; commands are argv lists; secrets and arguments stay hidden."""
    secret = tmp_path / "hook-secret"
    secret.write_text("s3cret-of-at-least-thirty-two-bytes\n")
    config = parse_config(
        {
            "engine": {"url": "http://127.0.0.1:8000"},
            "reconfigure": {"mode": "command", "command": ["kubectl", "--token=abc", "patch"]},
            "webhook": {"urls": ["https://hooks.example/x?token=abc"], "secret_file": str(secret)},
        },
        env={},
    )
    assert config.reconfigure.command == ("kubectl", "--token=abc", "patch")
    assert config.webhook.secret is not None
    assert config.webhook.secret.reveal() == "s3cret-of-at-least-thirty-two-bytes"
    shown = json.dumps(config.redacted())
    assert "abc" not in shown
    assert "s3cret" not in shown
    assert config.redacted()["reconfigure"]["command"] == ["kubectl", "<2 more arguments>"]
    with pytest.raises(ConfigError) as caught:
        parse_config(
            {
                "engine": {"url": "http://127.0.0.1:8000"},
                "reconfigure": {"mode": "systemd", "command": "restart-engine --now"},
                "webhook": {"secret_file": str(tmp_path / "missing")},
            },
            env={},
        )
    fields = {line.split(":")[0] for line in caught.value.lines()}
    assert {"reconfigure.systemd_unit", "reconfigure.command"} <= fields
    assert "webhook.secret_file" not in fields  # secrets are read once the rest is valid


def test_proxy_path_rules_and_their_errors():
    """allowed_paths / blocked_paths take "/"-prefixes; bad ones name the field and item."""
    config = parse_config(
        {
            "engine": {"url": "http://127.0.0.1:8000"},
            "proxy": {"allowed_paths": ["/v1/", "/health"], "blocked_paths": []},
        },
        env={},
    )
    assert config.proxy.allowed_paths == ("/v1", "/health")
    assert config.proxy.blocked_paths == ()
    assert (
        "/reset_prefix_cache"
        in parse_config({"engine": {"url": "http://127.0.0.1:8000"}}, env={}).proxy.blocked_paths
    )
    with pytest.raises(ConfigError) as err:
        parse_config(
            {
                "engine": {"url": "http://127.0.0.1:8000"},
                "proxy": {"allowed_paths": ["v1", "/a/../b", "/x?y"], "blocked_paths": "/pause"},
            },
            env={},
        )
    fields = [problem[0] for problem in err.value.problems]
    assert fields == ["proxy.allowed_paths[0]", "proxy.blocked_paths"]
    # allowed_paths adds to the engine's own routes: empty is the default, not an error.
    empty = parse_config(
        {"engine": {"url": "http://127.0.0.1:8000"}, "proxy": {"allowed_paths": []}}, env={}
    )
    assert empty.proxy.allowed_paths == ()


def test_blocked_paths_may_name_a_method_and_cover_the_engines_admin_endpoints():
    """A method-bound entry blocks one method; the defaults cover weight and LoRA endpoints."""
    config = parse_config(
        {
            "engine": {"url": "http://127.0.0.1:8000"},
            "proxy": {"blocked_paths": ["POST /props/", "/slots"], "trust_priority_header": False},
        },
        env={},
    )
    assert config.proxy.blocked_paths == ("POST /props", "/slots")
    assert config.proxy.trust_priority_header is False
    defaults = parse_config({"engine": {"url": "http://127.0.0.1:8000"}}, env={}).proxy
    assert defaults.trust_priority_header is True
    for path in (
        "/v1/load_lora_adapter",
        "/scale_elastic_ep",
        "/update_weights_from_tensor",
        "/init_weights_update_group",
        "/dump_expert_distribution_record",
        "/lora-adapters",
        "POST /props",
    ):
        assert path in defaults.blocked_paths, path
    with pytest.raises(ConfigError) as err:
        parse_config(
            {
                "engine": {"url": "http://127.0.0.1:8000"},
                "proxy": {"blocked_paths": ["post /props", "TRACE /x", "POST props"]},
            },
            env={},
        )
    fields = [problem[0] for problem in err.value.problems]
    assert fields == ["proxy.blocked_paths[0]"]  # the first bad item stops the list
    assert "POST /props" in str(err.value)


def test_webhook_urls_are_shown_as_scheme_host_and_port_only():
    """Path secrets (Slack, Teams, Discord), userinfo and queries never reach /status."""
    urls = [
        "https://hooks.slack.com/services/T0/B0/slack-path-secret",
        "http://user:pw@127.0.0.1:9/hook/a@b/discord-path-secret?key=q",
        "https://[::1]:8443/x",
    ]
    config = parse_config(
        {"engine": {"url": "http://127.0.0.1:8000"}, "webhook": {"urls": urls}}, env={}
    )
    assert config.redacted()["webhook"]["urls"] == [
        "https://hooks.slack.com",
        "http://127.0.0.1:9",
        "https://[::1]:8443",
    ]


def test_control_token_file_must_be_readable(tmp_path):
    """A missing control token file is a config error naming the key, not a silent 404."""
    with pytest.raises(ConfigError, match=r"server\.control_token_file"):
        parse_config(
            {
                "engine": {"url": "http://127.0.0.1:8000"},
                "server": {"control_token_file": "missing.token"},
            },
            source=str(tmp_path / "kvguard.toml"),
            env={},
        )


def test_every_setting_is_declared_once_on_its_field():
    """Each section's table is its dataclass's fields: a parser and a doc on each."""
    from dataclasses import fields, is_dataclass  # noqa: PLC0415

    from kvguard.config.schema import parsers, setting_of  # noqa: PLC0415
    from kvguard.config.settings import _SCHEMA, Config  # noqa: PLC0415 - private on purpose

    config = parse_config({"engine": {"url": "http://127.0.0.1:8000"}}, env={})
    sections = [
        getattr(config, spec.name)
        for spec in fields(Config)
        if is_dataclass(getattr(config, spec.name)) and parsers(type(getattr(config, spec.name)))
    ]
    assert [type(s).__name__ for s in sections] == [
        "EngineConfig",
        "ModelConfig",
        "GpuConfig",
        "PollConfig",
        "ServerConfig",
        "LogConfig",
        "ProxyConfig",
        "ReconfigureConfig",
        "WebhookConfig",
    ]
    for section in sections:
        for spec in fields(section):
            declared = setting_of(spec)
            assert declared is not None, f"{type(section).__name__}.{spec.name}"
            assert declared.doc.strip(), f"{type(section).__name__}.{spec.name}"
            if declared.parse is None:  # read from a file: a secret, never shown
                assert type(section).__name__ in ("EngineConfig", "ServerConfig", "WebhookConfig")
    assert _SCHEMA["gpu"] == parsers(type(config.gpu))
    assert "memory" in _SCHEMA["gpu"]
    assert _SCHEMA["pattern"].keys() == {"window_s"}
    assert list(_SCHEMA["policy"])[-1] == "dry_run"


def test_the_defaults_hold_when_their_keys_are_left_out():
    """A key left out takes its field's default; one given replaces it."""
    from kvguard.config.settings import Config, EngineConfig  # noqa: PLC0415
    from kvguard.core.pattern import DEFAULT_THRESHOLDS  # noqa: PLC0415

    config = parse_config({"engine": {"url": "http://127.0.0.1:8000"}}, env={})
    assert config == Config(engine=EngineConfig(url="http://127.0.0.1:8000"), source="<config>")
    assert config.pattern_window_s == DEFAULT_THRESHOLDS.window_s
    assert config.dry_run is False
    given = parse_config(
        {
            "engine": {"url": "http://127.0.0.1:8000"},
            "pattern": {"window_s": 20},
            "policy": {"dry_run": True, "hold_s": 5},
            "gpu": {"memory": "1GiB"},
        },
        env={},
    )
    assert (given.pattern_window_s, given.dry_run, given.policy.hold_s) == (20.0, True, 5.0)
    assert given.gpu.memory_bytes == 1024**3


def test_redacted_shows_each_field_once_secrets_hidden_api_keys_counted_last(tmp_path):
    """/status's view: the file's keys, secrets as ***, API keys as a count at the end."""
    (tmp_path / "token").write_text("0123456789abcdef0123\n")
    config = parse_config(
        {
            "engine": {"url": "http://127.0.0.1:8000", "token_file": "token"},
            "proxy": {"api_key_priorities": {"k": "critical"}, "allowed_paths": ["/v1"]},
            "pattern": {"window_s": 30},
        },
        source=str(tmp_path / "kvguard.toml"),
        env={},
    )
    shown = config.redacted()
    assert list(shown)[:2] == ["source", "engine"]
    # The file's tables and keys (what check-config writes), not the code's names.
    assert shown["policy"]["dry_run"] is False
    assert "dry_run" not in shown
    assert shown["gpu"]["memory"] is None
    assert "memory_bytes" not in shown["gpu"]
    assert shown["forecast"]["gpu_reserve"] == 512 * 1024**2
    assert "cooldowns" in shown["policy"]
    assert "disabled_actions" in shown["policy"]
    assert shown["engine"]["token"] == "***"
    assert shown["pattern"] == {"window_s": 30.0}
    assert list(shown["proxy"])[-1] == "api_key_priorities"
    assert shown["proxy"]["api_key_priorities"] == "1 keys"
    assert shown["proxy"]["allowed_paths"] == ["/v1"]
    assert "0123456789abcdef" not in json.dumps(shown)


def test_the_proxy_gets_every_proxy_setting_of_the_config():
    """make_proxy passes each [proxy] setting the proxy has; upstream defaults to the engine."""
    from dataclasses import fields  # noqa: PLC0415

    from kvguard.actuators.mitigations import Mitigations  # noqa: PLC0415
    from kvguard.actuators.proxy import ProxySettings  # noqa: PLC0415
    from kvguard.runtime.assembly import make_proxy  # noqa: PLC0415

    proxy = {
        "listen": "127.0.0.1:9001",
        "priority_header": "X-Class",
        "trust_priority_header": False,
        "default_priority": "sheddable",
        "api_key_priorities": {"k": "critical"},
        "max_body_bytes": 1024,
        "connect_timeout_s": 1.5,
        "read_timeout_s": 60,
        "upstream_keepalive_s": 0,
        "min_completion_tokens": 4,
        "admission": "projected",
        "admission_ratio": 0.5,
        "admission_wait_s": 1,
        "shed_ratio": 0.25,
        "shed_wait_s": 0.5,
        "allowed_paths": ["/v1"],
        "blocked_paths": ["/slots"],
    }
    engine = {"url": "http://127.0.0.1:8000"}
    config = parse_config({"engine": engine, "proxy": proxy}, env={})
    settings = make_proxy(config, Mitigations(), None).settings
    for spec in fields(ProxySettings):
        expected = (
            config.engine.url if spec.name == "upstream" else getattr(config.proxy, spec.name)
        )
        assert getattr(settings, spec.name) == expected, spec.name
    assert settings != ProxySettings(upstream=config.engine.url)
    proxy = {"upstream": "http://127.0.0.1:8001"}
    config = parse_config({"engine": engine, "proxy": proxy}, env={})
    assert make_proxy(config, Mitigations(), None).settings.upstream == "http://127.0.0.1:8001"


# ---------------------------------------------------------------- secret files
WEBHOOK_SECRET = "0123456789abcdef0123456789abcdef"  # 32 bytes: the least accepted
SECRET_FIELDS = ("engine.token_file", "server.control_token_file", "webhook.secret_file")


def write_secrets(folder: Path, modes: dict[str, int]) -> dict[str, object]:
    """The three secret files, with ``modes`` by field, and a config naming them."""
    contents = {
        "engine.token_file": ("engine.token", "engine-token-1234"),
        "server.control_token_file": ("control.token", "control-token-0123456789"),
        "webhook.secret_file": ("hook.secret", WEBHOOK_SECRET),
    }
    for field_name, (name, text) in contents.items():
        (folder / name).write_text(text + "\n")
        (folder / name).chmod(modes[field_name])
    return {
        "engine": {"url": "http://127.0.0.1:8000", "token_file": "engine.token"},
        "server": {"control_token_file": "control.token"},
        "webhook": {"secret_file": "hook.secret"},
    }


def test_a_webhook_secret_under_32_bytes_is_refused(tmp_path):
    """An 8-character secret names webhook.secret_file, the file and the minimum, not the secret."""
    (tmp_path / "hook.secret").write_text("8-chars!\n")
    data = {"engine": {"url": "http://127.0.0.1:8000"}, "webhook": {"secret_file": "hook.secret"}}
    with pytest.raises(ConfigError) as caught:
        parse_config(data, source=str(tmp_path / "kvguard.toml"), env={})
    assert caught.value.lines() == [
        "webhook.secret_file: must hold at least 32 bytes, not 8"
        " (e.g. `openssl rand -hex 32 > FILE`, 64 characters), got 'hook.secret'"
    ]
    assert "8-chars!" not in str(caught.value)
    (tmp_path / "hook.secret").write_text(WEBHOOK_SECRET + "\n")
    config = parse_config(data, source=str(tmp_path / "kvguard.toml"), env={})
    assert config.webhook.secret == Secret(WEBHOOK_SECRET)


@pytest.mark.parametrize(
    ("mode", "exposed"),
    [(0o600, False), (0o400, False), (0o640, True), (0o644, True)],
    ids=["0600", "0400", "0640", "0644"],
)
def test_secret_files_others_can_read_are_found(tmp_path, mode, exposed):
    """0640 and 0644 are readable by group or others: each such file is named, with its mode."""
    data = write_secrets(tmp_path, dict.fromkeys(SECRET_FIELDS, mode))
    config = parse_config(data, source=str(tmp_path / "kvguard.toml"), env={})
    found = exposed_secrets(config)
    if not exposed:
        assert found == []
        return
    assert [(f.field, f.name, f.mode) for f in found] == [
        ("engine.token_file", "engine.token", mode),
        ("server.control_token_file", "control.token", mode),
        ("webhook.secret_file", "hook.secret", mode),
    ]
    assert found[2].problem() == (
        "webhook.secret_file",
        "hook.secret",
        f"must be readable by its owner only, not mode {mode:04o} (`chmod 600` it, or `chmod 400`)",
    )


def test_strict_secrets_refuses_every_exposed_file_at_once(tmp_path):
    """With strict_secrets each file others may read is a problem; 0600 ones pass."""
    modes = {
        "engine.token_file": 0o644,
        "server.control_token_file": 0o600,
        "webhook.secret_file": 0o640,
    }
    data = write_secrets(tmp_path, modes)
    source = str(tmp_path / "kvguard.toml")
    assert parse_config(data, source=source, env={}).webhook.secret is not None  # a warning only
    with pytest.raises(ConfigError) as caught:
        parse_config(data, source=source, env={}, strict_secrets=True)
    assert [line.split(":")[0] for line in caught.value.lines()] == [
        "engine.token_file",
        "webhook.secret_file",
    ]
    assert "not mode 0644" in caught.value.lines()[0]
    assert "not mode 0640" in caught.value.lines()[1]
    for secret in ("engine-token-1234", WEBHOOK_SECRET):
        assert secret not in str(caught.value)
    for name in ("engine.token", "hook.secret"):
        (tmp_path / name).chmod(0o600)
    config = parse_config(data, source=source, env={}, strict_secrets=True)
    assert config.engine.token == Secret("engine-token-1234")


def test_strict_secrets_through_load_config_and_a_link(tmp_path):
    """load_config passes the flag; a link (as Kubernetes mounts secrets) is judged by its file."""
    real = tmp_path / "data" / "hook.secret"
    real.parent.mkdir()
    real.write_text(WEBHOOK_SECRET)
    real.chmod(0o600)
    (tmp_path / "hook.secret").symlink_to(real)  # the link itself is 0777
    path = tmp_path / "kvguard.toml"
    path.write_text(
        '[engine]\nurl = "http://127.0.0.1:8000"\n[webhook]\nsecret_file = "hook.secret"\n'
    )
    config = load_config(str(path), env={}, strict_secrets=True)
    assert exposed_secrets(config) == []
    real.chmod(0o644)
    with pytest.raises(ConfigError, match=r"webhook\.secret_file: must be readable by its owner"):
        load_config(str(path), env={}, strict_secrets=True)
    assert [f.mode for f in exposed_secrets(load_config(str(path), env={}))] == [0o644]


def test_secrets_from_the_environment_are_not_files(tmp_path):
    """Tokens from the environment have no mode to check: strict mode accepts them."""
    env = {TOKEN_ENV: "engine-token-1234", CONTROL_TOKEN_ENV: "control-token-0123456789"}
    config = parse_config(
        {"engine": {"url": "http://127.0.0.1:8000"}},
        source=str(tmp_path / "kvguard.toml"),
        env=env,
        strict_secrets=True,
    )
    assert config.engine.token == Secret("engine-token-1234")
    assert exposed_secrets(config) == []


def test_the_config_status_shows_goes_back_into_the_file():
    """/status's config, less what is unset or hidden, parses to the same configuration."""
    from kvguard.config.settings import HIDDEN_SETTINGS  # noqa: PLC0415 - one test

    config = parse_config(
        {
            "engine": {"url": "http://127.0.0.1:8000", "on_kv_exhaustion": "fail"},
            "gpu": {"memory": "24GiB"},
            "pattern": {"window_s": 30},
            "forecast": {"gpu_reserve": "1GiB", "window_s": 20},
            "policy": {
                "dry_run": True,
                "disabled_actions": ["kv_fp8"],
                "cooldowns": {"shed": 3},
                "high": {"kv_usage": 0.85},
            },
            "proxy": {"enabled": True, "admission_wait_s": 2},
        },
        env={},
    )
    shown = config.redacted()
    del shown["source"]
    tables = {
        name: {
            key: value
            for key, value in body.items()
            if value is not None and value != "***" and f"{name}.{key}" not in HIDDEN_SETTINGS
        }
        for name, body in shown.items()
    }
    again = parse_config(json.loads(json.dumps(tables)), env={})
    assert replace(again, source=config.source) == config


@pytest.mark.parametrize(
    ("api", "front", "clash"),
    [
        ("127.0.0.1:9555", "127.0.0.1:9555", True),
        ("0.0.0.0:9555", "127.0.0.1:9555", True),  # the wildcard takes every address
        ("localhost:9555", "127.0.0.1:9555", True),
        ("[::]:9555", "[::1]:9555", True),
        ("127.0.0.1:9555", "127.0.0.1:9556", False),
        ("127.0.0.1:9555", "10.0.0.5:9555", False),
    ],
)
def test_the_proxy_and_the_api_cannot_listen_on_one_socket(api, front, clash):
    """check-config names a clash kvguard run would only find binding the second port."""
    data = {
        "engine": {"url": "http://127.0.0.1:8000"},
        "server": {"listen": api},
        "proxy": {"enabled": True, "listen": front},
    }
    if not clash:
        parse_config(data, env={})
        return
    with pytest.raises(ConfigError, match=r"proxy\.listen.*must differ from \[server\] listen"):
        parse_config(data, env={})
    parse_config({**data, "proxy": {"enabled": False, "listen": front}}, env={})  # no proxy
