"""LocalBackend registration and serving on the shared vLLM server: layout, step-0 policy, names, bad input."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

import art_adapters as art
from art_adapters.backend.local import LocalBackend
from art_adapters.inference import InferenceConfig, VLLMServer
from fixtures_vllm import registered_on

pytestmark = [pytest.mark.vllm, pytest.mark.train]
aio = pytest.mark.asyncio(loop_scope="session")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def registered(
    vllm_server: VLLMServer, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[LocalBackend, art.TrainableModel]]:
    async with registered_on(
        vllm_server, tmp_path_factory.mktemp("art"), name="agent", project="local"
    ) as pair:
        yield pair
    assert vllm_server.running, "close() stopped a server it did not start"


async def served_names(server: VLLMServer) -> set[str]:
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.get(f"{server.base_url}/models", headers=server.headers)
    return {m["id"] for m in r.json()["data"]}


async def gateway_names(model: art.Model) -> set[str]:
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.get(
            f"{model.inference_base_url}/models",
            headers={"authorization": f"Bearer {model.inference_api_key}"},
        )
    return {m["id"] for m in r.json()["data"]}


@aio
async def test_register_writes_layout_and_serves_the_base_policy_as_step_0(
    registered: tuple[LocalBackend, art.TrainableModel], vllm_server: VLLMServer
) -> None:
    backend, model = registered
    folder = backend.model_dir(model)
    assert folder == backend.path / "local" / "models" / "agent"
    assert (folder / "model.json").is_file() and "inference_api_key" not in (
        folder / "model.json"
    ).read_text()
    assert (folder / "checkpoints" / "0000" / "adapter_config.json").is_file()
    assert await model.get_step() == 0
    # vLLM serves the version; the gateway in front of it, the model's names (the bare one too: no other project)
    assert "local/agent@0" in await served_names(vllm_server) and "local/agent" not in await served_names(
        vllm_server
    )
    assert {"local/agent", "agent"} <= await gateway_names(model)
    assert model.get_inference_name() == "local/agent"
    assert model.inference_base_url != vllm_server.base_url  # clients reach vLLM through the gateway only
    trainer = await backend.trainer(model)
    ids = trainer.tokenizer.apply_chat_template(MESSAGES, tokenize=True, return_dict=False) + [65, 66, 67]
    # Step 0 is a zero adapter: vLLM's logprobs equal the base model's (adapter disabled in the trainer).
    from art_adapters.backend.serving import served_prompt_logprobs

    served = await served_prompt_logprobs(vllm_server, "local/agent@0", ids)
    with trainer.model.disable_adapter():
        base = trainer.logprobs_of(ids)
    assert max(abs(a - b) for a, b in zip(served, base, strict=True)) <= 1e-4


@aio
async def test_openai_client_choices_carry_token_ids_and_both_names_answer(
    registered: tuple[LocalBackend, art.TrainableModel],
) -> None:
    _, model = registered
    client = model.openai_client()
    for name in (model.name, model.get_inference_name(0)):
        response = await client.chat.completions.create(
            model=name,
            messages=MESSAGES,
            max_tokens=6,
            temperature=1.0,  # type: ignore[arg-type]
        )
        choice: Any = response.choices[0]
        extra = choice.model_extra or {}
        assert extra.get("prompt_token_ids") and extra.get("token_ids"), extra.keys()
        assert len(choice.logprobs.content) == len(extra["token_ids"])


@aio
async def test_plain_model_registers_without_a_server(vllm_server: VLLMServer, tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path)
    model = art.Model(
        name="judge",
        project="local",
        inference_base_url=vllm_server.base_url,
        inference_api_key=vllm_server.api_key,
        inference_model_name=vllm_server.model_name,
    )
    await model.register(backend)
    response = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(),
        messages=MESSAGES,
        max_tokens=3,  # type: ignore[arg-type]
    )
    assert response.choices[0].message is not None
    assert not backend._owned and not backend._models
    await backend.close()


@aio
async def test_bad_base_model_and_rank_fail_before_any_server_starts(
    tmp_path: Path, tiny_model: Path, vllm_server: VLLMServer
) -> None:
    backend = LocalBackend(tmp_path / "art")
    missing = art.TrainableModel(name="m", project="p", base_model=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="does not exist"):
        await missing.register(backend)
    (tmp_path / "empty").mkdir()
    not_a_model = art.TrainableModel(name="m", project="p", base_model=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="config.json"):
        await not_a_model.register(backend)
    too_big = art.TrainableModel(
        name="m", project="p", base_model=str(tiny_model), lora=art.LoRAConfig(rank=32)
    )
    explicit = LocalBackend(tmp_path / "art", inference=InferenceConfig(max_lora_rank=16))
    with pytest.raises(ValueError, match="max_lora_rank"):
        await too_big.register(explicit)
    with pytest.raises(ValueError, match="max_lora_rank=16"):
        await too_big.register(LocalBackend(tmp_path / "art").use_server(vllm_server))
    assert not backend._owned and not explicit._owned
    assert not (tmp_path / "art" / "p").exists()


@aio
async def test_train_while_not_registered_is_a_clear_error(
    registered: tuple[LocalBackend, art.TrainableModel], tiny_model: Path
) -> None:
    backend, _ = registered
    stranger = art.TrainableModel(name="stranger", project="local", base_model=str(tiny_model))
    with pytest.raises(RuntimeError, match="register"):
        await stranger.train([])
    with pytest.raises(RuntimeError, match="not registered with this LocalBackend"):
        async for _ in backend.train_events(stranger, [], art.TrainConfig()):
            pass


@aio
async def test_an_unservable_lm_head_is_refused_before_any_server_starts(
    tmp_path: Path, tiny_model: Path
) -> None:
    backend = LocalBackend(tmp_path)
    head = art.TrainableModel(
        name="m", project="p", base_model=str(tiny_model), lora=art.LoRAConfig(modules_to_save=["lm_head"])
    )
    with pytest.raises(ValueError, match="modules_to_save"):
        await head.register(backend)
    assert not backend._owned
