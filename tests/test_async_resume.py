"""A real async run (LocalBackend, its own vLLM, the trainer) SIGKILLed in the middle of a step resumes cleanly:
the last complete checkpoint and the pipeline's progress survive, nothing half-written remains, and a new run picks
up from there.

Run as a script it is the run: `python tests/test_async_resume.py PATH STEPS KILL_AT` (KILL_AT < 0: never)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.train]


def _run(path: str, steps: int, kill_at: int) -> None:
    import art_adapters as art
    from art_adapters.pipeline import PipelineConfig, train_async
    from art_adapters.tiny import tiny_model_path

    async def main() -> None:
        backend = art.LocalBackend(path)
        model = art.TrainableModel(
            name="resumed", project="async", base_model=str(tiny_model_path()), lora=art.LoRAConfig(rank=8)
        )
        await model.register(backend)
        client = model.openai_client()

        async def rollout(model: art.TrainableModel, scenario: int) -> art.TrajectoryGroup:
            if kill_at >= 0 and backend._models[backend.model_dir(model)].trainer.step >= kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # in the middle of step kill_at + 1
            trajectories = []
            for k, reward in enumerate([1.0, 0.0, 0.5]):
                messages = [{"role": "user", "content": f"Say {scenario} {k}."}]
                completion = await client.chat.completions.create(
                    model=model.get_inference_name(), messages=messages, max_tokens=6
                )
                trajectories.append(
                    art.Trajectory(messages_and_choices=[*messages, completion.choices[0]], reward=reward)
                )
            return art.TrajectoryGroup(trajectories)

        config = PipelineConfig(rollout_workers=2, groups_per_step=2, max_steps_off_policy=1, max_steps=steps)
        reports = await train_async(
            model, rollout, range(1000), config=art.TrainConfig(learning_rate=1e-3), pipeline=config
        )
        print("STEPS " + json.dumps([r.step for r in reports]), flush=True)
        await backend.close()

    asyncio.run(main())


def run(path: Path, steps: int, kill_at: int) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.run(
        [sys.executable, __file__, str(path), str(steps), str(kill_at)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


def test_an_async_run_killed_mid_step_resumes_cleanly(tmp_path: Path) -> None:
    killed = run(tmp_path, steps=10, kill_at=2)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    folder = tmp_path / "async" / "models" / "resumed"
    checkpoints = sorted(p.name for p in (folder / "checkpoints").iterdir())
    assert checkpoints == ["0000", "0001", "0002"]  # step 3 was under way: not there, not half there
    state = json.loads((folder / "state.json").read_text())["_pipeline_trainer"]
    assert state["offsets"]["2"] >= 4  # where step 2's scenarios ended, noted before it trained

    resumed = run(tmp_path, steps=2, kill_at=-1)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "STEPS [3, 4]" in resumed.stdout
    assert sorted(p.name for p in (folder / "checkpoints").iterdir())[-1] == "0004"
    state = json.loads((folder / "state.json").read_text())["_pipeline_trainer"]
    assert state["training_step"] == 4
    rows = [json.loads(line) for line in (folder / "history.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("split") == "train"] == [1, 2, 3, 4]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    _run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
