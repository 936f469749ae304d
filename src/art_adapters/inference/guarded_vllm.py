"""Entry point of the managed vLLM server: vLLM's OpenAI server with its API key required on EVERY route.

vLLM's own key guards only `/v1`-style paths; with the development mode we need (LoRA hot-swap, prefix-cache
resets, sleep on CUDA) its root routes (`/collective_rpc`, `/reset_prefix_cache`, `/sleep`, ...) would answer
any local process. This runs in the child process only, and the key arrives by environment (`VLLM_API_KEY`), not
on the command line where `ps` shows it to every user.

    python -m art_adapters.inference.guarded_vllm --model DIR ...   (the arguments of vLLM's api_server)
"""

from __future__ import annotations

import os
import runpy
import sys

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def guard_every_route() -> None:
    """Make vLLM's authentication middleware check every path, or refuse to start if it cannot."""
    if not os.environ.get("VLLM_API_KEY"):
        raise SystemExit("guarded_vllm: VLLM_API_KEY is not set; refusing to start an unguarded server")
    try:
        from vllm.entrypoints.serve.middleware import authenticate
    except ImportError as error:
        raise SystemExit(
            f"guarded_vllm: this vLLM has no authentication middleware to extend ({error})"
        ) from error
    if not isinstance(getattr(authenticate, "GUARDED_PREFIX", None), tuple):
        raise SystemExit(
            "guarded_vllm: vLLM's GUARDED_PREFIX is gone; refusing to start with unguarded routes"
        )
    authenticate.GUARDED_PREFIX = ("/",)


def main() -> None:
    guard_every_route()
    sys.argv = [SERVER_MODULE, *sys.argv[1:]]
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
