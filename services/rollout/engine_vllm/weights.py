"""Weight swaps inside the vLLM worker: pure functions over the worker's torch model, and the worker extension.

vLLM fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, pads the vocabulary, and on CPU repacks
every linear weight into a kernel format and drops the original tensor (so a plain `model.load_weights`
fails halfway there). So the trainer's Hugging Face names are mapped onto vLLM's parameters here (the
model's `packed_modules_mapping`), every shape is checked before anything is touched, the new packed CPU
kernels are built beside the old ones, and only then swapped in, with a backup restored if anything fails.
`WeightSwapExtension` is mixed into vLLM's worker by `worker_extension_cls` and called by name with
`collective_rpc`. No vLLM imports except the CPU GEMM dispatch, which is passed in.
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import torch

from services.common.tensors.codec import dtype_from_name, dtype_name, tensor_bytes, tensor_from_bytes

log = logging.getLogger("meshrl.rollout.vllm")


@dataclass
class Target:
    """One vLLM parameter and the Hugging Face tensors that fill it, concatenated along dim 0."""

    module: str
    param: str
    parts: list[str | None]


def plan_update(model: torch.nn.Module, hf_names: Iterable[str]) -> dict[str, Target]:
    """Maps trainer-side (HF) tensor names onto the vLLM model's parameters.

    `packed_modules_mapping` is the model's own list of fused layers ({"qkv_proj": ["q_proj", "k_proj",
    "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]} for Llama/Qwen2); with one worker a fused
    weight is its parts stacked in that order, as vLLM's load_weights stacks them.
    """
    packed = getattr(model, "packed_modules_mapping", None) or {}
    shard_of = {member: (fused, i) for fused, members in packed.items() for i, member in enumerate(members)}
    targets: dict[str, Target] = {}
    for name in hf_names:
        module_path, _, pname = name.rpartition(".")
        parent, _, leaf = module_path.rpartition(".")
        if leaf in shard_of:
            fused, i = shard_of[leaf]
            module = f"{parent}.{fused}" if parent else fused
            t = targets.setdefault(f"{module}.{pname}", Target(module, pname, [None] * len(packed[fused])))
            t.parts[i] = name
        else:
            targets[name] = Target(module_path, pname, [name])
    return targets


def _full_shape(module: torch.nn.Module, param: torch.Tensor) -> tuple[int, ...]:
    """The shape a parameter has in checkpoint layout; a CPU-packed linear keeps an empty placeholder."""
    if param.numel() == 0 and hasattr(module, "output_size_per_partition"):
        return (int(module.output_size_per_partition), int(module.input_size_per_partition))
    return tuple(param.shape)


def _is_vocab_padded(module: torch.nn.Module) -> bool:
    return hasattr(module, "num_embeddings_padded")     # VocabParallelEmbedding / ParallelLMHead


def check_plan(model: torch.nn.Module, targets: Mapping[str, Target],
               shapes: Mapping[str, Sequence[int]]) -> list[str]:
    """Problems that would stop an update with tensors of these HF shapes: the first ones, named."""
    problems: list[str] = []
    covered: set[int] = set()
    for key, t in targets.items():
        if None in t.parts:
            present = [p for p in t.parts if p is not None]
            problems.append(f"weights: {present[0]!r} is one part of vLLM's fused {key!r}, but the update lacks "
                            f"the others ({len(t.parts) - len(present)} missing)")
            continue
        try:
            module = model.get_submodule(t.module)
        except AttributeError:
            problems.append(f"weights: no vLLM module {t.module!r} for tensor {t.parts[0]!r}")
            continue
        param = getattr(module, t.param, None)
        if not isinstance(param, torch.Tensor):
            problems.append(f"weights: no vLLM parameter {key!r} for tensor {t.parts[0]!r}")
            continue
        covered.add(id(param))
        want = _full_shape(module, param)
        part_shapes = [tuple(shapes[p]) for p in t.parts]
        if any(s[1:] != part_shapes[0][1:] for s in part_shapes) or not part_shapes[0]:
            problems.append(f"weights: the parts of vLLM's {key!r} ({', '.join(t.parts)}) have shapes "
                            f"{[list(s) for s in part_shapes]} that do not stack along dim 0")
            continue
        sizes = getattr(module, "output_sizes", None)     # vLLM's fused linears know each part's rows
        if len(t.parts) > 1 and sizes is not None and len(sizes) == len(t.parts) and param.dim() <= 2:
            bad = [(p, s[0], int(n)) for p, s, n in zip(t.parts, part_shapes, sizes) if s[0] != int(n)]
            if bad:
                name, rows, want_rows = bad[0]
                problems.append(f"weights: tensor {name!r} has {rows} rows, vLLM's fused {key!r} expects "
                                f"{want_rows} from it")
                continue
        got = (sum(s[0] for s in part_shapes), *part_shapes[0][1:])
        padded_ok = _is_vocab_padded(module) and got[0] <= want[0] and got[1:] == want[1:]
        if got != want and not padded_ok:
            problems.append(f"weights: tensor {t.parts[0]!r} maps to vLLM's {key!r} of shape {list(want)}, "
                            f"but the update gives {list(got)}")
        if param.numel() == 0 and not hasattr(module, "cpu_linear"):
            problems.append(f"weights: vLLM's {key!r} is empty and has no CPU kernel to rebuild")
    for name, p in model.named_parameters():
        if id(p) not in covered:
            problems.append(f"weights: vLLM parameter {name!r} gets no tensor from an update")
    return problems


def _cpu_dispatch():
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    return dispatch_cpu_unquantized_gemm


@torch.no_grad()
def swap_weights(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], *,
                 dispatch: Callable[[object, bool], None] | None = None) -> dict:
    """Copies HF-named tensors into the vLLM model all at once, or raises and leaves it as it was.

    1. plan and check every shape (ValueError naming the tensor, nothing touched yet);
    2. stage: the new value of every parameter, and for modules with a CPU kernel (`cpu_linear`) a
       new kernel built on a stand-in object from the new weight, the old kernel still in place;
    3. commit: in-place copies and attribute swaps, each with an undo; a failure undoes them all.
    """
    targets = plan_update(model, tensors)
    problems = check_plan(model, targets, {n: tuple(t.shape) for n, t in tensors.items()})
    if problems:
        raise ValueError(problems[0] + (f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""))
    staged = _stage_params(model, targets, tensors)
    kernels = _stage_kernels(model, {id(param): new for param, new in staged}, dispatch)
    _commit(staged, kernels)
    return {"num_params": len(staged), "num_kernels": len(kernels)}


def _stage_params(model: torch.nn.Module, targets: Mapping[str, Target],
                  tensors: Mapping[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(parameter, new value) of every target: parts stacked, cast and placed like the parameter."""
    staged = []
    for t in targets.values():
        module = model.get_submodule(t.module)
        param = getattr(module, t.param)
        parts = [tensors[p] for p in t.parts]
        new = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        new = new.to(device=param.device, dtype=param.dtype)
        if param.numel() and tuple(new.shape) != tuple(param.shape):        # padded vocabulary rows stay
            full = param.detach().clone()
            full[:new.shape[0]].copy_(new)
            new = full
        staged.append((param, new))
    return staged


