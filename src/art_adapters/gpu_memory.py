"""The memory formulas behind the GPU plan (gpu_plan.py): bytes of weights, LoRA state, activations, logits, KV cache
and fixed overheads, each a documented function of the model's shape. Pure arithmetic; docs/gpu.md lists them.

Every estimate is in GiB (2**30 bytes). The constants are judgment where marked, checked on CPU where marked
(tests/test_plan.py measures the activation and logit terms on the tiny model); none was measured on a GPU yet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .gpu_plan import ModelShape

GIB = float(2**30)

# Fixed costs (judgment, to be checked on a device by bench/gpu_check.py).
CUDA_CONTEXT_GIB = 1.0  # one process's CUDA context, kernels and allocator slack
CUBLAS_WORKSPACE_GIB = 0.5  # cuBLAS / attention workspaces of the trainer's process
VLLM_OVERHEAD_GIB = (
    3.0  # vLLM's non-KV share beyond weights: context, CUDA graphs, sampler and activation peak
)
VLLM_ASLEEP_GIB = (
    2.0  # what a vLLM engine keeps at sleep level 1 (weights and KV cache released): context, graphs
)
TRANSIENT_MARGIN = 1.15  # allocator fragmentation on the step's transient terms (activations, logits)
SAFETY_GIB = 0.5  # never plan the last half GiB of a card ...
SAFETY_FRACTION = 0.05  # ... nor its last 5%: room for what these estimates miss

# Bytes per element.
BF16 = 2
FP32 = 4
NF4_BYTES_PER_PARAM = 0.5 + 2 / 64  # 4-bit weights plus one fp16 scale per 64-weight block
ADAMW_LORA_BYTES_PER_PARAM = FP32 * 4  # fp32 LoRA weight, its gradient, and AdamW's two moments
# [positions, vocab] fp32 buffers live at the peak of the logprob forward + backward: the logits, the tempered
# copy, logsumexp's and backward's; 4.0 measured on CPU fp32 (tests/test_plan.py), where the head's output is fp32.
LOGIT_COPIES = 4


def lora_modules(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear LoRA wraps in one decoder layer: q, k, v, o, gate, up, down."""
    h, i, q, kv = (
        shape.hidden_size,
        shape.intermediate_size,
        shape.attention_heads * shape.head_dim,
        shape.kv_heads,
    )
    kv_out = kv * shape.head_dim
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv_out),
        "v_proj": (h, kv_out),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def linear_parameters(shape: ModelShape) -> int:
    """Parameters of the decoder layers' linears (what 4-bit quantizes; embeddings, head and norms stay 16-bit)."""
    return shape.layers * sum(a * b for a, b in lora_modules(shape).values())


def lora_parameters(shape: ModelShape, rank: int) -> int:
    """LoRA rank r on q, k, v, o, gate, up and down: r·(in + out) per module per layer."""
    return shape.layers * sum(rank * (a + b) for a, b in lora_modules(shape).values())


def trainer_weights_gib(shape: ModelShape, *, bytes_per_param: int, load_in_4bit: bool) -> float:
    """The frozen base: P·2 B in bf16/fp16 (P·4 B in fp32 on CPU); in 4-bit, the linears at
    0.5 B + an fp16 scale per 64 weights, the rest (embeddings, head, norms) at 2 B."""
    if not load_in_4bit:
        return shape.parameters * bytes_per_param / GIB
    linears = linear_parameters(shape)
    return (linears * NF4_BYTES_PER_PARAM + (shape.parameters - linears) * BF16) / GIB


def lora_state_gib(shape: ModelShape, rank: int) -> float:
    """LoRA parameters + gradients + AdamW's two moments, all fp32: 16 B per LoRA parameter."""
    return lora_parameters(shape, rank) * ADAMW_LORA_BYTES_PER_PARAM / GIB


def layer_activation_bytes(shape: ModelShape, element_bytes: int = BF16) -> int:
    """What one decoder layer saves for backward per token, without checkpointing: (8h + 4i) elements.
    Per token: two RMSNorms (their fp32 upcast and normed output, ~3h each in 16-bit units), q/k/v and the
    attention output (~2h), and the MLP's gate, activation, up and product (4i)."""
    return (8 * shape.hidden_size + 4 * shape.intermediate_size) * element_bytes


def activation_gib(
    shape: ModelShape, tokens: int, *, checkpointing: bool, element_bytes: int = BF16
) -> float:
    """Activations of one forward + backward over `tokens` positions.
    Without checkpointing: (layers + 1)·(8h + 4i)·2 B per token (every layer's saved tensors, plus the
    activation gradients of the layer being differentiated).
    With checkpointing: layers·h·2 B per token (each layer's input, kept) + 2·(8h + 4i)·2 B per token (the one
    layer recomputed in backward, and its gradients).
    Measured on CPU fp32 (tests/test_plan.py): the peak of live tensors is 0.89× the first, 0.72× the second."""
    layer = layer_activation_bytes(shape, element_bytes)
    if checkpointing:
        per_token = shape.layers * shape.hidden_size * element_bytes + 2 * layer
    else:
        per_token = (shape.layers + 1) * layer
    return tokens * per_token / GIB


def logits_gib(shape: ModelShape, positions: int) -> float:
    """The head's output for `positions` trained positions at once: positions·vocab·4 B·4 copies. Chunked, the
    positions are one chunk's (the chunk is recomputed in backward, so only one chunk's logits are ever live)."""
    return positions * shape.vocab_size * FP32 * LOGIT_COPIES / GIB


def kv_bytes_per_token(shape: ModelShape, tensor_parallel_size: int = 1) -> int:
    """vLLM's KV cache per token on one GPU: 2 (K and V)·layers·kv_heads·head_dim·2 B, the KV heads split over
    TP (a KV head is replicated when TP exceeds their number)."""
    heads_per_gpu = max(1, -(-shape.kv_heads // tensor_parallel_size))
    return 2 * shape.layers * heads_per_gpu * shape.head_dim * BF16


def vllm_weights_gib(shape: ModelShape, tensor_parallel_size: int = 1) -> float:
    """vLLM serves the 16-bit base: P·2 B, split over TP."""
    return shape.parameters * BF16 / GIB / tensor_parallel_size


def usable_gib(total_gib: float) -> float:
    """What a plan may fill of a card: its memory less max(0.5 GiB, 5%)."""
    return total_gib - max(SAFETY_GIB, SAFETY_FRACTION * total_gib)
