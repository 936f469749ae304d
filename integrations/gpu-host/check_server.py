"""Check a running `art-adapters serve`: key enforced, healthy, and (with --base-model) serving a chat via /v1."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import httpx

import art_adapters as art
from art_adapters.backend.remote import RemoteBackend, RemoteBackendError


async def check(url: str, key: str | None, base_model: str | None) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        anonymous = await client.get(f"{url}/health")
    if key:
        assert anonymous.status_code == 401, (
            f"without a key /health answered {anonymous.status_code}, not 401"
        )
        print("ok  a request without the key is refused (401)")
    else:
        print("!!  no key given: fine on loopback only")
    backend = RemoteBackend(url, key)
    print(f"ok  health: {await backend.health()}")
    if base_model:
        model = art.TrainableModel(name="check-model", project="check", base_model=base_model)
        await model.register(backend)
        answer = await model.openai_client().chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8
        )
        print(f"ok  chat through {model.inference_base_url}: {answer.choices[0].message.content!r}")
        print(f"ok  step {await model.get_step()}")
    await backend.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("url", help="e.g. http://127.0.0.1:7999 (an ssh tunnel) or https://gpu-host:7999")
    parser.add_argument("--api-key", default=os.environ.get("ART_ADAPTERS_API_KEY"))
    parser.add_argument(
        "--base-model", default=None, help="register a model on it and chat once (starts vLLM)"
    )
    args = parser.parse_args()
    try:
        asyncio.run(check(args.url.rstrip("/"), args.api_key, args.base_model))
    except (AssertionError, RemoteBackendError) as error:
        print(f"FAIL {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