def _stage_kernels(model: torch.nn.Module, new_of: Mapping[int, torch.Tensor],
                   dispatch: Callable[[object, bool], None] | None) -> list[tuple[torch.nn.Module, object, bool]]:
    """(module, stand-in holding the new CPU kernel, whether vLLM dropped the checkpoint-layout weight) of
    every CPU-kernel module whose weight changes; new_of maps id(parameter) to its new value."""
    kernels = []
    for module in model.modules():
        if not hasattr(module, "cpu_linear"):
            continue
        weight = getattr(module, "weight", None)
        new_weight = new_of.get(id(weight)) if weight is not None else None
        if new_weight is None:
            continue
        dispatch = dispatch or _cpu_dispatch()
        bias = getattr(module, "bias", None)
        shadow = types.SimpleNamespace(weight=torch.nn.Parameter(new_weight, requires_grad=False), bias=None)
        if isinstance(bias, torch.Tensor):
            shadow.bias = torch.nn.Parameter(new_of.get(id(bias), bias).detach().clone(), requires_grad=False)
        removed = weight.numel() == 0          # vLLM dropped the checkpoint-layout tensor after packing
        dispatch(shadow, removed)
        kernels.append((module, shadow, removed))
    return kernels


def _commit(staged: list[tuple[torch.Tensor, torch.Tensor]],
            kernels: list[tuple[torch.nn.Module, object, bool]]) -> None:
    """In-place copies and kernel swaps, each with an undo; a failure undoes them all before it propagates."""
    undo: list[Callable[[], None]] = []
    try:
        for param, new in staged:
            if param.numel() == 0:
                continue                                 # replaced with its kernel below
            backup = param.detach().clone()
            param.copy_(new)
            undo.append(lambda p=param, b=backup: p.copy_(b))
        for module, shadow, removed in kernels:
            if removed:
                old_weight = module.weight
                module.weight = shadow.weight
                undo.append(lambda m=module, w=old_weight: setattr(m, "weight", w))
            old_kernel = module.cpu_linear
            module.cpu_linear = shadow.cpu_linear
            undo.append(lambda m=module, k=old_kernel: setattr(m, "cpu_linear", k))
    except BaseException:
        for fn in reversed(undo):
            fn()
        raise


