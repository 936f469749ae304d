"""Check gather_on_ray on a cluster (or a local Ray): a few model-free rollouts, and where they ran."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
from collections import Counter

import art_adapters as art
from art_adapters.ray import gather_on_ray


async def rollout(model: art.Model, scenario: int) -> art.Trajectory:
    """Needs no model: proves tasks run, return Trajectory JSON and come back grouped in order."""
    await asyncio.sleep(0.05)
    trajectory = art.Trajectory(messages_and_choices=[{"role": "user", "content": f"scenario {scenario}"}])
    trajectory.reward = float(scenario)
    trajectory.metadata.update(host=socket.gethostname(), pid=os.getpid())
    return trajectory


async def main(address: str | None, scenarios: int, group_size: int) -> None:
    import ray

    ray.init(address=address, include_dashboard=False)
    model = art.Model(name="unused", inference_base_url="http://unused.invalid/v1")
    groups = await gather_on_ray(rollout, range(scenarios), group_size, model=model, num_cpus=0.25)
    assert [len(g.trajectories) for g in groups] == [group_size] * scenarios
    assert [g.trajectories[0].reward for g in groups] == [float(k) for k in range(scenarios)]
    where = Counter(f"{t.metadata['host']}:{t.metadata['pid']}" for g in groups for t in g)
    print(f"ok  {scenarios * group_size} rollouts in {len(where)} worker processes: {dict(where)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--address", default=None, help="ray://head:10001, 'auto', or none for a local Ray")
    parser.add_argument("--scenarios", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    args = parser.parse_args()
    asyncio.run(main(args.address, args.scenarios, args.group_size))
