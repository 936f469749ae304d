"""Shared test set-up: tests run offline; the vLLM fixture starts one real server for the whole session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm must not fetch its price list

sys.path.insert(0, str(Path(__file__).parent))

from fixtures_s3 import s3_server  # noqa: E402,F401 - a real S3 server, for tests that ask for one

try:  # the session-scoped real vLLM server (tests marked `vllm` use it)
    from fixtures_vllm import *  # noqa: F403
except ImportError:  # pragma: no cover - only while the fixture module is absent
    pass
