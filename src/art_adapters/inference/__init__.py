"""Inference side: the vLLM OpenAI server as a managed child process (no torch/vllm import at load time)."""

from art_adapters.inference.config import InferenceConfig
from art_adapters.inference.vllm_server import (
    InferenceServerError,
    VLLMServer,
    find_free_port,
    write_zero_adapter,
)

__all__ = ["InferenceConfig", "InferenceServerError", "VLLMServer", "find_free_port", "write_zero_adapter"]
