"""The GPU plan's decisions (gpu_plan.make_plan): check the request, lay out the GPUs, then search for the plan
that fits, from the best (16-bit, the model's whole context, no checkpointing) down to the least (4-bit, a short
max_seq_len); a request that cannot fit is refused with its numbers and the nearest plan that does."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from . import gpu_memory as mem
from .gpu_plan import GPUs, Placement, Plan, PlanError
from .gpu_plan_request import Request, check_request

DEFAULT_MICRO_BATCH_TOKENS = (
    4096  # TrainConfig's default; checkpointing stays off only if this fits without it
)
CHUNK_CANDIDATES = (1024, 256)  # logprob chunk sizes tried, largest first
MIN_MICRO_BATCH_TOKENS = 512
MIN_SEQ_LEN = 1024  # below this no plan is offered
PREFERRED_MIN_SEQ_LEN = 4096  # a 4-bit trainer is preferred over a max_seq_len shorter than this
MIN_KV_SEQUENCES = 4  # vLLM's KV cache must hold this many max_seq_len sequences (a group's rollouts at once)
MAX_UTILIZATION = 0.90  # vLLM's share, at most: headroom for fragmentation and the allocator's own slack


@dataclass(frozen=True)
class Layout:
    placement: Placement
    trainer: list[int]
    inference: list[int]
    tp: int
    replicas: int


@dataclass(frozen=True)
class Trial:
    """One candidate's settings, its estimates and whether it fits."""

    seq: int
    four_bit: bool
    checkpointing: bool
    chunk: int
    micro_batch: int
    utilization: float
    estimates: dict[str, float]
    kv_tokens: int
    problem: str  # '' when it fits


def plan_request(request: Request) -> Plan:
    check_request(request)
    if request.gpus is None or request.placement == "cpu":
        return _cpu_plan(request)
    layout = _layout(request)
    found = _search(request, layout)
    if found is not None:
        return _plan(request, layout, found)
    failed = _trial(
        request,
        layout,
        request.max_seq_len or min(request.shape.context, MIN_SEQ_LEN),
        bool(request.load_in_4bit),
        request.gradient_checkpointing is not False,
        micro_batch=request.micro_batch_tokens
        or min(DEFAULT_MICRO_BATCH_TOKENS, request.max_seq_len or request.shape.context),
    )
    nearest = _nearest(request)
    gpus = request.gpus
    message = (
        f"{request.name} does not fit on {gpus.count} × {gpus.memory_gib:.1f} GiB with these settings: {failed.problem}"
        + (f". Nearest plan that fits: {_summary(nearest)}" if nearest else ". No plan fits these GPUs.")
    )
    raise PlanError(message, nearest)


