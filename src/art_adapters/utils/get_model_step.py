"""`art_adapters.utils.get_model_step` (ART's path)."""

from ..paths import get_model_step, get_step_from_dir

__all__ = ["get_model_step", "get_step_from_dir"]
