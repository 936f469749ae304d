"""The gateway in front of the real vLLM server, from a client's side: requests that would kill or exhaust the
engine are refused, a client that goes away aborts its generation, and an engine that dies anyway is restarted
with its adapters at the versions they served."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

import art_adapters as art
from art_adapters.inference import VLLMServer
from fixtures_vllm import registered_on

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def nested(levels: int) -> dict[str, Any]:
    top: dict[str, Any] = {}
    inner = top
    for _ in range(levels):
        inner["a"] = {}
        inner = inner["a"]
    return top


async def post(model: art.Model, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=kwargs.pop("timeout", 120)) as client:
        return await client.post(
            f"{model.inference_base_url}/chat/completions",
            headers={"authorization": f"Bearer {model.inference_api_key}"},
            json=body,
            **kwargs,
        )


async def engine_metrics(server: VLLMServer) -> tuple[float, float]:
    """vLLM's running requests and total generated tokens (its Prometheus metrics)."""
    async with httpx.AsyncClient(timeout=30) as client:
        text = (await client.get(f"{server.root_url}/metrics", headers=server.headers)).text

    def metric(name: str) -> float:
        return sum(float(x) for x in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))

    return metric("vllm:num_requests_running"), metric("vllm:generation_tokens_total")


async def test_the_killing_request_is_refused_and_the_engine_keeps_serving(
    vllm_server: VLLMServer, tmp_path: Path
) -> None:
    async with registered_on(vllm_server, tmp_path, name="guarded", project="gw") as (_, model):
        attack = {"model": model.get_inference_name(), **CHAT, "kv_transfer_params": nested(900)}
        refused = await post(model, attack)
        assert refused.status_code == 400 and "nested deeper than 64" in refused.text
        flood = {"model": model.name, **CHAT, "n": 16384, "max_tokens": 2000, "ignore_eos": True}
        assert (await post(model, flood)).status_code == 400
        plain = await post(model, {"model": model.get_inference_name(), **CHAT, "kv_transfer_params": {}})
        assert plain.status_code == 200 and plain.headers["x-art-served-model"] == "gw/guarded@0"
        for asked in (vllm_server.model_name, "gw/guarded@7", "../load_lora_adapter", "guarded\n"):
            gone = await post(model, {"model": asked, **CHAT})  # the base model, a step never trained, junk
            assert gone.status_code == 404 and "Valid aliases" not in gone.text
            assert "gw/guarded@0" not in gone.text and "tiny" not in gone.text.replace(
                vllm_server.model_name, ""
            )
        async with httpx.AsyncClient(timeout=30) as client:
            listed = await client.get(
                f"{model.inference_base_url}/models",
                headers={"authorization": f"Bearer {model.inference_api_key}"},
            )
        assert {m["id"] for m in listed.json()["data"]} >= {"gw/guarded", "guarded"}
        assert "/" not in str([m for m in listed.json()["data"] if m["id"] == "guarded"]).replace("gw/", "")


async def test_a_client_that_goes_away_aborts_its_generation(vllm_server: VLLMServer, tmp_path: Path) -> None:
    async with registered_on(vllm_server, tmp_path, name="walker", project="gw") as (_, model):
        _, before = await engine_metrics(vllm_server)
        asked = 16 * 1900  # ~10 s of generation on 2 CPU cores
        long = {"model": model.name, **CHAT, "n": 16, "max_tokens": 1900, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            await post(model, long, timeout=1.0)
        for _ in range(600):
            running, generated = await engine_metrics(vllm_server)
            if not running:
                break
            await asyncio.sleep(0.1)
        assert not running and generated - before < asked  # stopped, not run to its end for nobody
        assert (await post(model, {"model": model.name, **CHAT})).status_code == 200


async def test_a_dead_engine_is_restarted_with_its_adapters_at_their_versions(
    vllm_server: VLLMServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine killed from outside (the OOM killer, a crash on input the gateway cannot see) comes back by
    itself, every version it served loaded again, and the event is logged."""
    async with registered_on(vllm_server, tmp_path, name="phoenix", project="gw") as (backend, model):
        ok = await post(model, {"model": model.name, **CHAT})
        assert ok.status_code == 200
        restarts, old_key = vllm_server.restarts, vllm_server.api_key
        with caplog.at_level(logging.WARNING, logger="art_adapters.inference.gateway"):
            assert vllm_server.process is not None
            os.killpg(vllm_server.process.pid, signal.SIGKILL)  # as the OOM killer would: no goodbye
            vllm_server.process.wait(timeout=30)
            again = await post(model, {"model": model.name, **CHAT}, timeout=600)  # waits for the restart
        assert again.status_code == 200, again.text  # sent again once the engine is back, not a 502
        assert again.headers["x-art-served-model"] == "gw/phoenix@0"
        assert vllm_server.restarts == restarts + 1 and "gw/phoenix@0" in vllm_server.loras
        async with httpx.AsyncClient(timeout=30) as client:  # a key sent before the restart opens nothing now
            stale = await client.get(
                f"{vllm_server.base_url}/models", headers={"authorization": f"Bearer {old_key}"}
            )
        assert vllm_server.api_key != old_key and stale.status_code == 401
        messages = [r.getMessage() for r in caplog.records]
        assert any("the vLLM engine died" in m for m in messages)
        assert any("is back after" in m and "reloaded" in m for m in messages)
        trainer = await backend.trainer(model)
        ids = trainer.tokenizer.encode("hello there", add_special_tokens=False)
        assert await backend.served_logprob_diff(model, [1, *ids]) <= 1e-4  # the same weights as before