def _layout(r: Request) -> Layout:
    """Which GPUs train and which serve; TP × replicas over the inference GPUs (checked against what was given)."""
    gpus = r.gpus
    assert gpus is not None
    everything = list(range(gpus.count))
    placement = r.placement or ("shared" if gpus.count == 1 else "dedicated")
    trainer, inference = r.trainer_gpu_ids, r.inference_gpu_ids
    if placement == "shared":
        inference = inference or ([0] if trainer is None else sorted(trainer))
        trainer = trainer or [inference[0]]
        if not set(trainer) <= set(inference):
            raise PlanError(
                f"shared placement: trainer GPUs {trainer} must be among the inference GPUs {inference} "
                "(a trainer on its own GPUs is the dedicated placement)"
            )
    else:
        if trainer is not None and inference is not None and set(trainer) & set(inference):
            raise PlanError(
                f"dedicated placement: trainer GPUs {trainer} and inference GPUs {inference} overlap on "
                f"{sorted(set(trainer) & set(inference))}; use placement='shared' to share a GPU"
            )
        if inference is None:
            rest = [i for i in everything if i not in (trainer or [])]
            if trainer is None:
                tp = r.tensor_parallel_size or _auto_tp(r, gpus.count - 1)
                if r.replicas is not None:
                    rest = rest[-tp * r.replicas :] if tp * r.replicas < len(rest) else rest
                else:  # the largest multiple of TP that leaves the trainer at least one GPU
                    rest = rest[len(rest) - (gpus.count - 1) // tp * tp :] if tp <= gpus.count - 1 else rest
                trainer = [i for i in everything if i not in rest][:1] or None
            inference = rest
        # not given: one GPU, the one-process trainer's (a sharded trainer is asked for with its GPU ids)
        trainer = trainer or [i for i in everything if i not in inference][:1]
        if not trainer or not inference:
            raise PlanError(
                f"dedicated placement needs GPUs for both: trainer {trainer}, inference {inference}"
            )
    tp, replicas = _tp_replicas(r, inference)
    return Layout(placement, sorted(trainer), sorted(inference), tp, replicas)


def _tp_replicas(r: Request, inference: list[int]) -> tuple[int, int]:
    n, heads = len(inference), r.shape.attention_heads
    if r.tensor_parallel_size is not None or r.replicas is not None:
        tp = r.tensor_parallel_size or (n // r.replicas if r.replicas and n % r.replicas == 0 else 0)
        replicas = r.replicas or (n // tp if tp and n % tp == 0 else 0)
        if tp * replicas != n:
            raise PlanError(
                f"tensor_parallel_size × replicas must equal the inference GPUs: "
                f"{r.tensor_parallel_size or '?'} × {r.replicas or '?'} ≠ {n} (GPUs {inference})"
            )
    else:
        tp = _auto_tp(r, n, divides=n)
        replicas = n // tp
    if heads % tp:
        raise PlanError(f"tensor_parallel_size {tp} must divide the model's {heads} attention heads")
    return tp, replicas


def _auto_tp(r: Request, gpus: int, divides: int = 0) -> int:
    """The smallest power of two (≤ gpus, dividing the attention heads, and `divides` when given) whose shard of
    the weights leaves vLLM room for MIN_KV_SEQUENCES sequences of max_seq_len (or of 4096 tokens)."""
    seq = r.max_seq_len or min(r.shape.context, PREFERRED_MIN_SEQ_LEN)
    sizes = [t for t in (1, 2, 4, 8, 16) if t <= max(gpus, 1) and r.shape.attention_heads % t == 0]
    sizes = [t for t in sizes if not divides or divides % t == 0] or [1]
    util = r.gpu_memory_utilization or MAX_UTILIZATION
    return next((t for t in sizes if _kv_tokens(r, t, util) >= MIN_KV_SEQUENCES * seq), sizes[-1])


# --- estimates -----------------------------------------------------------------------------------------------------


def _default_util(r: Request, placement: Placement) -> float:
    """Dedicated: 0.90. Shared: the card less what the offloaded trainer keeps (its process's CUDA context and
    workspace) and the safety margin (5%), at most 0.90 (vLLM's limit counts its whole process)."""
    if r.gpu_memory_utilization is not None:
        return r.gpu_memory_utilization
    if placement == "dedicated":
        return MAX_UTILIZATION
    total = r.gpus.memory_gib if r.gpus else 0.0
    left = mem.usable_gib(total) - mem.CUDA_CONTEXT_GIB - mem.CUBLAS_WORKSPACE_GIB
    return math.floor(min(MAX_UTILIZATION, max(left, 0.0) / total) * 1000) / 1000 if total else 0.0


def _kv_tokens(r: Request, tp: int, util: float) -> int:
    total = r.gpus.memory_gib if r.gpus else 0.0
    kv_gib = util * total - mem.vllm_weights_gib(r.shape, tp) - mem.VLLM_OVERHEAD_GIB
    return max(0, int(kv_gib * mem.GIB // mem.kv_bytes_per_token(r.shape, tp)))


def _trial(
    r: Request,
    layout: Layout,
    seq: int,
    four_bit: bool,
    checkpointing: bool = True,
    chunk: int | None = None,
    micro_batch: int | None = None,
) -> Trial:
    """The estimates of one candidate, and the first reason it does not fit ('' when it fits)."""
    gpus, shape = r.gpus, r.shape
    assert gpus is not None
    chunk = chunk or r.logprob_chunk_tokens or CHUNK_CANDIDATES[-1]
    micro_batch = micro_batch or r.micro_batch_tokens or MIN_MICRO_BATCH_TOKENS
    peak_tokens = max(micro_batch, seq)
    ranks = len(layout.trainer)  # >1 (trainer GPUs given): the sharded trainer splits weights and LoRA state
    e: dict[str, float] = {}
    width = mem.BF16 if _has_bf16(gpus) else 4  # pre-Ampere: the trainer trains in fp32 (no fp16 steps)
    e["trainer_weights"] = (
        mem.trainer_weights_gib(shape, bytes_per_param=width, load_in_4bit=four_bit) / ranks
    )
    e["lora_optimizer"] = mem.lora_state_gib(shape, r.lora_rank) / ranks
    e["activations"] = mem.TRANSIENT_MARGIN * mem.activation_gib(
        shape, peak_tokens, checkpointing=checkpointing
    )
    e["logits"] = mem.TRANSIENT_MARGIN * mem.logits_gib(shape, min(chunk, peak_tokens))
    e["trainer_overhead"] = mem.CUDA_CONTEXT_GIB + mem.CUBLAS_WORKSPACE_GIB
    shared = layout.placement == "shared"
    if shared:
        e["vllm_asleep"] = mem.VLLM_ASLEEP_GIB
    e["training_total"] = sum(e.values())
    util = _default_util(r, layout.placement)
    e["vllm_weights"] = mem.vllm_weights_gib(shape, layout.tp)
    e["vllm_overhead"] = mem.VLLM_OVERHEAD_GIB
    e["inference_total"] = util * gpus.memory_gib
    e["kv_cache"] = e["inference_total"] - e["vllm_weights"] - e["vllm_overhead"]
    if shared:
        e["trainer_offloaded"] = e["trainer_overhead"]
        e["inference_phase_total"] = e["inference_total"] + e["trainer_offloaded"]
    e["gpu_memory"] = gpus.memory_gib
    e["usable"] = mem.usable_gib(gpus.memory_gib)
    kv_tokens = _kv_tokens(r, layout.tp, util)
    problem = ""
    asleep = f", vLLM asleep {mem.VLLM_ASLEEP_GIB:.1f}" if shared else ""
    if e["training_total"] > e["usable"]:
        problem = (
            f"the training step needs {e['training_total']:.1f} GiB (base {e['trainer_weights']:.1f}, "
            f"activations {e['activations']:.1f}, logits {e['logits']:.1f}, LoRA+AdamW {e['lora_optimizer']:.1f}, "
            f"CUDA {e['trainer_overhead']:.1f}{asleep}) "
            f"of {e['usable']:.1f} GiB usable, at max_seq_len {seq} and {micro_batch}-token micro-batches"
        )
    elif shared and e["inference_phase_total"] > e["usable"]:
        problem = (
            f"vLLM's share ({util:.2f} × {gpus.memory_gib:.1f} GiB) plus the offloaded trainer's "
            f"{e['trainer_offloaded']:.1f} GiB exceeds the {e['usable']:.1f} GiB usable"
        )
    elif kv_tokens < MIN_KV_SEQUENCES * seq:
        problem = (
            f"vLLM's KV cache holds {kv_tokens:,} tokens ({max(e['kv_cache'], 0):.1f} GiB after "
            f"{e['vllm_weights']:.1f} GiB of weights per GPU at TP {layout.tp}), fewer than "
            f"{MIN_KV_SEQUENCES} × max_seq_len {seq} = {MIN_KV_SEQUENCES * seq:,}"
        )
    rounded = {k: round(v, 2) for k, v in e.items()}
    return Trial(seq, four_bit, checkpointing, chunk, micro_batch, util, rounded, kv_tokens, problem)


# --- the search ----------------------------------------------------------------------------------------------------


def _micro_batches(r: Request, seq: int, floor: int) -> list[int]:
    if r.micro_batch_tokens is not None:
        return [r.micro_batch_tokens]
    cap = r.tokens_per_step or max(DEFAULT_MICRO_BATCH_TOKENS, seq)
    sizes = [cap] + [2**k for k in range(30, 0, -1) if 2**k < cap]
    return [s for s in sizes if s >= min(floor, cap)]


def _trainer_fit(r: Request, layout: Layout, seq: int, four_bit: bool) -> Trial | None:
    """Checkpointing off if a forward of max(seq, 4096 tokens) fits without it; the largest chunk and then the
    largest micro-batch (≤ tokens_per_step) that fit."""
    default_mb = min(r.tokens_per_step or DEFAULT_MICRO_BATCH_TOKENS, DEFAULT_MICRO_BATCH_TOKENS)
    checkpointing = [False, True] if r.gradient_checkpointing is None else [r.gradient_checkpointing]
    chunks = CHUNK_CANDIDATES if r.logprob_chunk_tokens is None else (r.logprob_chunk_tokens,)
    for ckpt in checkpointing:
        for chunk in chunks:
            floor = MIN_MICRO_BATCH_TOKENS if ckpt else default_mb
            for micro_batch in _micro_batches(r, seq, floor):
                trial = _trial(r, layout, seq, four_bit, ckpt, chunk, micro_batch)
                if not trial.problem:
                    return trial
    return None


def _has_bf16(gpus: GPUs) -> bool:
    """bf16 is native from compute capability 8.0 (Ampere); below it the trainer takes fp32 steps (torch's bf16
    there is emulated, Unsloth would switch it to fp16, and this trainer takes no loss-scaled fp16 steps)."""
    return gpus.capability >= (8, 0)


def _search(r: Request, layout: Layout) -> Trial | None:
    """16-bit before 4-bit, longer max_seq_len before shorter: first the model's context down to 4096 tokens
    (16-bit, then 4-bit), then on down to 1024 tokens."""
    four_bits = [False, True] if r.load_in_4bit is None else [r.load_in_4bit]
    if r.gpus is not None and not _has_bf16(r.gpus):  # a 4-bit base computes in half precision: not there
        four_bits = [False]
    if len(r.trainer_gpu_ids or []) > 1:  # the sharded trainer (PEFT under FSDP2) loads no 4-bit base
        four_bits = [False]
    target = r.max_seq_len or r.shape.context
    floors = (
        [target]
        if r.max_seq_len
        else sorted({min(PREFERRED_MIN_SEQ_LEN, target), min(MIN_SEQ_LEN, target)})[::-1]
    )
    for floor in floors:
        for four_bit in four_bits:
            found = _longest(r, layout, four_bit, floor, target)
            if found is not None:
                return found
    return None


def _longest(r: Request, layout: Layout, four_bit: bool, floor: int, target: int) -> Trial | None:
    """The longest max_seq_len in [floor, target] that fits (target itself, else a multiple of 1024)."""
    best = _trainer_fit(r, layout, target, four_bit)
    if best is not None or floor >= target:
        return best
    low, high = math.ceil(floor / 1024), (target - 1) // 1024  # in units of 1024 tokens
    while low <= high:
        middle = (low + high) // 2
        trial = _trainer_fit(r, layout, middle * 1024, four_bit)
        if trial is not None:
            best, low = trial, middle + 1
        else:
            high = middle - 1
    return best


def _nearest(r: Request) -> Plan | None:
    """The request with its constraints let go one group at a time: the base's dtype, then the trainer's
    memory knobs, then max_seq_len, then vLLM's share, then the layout."""
    groups = [
        {"load_in_4bit": None},
        {"gradient_checkpointing": None, "logprob_chunk_tokens": None, "micro_batch_tokens": None},
        {"max_seq_len": None, "tokens_per_step": None},
        {"gpu_memory_utilization": None},
        {"tensor_parallel_size": None, "replicas": None, "trainer_gpu_ids": None, "inference_gpu_ids": None},
        {"placement": None},
    ]
    relaxed = r
    for group in groups:
        relaxed = replace(relaxed, **group)
        try:
            layout = _layout(relaxed)
        except PlanError:
            continue
        found = _search(relaxed, layout)
        if found is not None:
            return _plan(relaxed, layout, found)
    return None


def _summary(plan: Plan | None) -> str:
    if plan is None:
        return "none"
    base = "4-bit" if plan.load_in_4bit else plan.trainer_dtype
    return (
        f"{plan.placement}, {base} trainer, max_seq_len {plan.max_seq_len}, "
        f"checkpointing {'on' if plan.gradient_checkpointing else 'off'}, {plan.micro_batch_tokens}-token "
        f"micro-batches, TP {plan.tensor_parallel_size} × {plan.replicas} (training phase "
        f"{plan.estimates_gib.get('training_total', 0):.1f} of {plan.gpu_memory_gib:.1f} GiB)"
    )


# --- the plan --------------------------------------------------------------------------------------------------------


def _plan(r: Request, layout: Layout, t: Trial) -> Plan:
    gpus = r.gpus
    assert gpus is not None
    fp32 = not _has_bf16(gpus)
    notes = []
    if layout.placement == "shared":
        notes.append(
            "shared: vLLM sleeps (level 1) while the trainer steps; the trainer waits in CPU memory while vLLM serves"
        )
    else:
        notes.append(
            f"dedicated: trainer on GPU(s) {layout.trainer}, vLLM on {layout.inference} as {layout.replicas} "
            f"replica(s) of TP {layout.tp}; no sleep mode"
        )
    if t.seq < r.shape.context and r.max_seq_len is None:
        notes.append(f"max_seq_len capped at {t.seq} from the model's {r.shape.context} by what fits")
    if fp32:
        notes.append(
            f"capability {gpus.capability[0]}.{gpus.capability[1]} has no bf16: the trainer takes fp32 steps "
            "(no loss-scaled fp16 steps; no 4-bit base)"
        )
    if t.four_bit and r.load_in_4bit is None:
        notes.append("4-bit trainer base: a 16-bit one does not fit (vLLM still serves the 16-bit weights)")
    if t.checkpointing and r.gradient_checkpointing is None:
        notes.append(
            f"gradient checkpointing: a forward of {max(t.seq, t.micro_batch):,} tokens does not fit without it"
        )
    return Plan(
        model=r.name,
        placement=layout.placement,
        gpu_count=gpus.count,
        gpu_memory_gib=round(gpus.memory_gib, 2),
        gpu_name=gpus.name,
        trainer_gpu_ids=layout.trainer,
        inference_gpu_ids=layout.inference,
        tensor_parallel_size=layout.tp,
        replicas=layout.replicas,
        gpu_memory_utilization=t.utilization,
        enable_sleep_mode=layout.placement == "shared",
        kv_cache_tokens=t.kv_tokens,
        max_seq_len=t.seq,
        trainer_dtype="float32" if fp32 else "bfloat16",
        loss_scaling=False,
        load_in_4bit=t.four_bit,
        gradient_checkpointing=t.checkpointing,
        logprob_chunk_tokens=t.chunk,
        micro_batch_tokens=t.micro_batch,
        offload_trainer=layout.placement == "shared",
        estimates_gib=t.estimates,
        notes=notes,
    )


def _cpu_plan(r: Request) -> Plan:
    seq = r.max_seq_len or r.shape.context
    micro_batch = r.micro_batch_tokens or min(
        r.tokens_per_step or DEFAULT_MICRO_BATCH_TOKENS, DEFAULT_MICRO_BATCH_TOKENS
    )
    chunk = r.logprob_chunk_tokens or CHUNK_CANDIDATES[0]
    ckpt = bool(r.gradient_checkpointing)
    peak = max(seq, micro_batch)
    estimates = {
        "host_weights": mem.trainer_weights_gib(r.shape, bytes_per_param=mem.FP32, load_in_4bit=False),
        "lora_optimizer": mem.lora_state_gib(r.shape, r.lora_rank),
        "activations": mem.activation_gib(r.shape, peak, checkpointing=ckpt, element_bytes=mem.FP32),
        "logits": mem.logits_gib(r.shape, min(chunk, peak)),
    }
    return Plan(
        model=r.name,
        placement="cpu",
        max_seq_len=seq,
        trainer_dtype="float32",
        gradient_checkpointing=ckpt,
        logprob_chunk_tokens=chunk,
        micro_batch_tokens=micro_batch,
        estimates_gib={k: round(v, 2) for k, v in estimates.items()},
        notes=["cpu: no GPU; the trainer runs in float32 and vLLM on the CPU"],
    )
