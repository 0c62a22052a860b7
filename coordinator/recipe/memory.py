"""GPU memory each service of a recipe takes, estimated before anything starts (fits.py checks it against the GPUs
and names the setting to change; `meshrl memory` prints it).

Arithmetic over the model's shape (model_shape.py: config.json and safetensors headers): no torch.
An estimate, not a measurement: allocator fragmentation, torch.compile's and CUDA graphs' own pools and the
libraries' workspaces come on top, which is why a GPU is full at FIT_FRACTION of its memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from coordinator.recipe.model_shape import ModelShape, model_shape
from services.common.auto import is_auto
from services.rollout.config import AUTO_KV_PROMPT_TOKENS, AUTO_MAX_BATCH_SIZE, auto_kv_pool_tokens
from services.rollout.types import bucket_batch, bucket_len

GIB = 2**30
# What one process's CUDA context, cuBLAS workspaces and allocator slack take before any tensor.
CUDA_CONTEXT_BYTES = GIB // 2
# A GPU counts as full past this share of its memory (the estimate leaves fragmentation and workspaces out).
FIT_FRACTION = 0.95
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The fused LM head's fp32 [rows, vocab] chunk (services/common/tensors/fused.py CHUNK_BYTES).
FUSED_CHUNK_BYTES = 256 * 2**20
# Prompt length assumed when data.max_prompt_length is unset (the KV cache's length bucket is 256 tokens).
DEFAULT_PROMPT_TOKENS = 256
# vLLM takes this share of the whole GPU unless rollout.gpu_memory_utilization says otherwise
# (services/rollout/engine_vllm/engine.py GPU_MEMORY_UTILIZATION).
VLLM_UTILIZATION = 0.9
# The paged KV pool's auto cap, a share of free CUDA memory (engine_torch/paged/kv.py CUDA_AUTO_SHARE: needs torch).
PAGED_AUTO_SHARE = 0.5
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# engine_torch/lora.py's GROUPS (not imported: that module needs torch): layers whose adapters share one A and one
# block-diagonal B.
LORA_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass
class Estimate:
    """One process's estimated memory on one GPU, by part."""

    service: str                                  # "trainer", "trainer rank 1", "rollout 0", "reference 0", ...
    gpu: str                                      # "cuda:0": the index among the GPUs `meshrl up` sees
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        parts = ", ".join(f"{name} {gib(n)}" for name, n in self.parts.items() if n >= GIB // 20)
        return f"{self.service} {gib(self.total)} GiB: {parts}"


def gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def _gpu(device: str, devices: str, rank: int = 0) -> str | None:
    """The GPU a process of `device` (model.device) and `devices` (its CUDA_VISIBLE_DEVICES, "" = inherit) uses;
    None on CPU."""
    if not device.startswith("cuda"):
        return None
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    index += rank
    ids = [d.strip() for d in devices.split(",") if d.strip()]
    return f"cuda:{ids[min(index, len(ids) - 1)] if ids else index}"


def _activation_bytes_per_token_layer(s: ModelShape, compute: int, residual: int) -> int:
    """What one decoder block keeps for backward per token: two RMSNorms (fp32 input and output; `residual`
    bytes is the residual stream's, fp32 under autocast), q/k/v after rotary and the attention output
    (flash/SDPA: no [T, T] scores), the MLP's gate, up, SiLU and product."""
    norms = 2 * (4 * s.hidden + residual * s.hidden + compute * s.hidden)
    attn = compute * (3 * s.hidden + 2 * s.kv_heads * s.head_dim)
    mlp = 4 * compute * s.intermediate
    return norms + attn + mlp


def _activations(cfg, s: ModelShape, tokens: int, compute: int, residual: int) -> tuple[int, str]:
    """Activation memory of one micro-batch of `tokens` on one rank, and how it was counted."""
    a = cfg.actor
    per_layer = _activation_bytes_per_token_layer(s, compute, residual)
    layers = -(-s.layers // a.pp_size)
    if a.activation_checkpointing == "full":
        kept = len(range(0, layers, a.activation_checkpointing_every))
        # Checkpointed blocks keep their input; the others keep everything; one block is recomputed at a time.
        per_token = kept * residual * s.hidden + (layers - kept) * per_layer + per_layer
        how = "activations (checkpointed)"
    elif a.activation_checkpointing == "selective":
        # Matmul and attention outputs kept, norms and activations recomputed.
        kept = residual * s.hidden + compute * (5 * s.hidden + 2 * s.kv_heads * s.head_dim + 2 * s.intermediate)
        per_token = layers * kept + per_layer
        how = "activations (selective checkpointing)"
    else:
        per_token = layers * per_layer
        how = "activations"
    return tokens * per_token // a.tp_size + FUSED_CHUNK_BYTES, how


def _micro_batch_tokens(cfg, prompt: int) -> int:
    """Tokens of the trainer's largest micro-batch: the token budget, at most a step's rows (a sequence longer
    than the budget runs alone)."""
    seq = prompt + cfg.rollout.max_tokens
    rows = cfg.data.rollout_batch_size * cfg.rollout.n
    return max(seq, min(cfg.actor.micro_batch_token_budget, rows * seq))


def _prompt_tokens(cfg) -> int:
    return cfg.data.max_prompt_length or DEFAULT_PROMPT_TOKENS


def _transport(cfg, trainer_gpu: str | None, rollout_gpus: list[str | None]) -> str:
    """weight_sync.transport as `auto` resolves it: ipc for a replica on the trainer's GPU, nccl on another
    GPU, grpc for a CPU side."""
    t = cfg.weight_sync.transport
    if not is_auto(t):
        return t
    if trainer_gpu is None or not any(rollout_gpus):
        return "grpc"
    return "ipc" if trainer_gpu in rollout_gpus else "nccl"


def trainer_estimates(cfg, trainer_devices: str, rollout_gpus: list[str | None]) -> list[Estimate]:
    """One estimate per trainer rank on a GPU (none on CPU)."""
    from services.trainer.config import master_and_compute_dtypes

    a, m = cfg.actor, cfg.model
    world = cfg.trainer.nproc_per_node
    gpus = [_gpu(m.device, trainer_devices, r) for r in range(world)]
    if gpus[0] is None:
        return []
    s = model_shape(a.model_path or m.path)
    param_dtype, compute_dtype = master_and_compute_dtypes(a, m.dtype)
    p, c = DTYPE_BYTES[param_dtype], DTYPE_BYTES[compute_dtype]
    fsdp = a.dp_mode == "fsdp" and a.dp_size > 1
    shard = a.tp_size * a.pp_size * (a.dp_size if fsdp else 1)
    n = s.num_params
    synced = n                   # parameters one push stages: the adapter alone where the replicas serve adapters
    parts: dict[str, int] = {}
    if a.lora is None:
        parts[f"{param_dtype} weights"] = n * p // shard
        parts["gradients"] = n * p // shard
        parts["AdamW state"] = 2 * n * p // shard
        if p != c and not fsdp:   # autocast keeps a compute-dtype copy of every weight through forward + backward
            parts[f"{compute_dtype} autocast copy"] = n * c // (a.tp_size * a.pp_size)
    else:
        base = DTYPE_BYTES[m.dtype]
        shapes = s.linear_shapes()
        adapter = s.layers * sum(a.lora.rank * (i + o) for name, (i, o) in shapes.items()
                                 if name in a.lora.target_modules)
        parts[f"{m.dtype} frozen base"] = n * base // shard
        parts[f"LoRA rank {a.lora.rank} adapters + AdamW"] = 4 * adapter * p // shard
        if _serves_adapters(cfg):
            synced = adapter
    residual = 4 if (p != c and a.lora is None) or c == 4 else c
    acts, how = _activations(cfg, s, _micro_batch_tokens(cfg, _prompt_tokens(cfg)), c, residual)
    parts[how] = acts
    transport = _transport(cfg, gpus[0], rollout_gpus)
    sync = DTYPE_BYTES[a.weight_sync_dtype or m.dtype]
    out = []
    for rank, gpu in enumerate(gpus):
        own = dict(parts)
        if rank == 0 and transport == "ipc":
            own["ipc weight staging"] = synced * sync  # the whole payload, shared with the replicas on this GPU
        elif rank == 0 and transport == "nccl":
            own["nccl staging"] = 2 * cfg.weight_sync.device_bucket_bytes
        own["CUDA context"] = CUDA_CONTEXT_BYTES
        out.append(Estimate("trainer" if world == 1 else f"trainer rank {rank}", gpu, own))
    return out


def rollout_estimate(cfg, index: int, devices: str, num_replicas: int, gpu_bytes: int | None) -> Estimate | None:
    r, m = cfg.rollout, cfg.model
    gpu = _gpu(m.device, devices)
    if gpu is None or r.engine == "openai":
        return None
    s = model_shape(m.path)
    b = DTYPE_BYTES[m.dtype]
    parts = {f"{m.dtype} weights": s.num_params * b}
    prompt = _prompt_tokens(cfg)
    if r.engine == "vllm":
        if r.kv_cache_gib is not None:
            parts["vLLM KV cache (rollout.kv_cache_gib)"] = int(r.kv_cache_gib * GIB)
        elif gpu_bytes:
            share = r.gpu_memory_utilization or VLLM_UTILIZATION
            parts = {f"vLLM gpu_memory_utilization {share}": int(share * gpu_bytes)}
    else:
        paged = keeps_paged_pool(cfg)                                       # a block pool instead of that cache
        name, kv, batch, graphs = static_kv_cache(cfg, s, b, num_replicas)
        if not paged:
            parts[name] = kv
        parts["decode logits"] = batch * s.vocab * (b if graphs else 4)
        # Prefill: one forward over the distinct prompts, the last position's logits only.
        prompts = min(batch, -(-cfg.data.rollout_batch_size // num_replicas))
        parts["prefill"] = prompts * prompt * (2 * s.hidden + 2 * s.intermediate) * b
        if r.engine == "torch":
            parts.update(_adapter_slots(cfg, s, b))
        if paged:
            parts.update(_paged_pool(cfg, s, b, sum(parts.values()) + CUDA_CONTEXT_BYTES, gpu_bytes))
    parts["CUDA context"] = CUDA_CONTEXT_BYTES
    return Estimate(f"rollout {index}", gpu, parts)


def static_kv_cache(cfg, s: ModelShape, b: int, num_replicas: int) -> tuple[str, int, int, bool]:
    """(part name, bytes, rows, CUDA graphs) of the KV cache the torch engine (kv_cache none) or vLLM's budget
    stand-in allocates for a replica's share of a step."""
    r = cfg.rollout
    prompt = _prompt_tokens(cfg)
    graphs = (r.engine == "torch") if is_auto(r.cuda_graphs) else bool(r.cuda_graphs)
    cap = AUTO_MAX_BATCH_SIZE[graphs] if is_auto(r.max_batch_size) else r.max_batch_size
    # Whole groups go to one replica: a replica's share of a step's rows.
    rows = -(-cfg.data.rollout_batch_size // num_replicas) * r.n
    if graphs:
        batch = bucket_batch(min(rows, cap), cap)
        length = bucket_len(prompt + (2 * r.max_tokens if r.continuous_batching else r.max_tokens))
    else:
        batch, length = min(rows, cap), prompt + r.max_tokens
    return f"KV cache ({batch} rows x {length} tokens)", batch * length * s.kv_bytes_per_token(b), batch, graphs


def keeps_paged_pool(cfg) -> bool:
    """Whether the torch engine keeps the paged KV cache: kv_cache paged, or auto (on CUDA, where this estimate runs,
    unless cuda_graphs: true asks for the unpaged decoder: speed.py's _resolve_paged)."""
    r = cfg.rollout
    return r.engine == "torch" and (r.kv_cache == "paged" or is_auto(r.kv_cache) and r.cuda_graphs is not True)


def _paged_pool(cfg, s: ModelShape, b: int, others: int, gpu_bytes: int | None) -> dict[str, int]:
    """The torch engine's paged KV block pool: rollout.kv_cache_gib, or auto: room for max_batch_size rows
    (rollout/config.py auto_kv_pool_tokens), at most PAGED_AUTO_SHARE of the CUDA memory free at start, counted as
    that share of what the replica's other parts (`others`) leave of the GPU (others may not have allocated yet)."""
    r = cfg.rollout
    if r.kv_cache_gib is not None:
        return {"paged KV pool (rollout.kv_cache_gib)": int(r.kv_cache_gib * GIB)}
    rows = AUTO_MAX_BATCH_SIZE[True] if is_auto(r.max_batch_size) else r.max_batch_size
    pool = auto_kv_pool_tokens(rows, r.max_tokens, r.max_model_len) * s.kv_bytes_per_token(b)
    name = f"auto: {rows} rows of {AUTO_KV_PROMPT_TOKENS} + 2 x {r.max_tokens} tokens"
    if gpu_bytes and (cap := int(PAGED_AUTO_SHARE * max(0, gpu_bytes - others))) < pool:
        pool, name = cap, f"{name}, at most {PAGED_AUTO_SHARE:.0%} of the memory free at start"
    return {f"paged KV pool ({name})": pool}


def _enable_lora(cfg) -> bool:
    """rollout.enable_lora as the torch engine resolves it (auto: on with actor.lora)."""
    r = cfg.rollout
    return (cfg.actor.lora is not None) if is_auto(r.enable_lora) else bool(r.enable_lora)


def _serves_adapters(cfg) -> bool:
    """Whether the rollout replicas serve LoRA adapters, so a LoRA run's pushes carry the adapter alone
    (services/trainer/weights/adapter.py): torch with enable_lora, vllm with vllm_engine_args.enable_lora."""
    r = cfg.rollout
    if r.engine == "vllm":
        return bool((r.vllm_engine_args or {}).get("enable_lora"))
    return r.engine == "torch" and _enable_lora(cfg)


def _adapter_slots(cfg, s: ModelShape, b: int) -> dict[str, int]:
    """The torch engine's stacked adapter buffers when rollout.enable_lora resolves on (auto: with actor.lora), as
    engine_torch/lora.py build_bank resolves them: per target layer A_cat [(max_loras + 1) * max_rank, in], and per
    group of k targeted layers (q/k/v, gate/up, any other alone) one block-diagonal B [sum of the group's out,
    k * (max_loras + 1) * max_rank], in the model's dtype (slot 0 is the base's zeros), allocated at start."""
    r, lora = cfg.rollout, cfg.actor.lora
    if not _enable_lora(cfg):
        return {}
    rank = (lora.rank if lora is not None else 16) if is_auto(r.max_lora_rank) else r.max_lora_rank
    targets = r.lora_target_modules or (lora.target_modules if lora is not None else LORA_TARGETS)
    shapes = s.linear_shapes()
    per_layer = sum(i for name, (i, _) in shapes.items() if name in targets)
    for group in LORA_GROUPS + tuple((n,) for n in shapes if not any(n in g for g in LORA_GROUPS)):
        per_layer += sum(shapes[n][1] for n in group) * sum(n in targets for n in group)
    return {f"LoRA adapter slots ({r.max_loras} x rank <= {rank})": s.layers * per_layer * (r.max_loras + 1) * rank * b}


def reference_estimate(cfg, index: int, devices: str) -> Estimate | None:
    ref, m = cfg.reference, cfg.model
    gpu = _gpu(ref.device or m.device, devices)
    if gpu is None:
        return None
    s = model_shape(ref.model_path or m.path)
    dtype = ref.dtype or m.dtype
    b = DTYPE_BYTES[dtype]
    tokens = min(ref.micro_batch_token_budget,
                 cfg.data.rollout_batch_size * cfg.rollout.n * (_prompt_tokens(cfg) + cfg.rollout.max_tokens))
    # No-grad forward: one block's hidden states, q/k/v and MLP intermediates live at a time.
    work = tokens * (3 * s.hidden + 2 * s.kv_heads * s.head_dim + 3 * s.intermediate) * b + FUSED_CHUNK_BYTES
    return Estimate(f"reference {index}", gpu, {f"{dtype} weights": s.num_params * b, "forward working set": work,
                                                "CUDA context": CUDA_CONTEXT_BYTES})


def reward_estimate(cfg, index: int, devices: str) -> Estimate | None:
    """Reward models on a GPU (rule functions take none)."""
    parts: dict[str, int] = {}
    gpu = None
    for components in cfg.reward.component_lists().values():
        for comp in components:
            params = comp.params or {}
            if comp.name not in ("model", "embedding") or not params.get("path"):
                continue
            device = params.get("device", "cpu")
            if not str(device).startswith("cuda"):
                continue
            gpu = _gpu(str(device), devices)
            b = DTYPE_BYTES[params.get("dtype", "float32")]
            try:
                n = model_shape(params["path"]).num_params
            except (ValueError, KeyError):
                continue
            parts[f"reward model {Path(params['path']).name}"] = n * b
    if gpu is None:
        return None
    parts["CUDA context"] = CUDA_CONTEXT_BYTES
    return Estimate(f"reward {index}", gpu, parts)


def estimate(cfg, placement: Mapping[str, Sequence[str]], trainer_devices: str = "",
             gpu_bytes: int | None = None) -> list[Estimate]:
    """Every GPU process of the recipe with its estimate; `placement` is `meshrl up`'s (coordinator/cli/runs.py
    _placement): each role's replicas' `devices`. gpu_bytes sizes vLLM's share of a GPU, when known."""
    rollout = list(placement.get("rollout", []))
    rollout_gpus = [_gpu(cfg.model.device, d) for d in rollout]
    out = trainer_estimates(cfg, trainer_devices, rollout_gpus)
    out += [rollout_estimate(cfg, i, d, len(rollout), gpu_bytes) for i, d in enumerate(rollout)]
    out += [reference_estimate(cfg, i, d) for i, d in enumerate(placement.get("reference", []))]
    out += [reward_estimate(cfg, i, d) for i, d in enumerate(placement.get("reward", []))]
    return [e for e in out if e is not None]


def by_gpu(estimates: list[Estimate]) -> dict[str, list[Estimate]]:
    out: dict[str, list[Estimate]] = {}
    for e in estimates:
        out.setdefault(e.gpu, []).append(e)
    return out


def memory_of(gpu_bytes: int | Sequence[int] | Mapping[str, int] | None, gpu: str) -> int | None:
    """The memory of `gpu` ("cuda:1"): gpu_bytes is one size for every GPU, each GPU's by index, or None."""
    if gpu_bytes is None:
        return None
    if isinstance(gpu_bytes, int):
        return gpu_bytes
    if isinstance(gpu_bytes, Mapping):
        return gpu_bytes.get(gpu)
    index = int(gpu.split(":")[1])
    return gpu_bytes[index] if index < len(gpu_bytes) else None
