"""ART's path helpers for a model's files (`{art_path}/{project}/models/{name}/...`), over our checkpoint layout."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from . import checkpoints
from .model import check_name

if TYPE_CHECKING:
    from .model import Model

DEFAULT_ART_PATH = ".art"


def get_default_art_path() -> str:
    return str(Path(DEFAULT_ART_PATH).resolve())


def get_models_dir(project_name: str, art_path: str | None = None) -> str:
    return str(Path(art_path or DEFAULT_ART_PATH) / check_name("project", project_name) / "models")


def get_output_dir_from_model_properties(project: str, name: str, art_path: str | None = None) -> str:
    return str(
        checkpoints.model_dir(
            check_name("project", project), check_name("model", name), art_path or DEFAULT_ART_PATH
        )
    )


def get_model_dir(model: Model, art_path: str | None = None) -> str:
    return get_output_dir_from_model_properties(model.project, model.name, art_path or model.base_path)


def get_step_checkpoint_dir(model_output_dir: str, step: int) -> str:
    return str(checkpoints.checkpoint_dir(model_output_dir, step))


def get_trajectories_dir(model_output_dir: str) -> str:
    return str(Path(model_output_dir) / "trajectories")


def get_trajectories_split_dir(model_output_dir: str, split: str) -> str:
    return str(Path(model_output_dir) / "trajectories" / check_name("split", split))


def get_step_from_dir(output_dir: str) -> int:
    """The newest checkpoint step under `output_dir` (0 when there is none)."""
    return checkpoints.latest_step(output_dir)


def get_model_step(model: Model, art_path: str | None = None) -> int:
    """The model's newest checkpoint step on disk, read without a backend."""
    return get_step_from_dir(get_model_dir(model, art_path))
