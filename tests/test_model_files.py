"""Finding a model's config: a file, a directory, a bundled name, or a Hugging Face id."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvguard.config.model_files import (
    BUNDLED_MODELS_DIR,
    INDEX_FILE,
    bundled_models,
    hf_hub_cache,
    load_model_files,
    merged_config,
)
from kvguard.errors import ModelConfigError


def test_bundled_names_resolve_and_carry_the_index():
    """A bundled name loads its config, and the index gives exact weight bytes."""
    files = load_model_files("llama-3.1-8b")
    assert files.config["num_hidden_layers"] == 32
    assert files.index_total_size == 16_060_522_496


def test_file_and_directory_paths(tmp_path):
    """A path to config.json and a directory holding it load the same config."""
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert load_model_files(str(tmp_path)).config == {"hidden_size": 8}
    assert load_model_files(str(tmp_path / "config.json")).config == {"hidden_size": 8}
    assert load_model_files(str(tmp_path)).index_total_size is None
    # The name to show when the config has no _name_or_path: the directory's.
    assert load_model_files(str(tmp_path)).name == tmp_path.name
    assert load_model_files(str(tmp_path / "config.json")).name == tmp_path.name


def test_every_bundled_model_is_listed():
    """Each directory under kvguard/models with a config.json is offered by name."""
    names = bundled_models()
    assert "llama-3.1-8b" in names
    assert len(names) == len(list(BUNDLED_MODELS_DIR.glob("*/config.json")))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[1, 2]", "JSON object"),
        ("{", "invalid JSON at line 1 column 2"),
        (b"\xff\xfe", "cannot read"),
    ],
)
def test_unusable_files_name_themselves(tmp_path, content, message):
    """Every unreadable config raises ModelConfigError with the file's path."""
    path = tmp_path / "config.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(ModelConfigError, match=message) as info:
        load_model_files(str(path))
    assert str(path) in str(info.value)


LLAMA_CONFIG = BUNDLED_MODELS_DIR / "llama-3.1-8b" / "config.json"
REPO_ID = "meta-llama/Llama-3.1-8B-Instruct"


def fake_hub(cache, revisions, main=None, repo_id=REPO_ID):
    """A Hugging Face hub cache as huggingface_hub lays it out: blobs, refs, snapshots.

    Each revision's config.json is a symlink into blobs/, as real downloads are; its
    num_hidden_layers is made distinct so a test can tell which snapshot was read.
    """
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    base = json.loads(LLAMA_CONFIG.read_text())
    for layers, revision in enumerate(revisions, start=40):
        blob = repo / "blobs" / f"blob{layers}"
        blob.write_text(json.dumps({**base, "num_hidden_layers": layers}))
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").symlink_to(blob)
    if main is not None:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(main)
    return repo