class WeightSwapExtension:
    """Methods vLLM mixes into its worker (`worker_extension_cls`); called with collective_rpc by name."""

    def _meshrl_model(self) -> torch.nn.Module:
        return self.model_runner.model

    def _meshrl_world_problem(self) -> str:
        size = self.vllm_config.parallel_config.world_size
        if size != 1:
            return (f"weights: in-place updates need one vLLM worker (tensor_parallel_size = pipeline_parallel_size"
                    f" = 1), this replica has {size}")
        return ""

    def meshrl_check_update_plan(self, shapes: dict) -> list[str]:
        """What would stop an update with tensors of these HF shapes ({name: shape}); [] when none."""
        problem = self._meshrl_world_problem()
        if problem:
            return [problem]
        model = self._meshrl_model()
        return check_plan(model, plan_update(model, shapes), shapes)

    def meshrl_swap_weights(self, entries: list, blobs: list) -> dict:
        """Applies a whole update (see pack_tensors) or nothing; {"error": message} instead of raising, so the
        message arrives whole."""
        problem = self._meshrl_world_problem()
        if problem:
            return {"error": problem}
        try:
            return {"error": "", **swap_weights(self._meshrl_model(), unpack_tensors(entries, blobs))}
        except ValueError as e:
            return {"error": str(e)}
        except Exception as e:  # noqa: BLE001 - the undo ran; report the cause with the tensor names we know
            log.exception("weight swap failed; old weights restored")
            return {"error": f"weights: applying the update failed ({type(e).__name__}: {e}); the old weights "
                             "were restored"}

    def meshrl_state(self, names: list) -> dict:
        """The vLLM tensors with these names (tests and debugging: checkpoint-layout parameters only)."""
        params = dict(self._meshrl_model().named_parameters())
        return {n: params[n].detach().cpu().clone() for n in names if n in params}


def pack_tensors(tensors: Mapping[str, torch.Tensor]) -> tuple[list, list[bytes]]:
    """[(name, dtype, shape)] and one bytes object per tensor: what vLLM's RPC carries intact (its msgpack
    turns tensors in untyped arguments into lists)."""
    entries = [(name, dtype_name(t.dtype), list(t.shape)) for name, t in tensors.items()]
    return entries, [bytes(tensor_bytes(t)) for t in tensors.values()]


def unpack_tensors(entries: Sequence, blobs: Sequence[bytes]) -> dict[str, torch.Tensor]:
    if len(entries) != len(blobs):
        raise ValueError(f"weights: {len(entries)} tensor entries but {len(blobs)} payloads")
    return {str(name): tensor_from_bytes(blob, dtype_from_name(dtype, field=f"{name}.dtype"), shape, field=str(name))
            for (name, dtype, shape), blob in zip(entries, blobs)}


