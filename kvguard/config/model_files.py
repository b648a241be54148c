"""Find and read a model's ``config.json`` and weight index from disk.

This is the I/O edge of the budget: it resolves what the operator typed (a file,
a directory holding ``config.json``, the name of a config bundled with kvguard,
or a Hugging Face id such as ``meta-llama/Llama-3.1-8B-Instruct`` already in the
local Hugging Face cache), reads the JSON, and translates every file-system and
JSON error into a :class:`~kvguard.errors.ModelConfigError` that names the file.
Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvguard.errors import ModelConfigError

BUNDLED_MODELS_DIR = Path(__file__).parent / "models"
INDEX_FILE = "model.safetensors.index.json"


class WeightIndexError(ModelConfigError):
    """The weight index beside ``config.json`` is unusable; ``config.json`` itself may be fine.

    Its own class so that ``kvguard check-config`` can report it and still check the
    ``[model]`` settings against the model's config (``load_model_files(...,
    weight_index=False)``) rather than stop at the index.
    """


# A Hugging Face repo id: "org/name", each part letters, digits, ".", "_" or "-",
# not starting with "." (so "./dir" and "../x" stay paths).
_HF_ID_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]*/[A-Za-z0-9_-][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class ModelFiles:
    """A model's parsed ``config.json`` and, when present, its exact weight size.

    ``name`` is what to call the model when its config has no ``_name_or_path``:
    the Hugging Face id, the bundled name, or the directory's name.
    """

    source: str
    config: dict[str, object]
    index_total_size: int | None
    name: str = ""


def merged_config(
    config: Mapping[str, object], overrides: Mapping[str, object]
) -> dict[str, object]:
    """``config`` with ``overrides`` merged in, as vLLM's ``--hf-overrides`` does.

    An object merges into an object field by field (``{"rope_scaling": {"factor": 4}}``
    keeps the other rope fields); anything else replaces the field.
    """
    merged = dict(config)
    for key, value in overrides.items():
        current = merged.get(key)
        if isinstance(value, Mapping) and isinstance(current, Mapping):
            merged[key] = merged_config(current, value)
        else:
            merged[key] = value
    return merged


def bundled_models() -> list[str]:
    """Names of the model configs that ship with kvguard (usable instead of a path)."""
    return sorted(p.parent.name for p in BUNDLED_MODELS_DIR.glob("*/config.json"))


def hf_hub_cache(env: Mapping[str, str] | None = None) -> Path:
    """The Hugging Face hub cache directory, found as ``huggingface_hub`` finds it.

    ``$HF_HUB_CACHE``, else the older ``$HUGGINGFACE_HUB_CACHE``, else
    ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else
    ``~/.cache/huggingface/hub``. ``env`` defaults to the process environment.
    """
    env = os.environ if env is None else env
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(variable):
            return Path(env[variable]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    cache = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path("~/.cache")
    return cache.expanduser() / "huggingface" / "hub"


def load_model_files(
    model: str, *, weight_index: bool = True, env: Mapping[str, str] | None = None
) -> ModelFiles:
    """Resolve ``model`` to a config file, read it, and read the weight index beside it.

    ``model`` is, in this order of precedence: an existing file or directory, a
    bundled model's name, or a Hugging Face id looked up in the local cache
    (:func:`hf_hub_cache`, from ``env``). A bad index raises :class:`WeightIndexError`.
    ``weight_index=False`` leaves the index unread (``index_total_size`` None).
    """
    path, name = _resolve(model, env)
    config = _read_json(path)
    if not isinstance(config, dict):
        raise ModelConfigError("config.json must hold a JSON object", source=str(path))
    index_path = path.parent / INDEX_FILE
    read = weight_index and index_path.is_file()
    total = _index_total_size(index_path) if read else None
    return ModelFiles(str(path), config, total, name)


def _resolve(model: str, env: Mapping[str, str] | None) -> tuple[Path, str]:
    """The config file ``model`` names, and the name to call the model by."""
    path = Path(model)
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise ModelConfigError("directory holds no config.json", source=model)
        return config, path.resolve().name
    if path.is_file():
        return path, path.resolve().parent.name
    bundled = BUNDLED_MODELS_DIR / model / "config.json"
    if "/" not in model and bundled.is_file():
        return bundled, model
    if _HF_ID_RE.match(model):
        return _from_hf_cache(model, hf_hub_cache(env)), model
    names = ", ".join(bundled_models())
    raise ModelConfigError(
        "no such file or directory, no bundled model of that name (bundled: "
        f"{names}), and not a Hugging Face id (ORG/NAME)",
        source=model,
    )


def _from_hf_cache(repo_id: str, cache: Path) -> Path:
    """``config.json`` of ``repo_id`` in the hub cache.

    From the snapshot ``refs/main`` names, else from the newest snapshot holding one.
    """
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    main = repo / "refs" / "main"
    try:
        revision = main.read_text(encoding="utf-8").strip() if main.is_file() else ""
    except (OSError, UnicodeDecodeError):
        revision = ""  # an unreadable ref: fall back to the newest snapshot
    if revision and (snapshots / revision / "config.json").is_file():
        return snapshots / revision / "config.json"
    candidates = [p for p in snapshots.glob("*/config.json") if p.is_file()]
    if candidates:
        return max(candidates, key=lambda p: p.parent.stat().st_mtime)
    raise ModelConfigError(
        f"not a local path or bundled model, and not in the Hugging Face cache: no"
        f" {snapshots}/<revision>/config.json (fetch it with `huggingface-cli download"
        f" {repo_id} config.json model.safetensors.index.json`, set HF_HUB_CACHE, or pass"
        " a directory holding config.json or the file itself)",
        source=repo_id,
    )


def _read_json(path: Path, error: type[ModelConfigError] = ModelConfigError) -> object:
    """The JSON at ``path``; ``error`` (naming the file) when unreadable or not JSON."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise error(f"cannot read: {reason}", source=str(path)) from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(
            f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}", source=str(path)
        ) from exc


def _index_total_size(path: Path) -> int:
    index = _read_json(path, WeightIndexError)
    metadata = index.get("metadata") if isinstance(index, dict) else None
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    if isinstance(total, bool) or not isinstance(total, int) or total <= 0:
        raise WeightIndexError(
            "weight index has no positive integer metadata.total_size"
            " (remove the file or pass --weights-bytes)",
            source=str(path),
            field="metadata.total_size",
        )
    return total