def test_hf_id_resolves_to_the_snapshot_refs_main_names(tmp_path):
    """An ORG/NAME id reads config.json of the revision refs/main points to."""
    repo = fake_hub(tmp_path / "hub", ["a" * 40, "b" * 40], main="a" * 40)
    os.utime(repo / "snapshots" / ("b" * 40), (2_000_000_000, 2_000_000_000))  # newer
    files = load_model_files(REPO_ID, env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert files.config["num_hidden_layers"] == 40
    assert files.source == str(repo / "snapshots" / ("a" * 40) / "config.json")
    assert files.name == REPO_ID
    assert files.index_total_size is None


def test_hf_id_without_refs_main_takes_the_newest_snapshot(tmp_path):
    """No refs/main (or a dangling one): the most recently written snapshot wins."""
    for main in (None, "c" * 40):
        cache = tmp_path / str(main) / "hub"
        repo = fake_hub(cache, ["a" * 40, "b" * 40], main=main)
        os.utime(repo / "snapshots" / ("a" * 40), (1_000_000_000, 1_000_000_000))
        os.utime(repo / "snapshots" / ("b" * 40), (2_000_000_000, 2_000_000_000))
        files = load_model_files(REPO_ID, env={"HF_HUB_CACHE": str(cache)})
        assert files.config["num_hidden_layers"] == 41


def test_hf_index_in_the_snapshot_gives_exact_weights(tmp_path):
    """model.safetensors.index.json beside the cached config.json is read, as on disk."""
    repo = fake_hub(tmp_path, ["a" * 40], main="a" * 40)
    index = {"metadata": {"total_size": 16_060_522_496}, "weight_map": {}}
    (repo / "snapshots" / ("a" * 40) / INDEX_FILE).write_text(json.dumps(index))
    files = load_model_files(REPO_ID, env={"HF_HUB_CACHE": str(tmp_path)})
    assert files.index_total_size == 16_060_522_496


@pytest.mark.parametrize(
    ("env", "where"),
    [
        ({"HF_HUB_CACHE": "{t}/a", "HF_HOME": "{t}/b"}, "{t}/a"),
        ({"HUGGINGFACE_HUB_CACHE": "{t}/a", "HF_HOME": "{t}/b"}, "{t}/a"),
        ({"HF_HOME": "{t}/b", "XDG_CACHE_HOME": "{t}/c"}, "{t}/b/hub"),
        ({"XDG_CACHE_HOME": "{t}/c"}, "{t}/c/huggingface/hub"),
        ({"HOME": "{t}/home"}, "{t}/home/.cache/huggingface/hub"),
    ],
)
def test_cache_location_follows_huggingface_hub(tmp_path, monkeypatch, env, where):
    """HF_HUB_CACHE, then HUGGINGFACE_HUB_CACHE, HF_HOME/hub, XDG_CACHE_HOME, ~/.cache."""
    env = {key: value.format(t=tmp_path) for key, value in env.items()}
    monkeypatch.setenv("HOME", env.get("HOME", str(tmp_path / "home")))
    assert hf_hub_cache(env) == Path(where.format(t=tmp_path))
    fake_hub(Path(where.format(t=tmp_path)), ["a" * 40], main="a" * 40)
    assert load_model_files(REPO_ID, env=env).config["num_hidden_layers"] == 40


def test_missing_hf_model_says_where_config_json_goes(tmp_path):
    """One line naming the exact cache path looked in, and the other ways in."""
    with pytest.raises(ModelConfigError) as info:
        load_model_files(REPO_ID, env={"HF_HOME": str(tmp_path)})
    message = str(info.value)
    expected = tmp_path / "hub" / "models--meta-llama--Llama-3.1-8B-Instruct" / "snapshots"
    assert f"{expected}/<revision>/config.json" in message
    assert f"huggingface-cli download {REPO_ID} config.json" in message
    assert "pass a directory holding config.json" in message
    assert "\n" not in message


def test_local_paths_and_bundled_names_win_over_the_cache(tmp_path, monkeypatch):
    """A directory named like an HF id, and a bundled name, never reach the cache."""
    fake_hub(tmp_path / "hub", ["a" * 40], main="a" * 40)
    env = {"HF_HUB_CACHE": str(tmp_path / "hub")}
    local = tmp_path / "meta-llama" / "Llama-3.1-8B-Instruct"
    local.mkdir(parents=True)
    (local / "config.json").write_text(json.dumps({"hidden_size": 8}))
    monkeypatch.chdir(tmp_path)
    files = load_model_files(REPO_ID, env=env)
    assert files.config == {"hidden_size": 8}
    assert files.name == "Llama-3.1-8B-Instruct"
    assert load_model_files("llama-3.1-8b", env=env).name == "llama-3.1-8b"


@pytest.mark.parametrize("model", ["./x/y", "a/b/c", "/abs/path", "../up"])
def test_paths_that_are_not_hf_ids_say_so(tmp_path, model):
    """Only ORG/NAME is looked up in the cache; other missing paths are plain misses."""
    with pytest.raises(ModelConfigError, match="no such file or directory") as info:
        load_model_files(model, env={"HF_HUB_CACHE": str(tmp_path)})
    assert "Hugging Face cache" not in str(info.value)


def test_overrides_merge_field_by_field_as_vllm_hf_overrides_does():
    """An object merges into an object; anything else replaces; the original is kept."""
    config = {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "beta_fast": 32}, "a": 1}
    merged = merged_config(config, {"rope_scaling": {"factor": 4.0}, "a": {"b": 2}, "c": None})
    assert merged == {
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32},
        "a": {"b": 2},
        "c": None,
    }
    assert config["rope_scaling"]["factor"] == 2.0  # type: ignore[index]
