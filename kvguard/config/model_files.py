"""Find and read a model's ``config.json`` and weight index from disk.

This is the I/O edge of the budget: it resolves what the operator typed (a file,
a directory holding ``config.json``, or the name of a config bundled with
kvguard), reads the JSON, and translates every file-system and JSON error into a
:class:`~kvguard.errors.ModelConfigError` that names the file.
"""

from __future__ import annotations

import json
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


@dataclass(frozen=True)
class ModelFiles:
    """A model's parsed ``config.json`` and, when present, its exact weight size."""

    source: str
    config: dict[str, object]
    index_total_size: int | None


def bundled_models() -> list[str]:
    """Names of the model configs that ship with kvguard (usable instead of a path)."""
    return sorted(p.parent.name for p in BUNDLED_MODELS_DIR.glob("*/config.json"))


def load_model_files(model: str, *, weight_index: bool = True) -> ModelFiles:
    """Resolve ``model`` to a config file, read it, and read the weight index beside it.

    A bad index raises :class:`WeightIndexError`. ``weight_index=False`` leaves the
    index unread (``index_total_size`` None): ``config.json`` alone.
    """
    path = _resolve(model)
    config = _read_json(path)
    if not isinstance(config, dict):
        raise ModelConfigError("config.json must hold a JSON object", source=str(path))
    index_path = path.parent / INDEX_FILE
    read = weight_index and index_path.is_file()
    total = _index_total_size(index_path) if read else None
    return ModelFiles(str(path), config, total)


def _resolve(model: str) -> Path:
    path = Path(model)
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise ModelConfigError("directory holds no config.json", source=model)
        return config
    if path.is_file():
        return path
    bundled = BUNDLED_MODELS_DIR / model / "config.json"
    if "/" not in model and bundled.is_file():
        return bundled
    names = ", ".join(bundled_models())
    raise ModelConfigError(
        f"no such file or directory, and no bundled model of that name (bundled: {names})",
        source=model,
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
