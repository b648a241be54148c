"""Finding a model's config: a file, a directory, or a bundled name."""

from __future__ import annotations

import json

import pytest

from kvguard.config.model_files import BUNDLED_MODELS_DIR, bundled_models, load_model_files
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
