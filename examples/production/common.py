"""What the three production examples share: reading the traces (Langfuse, or a JSONL file written by
`art-adapters import`) and the model to train."""

from __future__ import annotations

import argparse

import art_adapters as art
from art_adapters.trajectories import read_jsonl


def arguments(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--traces", help="a JSONL file from `art-adapters import` (default: read Langfuse)")
    parser.add_argument("--tag", action="append", default=None, help="Langfuse traces with this tag")
    parser.add_argument("--base-model", default="Qwen/Qwen2.5-0.5B-Instruct")
    parser.add_argument("--name", default="agent")
    parser.add_argument("--project", default="production")
    parser.add_argument("--path", default=".art")
    return parser


def traces(args: argparse.Namespace) -> list[art.Trajectory]:
    if args.traces:
        return read_jsonl(args.traces)
    from art_adapters.tracing.langfuse import import_trajectories

    return import_trajectories(tags=args.tag).to_list()  # keys and URL from LANGFUSE_* variables


async def model_of(args: argparse.Namespace) -> art.TrainableModel:
    model = art.TrainableModel(name=args.name, project=args.project, base_model=args.base_model)
    await model.register(art.LocalBackend(args.path))
    return model
