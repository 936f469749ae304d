"""`art_adapters.utils.iterate_dataset` (ART's path)."""

from ..dataset import DatasetBatch, iterate_dataset

__all__ = ["DatasetBatch", "iterate_dataset"]
