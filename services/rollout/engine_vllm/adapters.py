"""LoRA adapters served by vLLM's own LoRA support (engine args `enable_lora`, `max_lora_rank`): each loaded adapter
is a peft folder on local disk, asked for by name with a LoRARequest whose int id is new for every version, so
vLLM's adapter cache and prefix cache never mix two versions of one adapter.

A replica serves adapters when rollout.vllm_engine_args has `enable_lora: true`; a request's SamplingParams.adapter
names one (\"\" = the base model). load_adapter checks names and shapes against the base model before anything
reaches vLLM, swaps the new version in while no generation runs (the engine's swap gate), then drops the old one.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.errors import FailedPrecondition
from services.rollout.types import check_weight_version

_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass
class LoadedAdapter:
    version: int
    request: object                # vllm.lora.request.LoRARequest
    folder: Path


def check_adapter_tensors(config: dict, tensors: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                          max_rank: int) -> int:
    """Every tensor an A or B of a linear layer of the base model, of the config's rank and the layer's shape;
    returns the rank. Raises a ValueError naming the first misfit."""
    try:
        rank, targets = int(config["r"]), list(config["target_modules"])
        float(config["lora_alpha"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"load_adapter: config needs r, lora_alpha and target_modules ({type(e).__name__}: {e})")
    if not 1 <= rank <= max_rank:
        raise ValueError(f"load_adapter: rank {rank} is not in 1..{max_rank} (rollout.vllm_engine_args.max_lora_rank)")
    if not tensors:
        raise ValueError("load_adapter: no tensors")
    for name, t in tensors.items():
        m = _NAME.match(name)
        base = reference.get(f"{m['module']}.weight") if m else None
        if base is None or base.dim() != 2:
            raise ValueError(f"load_adapter: {name!r} is no lora_A/lora_B of a linear layer of the base model "
                             "(expected base_model.model.<module>.lora_A.weight)")
        if m["module"].rsplit(".", 1)[-1] not in targets:
            raise ValueError(f"load_adapter: {name!r} is outside target_modules {targets}")
        out_f, in_f = base.shape
        want = (rank, in_f) if m["ab"] == "A" else (out_f, rank)
        if tuple(t.shape) != want:
            raise ValueError(f"load_adapter: {name!r} is {list(t.shape)}, the base layer needs {list(want)}")
        if not torch.is_floating_point(t):
            raise ValueError(f"load_adapter: {name!r} is {t.dtype}, not a floating-point tensor")
    return rank


def write_peft_folder(folder: Path, config: dict, tensors: dict[str, torch.Tensor], base_path: str) -> None:
    """peft's adapter_config.json + adapter_model.safetensors, as PeftModel.save_pretrained writes them."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
              str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    peft_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(config["r"]),
                   "lora_alpha": float(config["lora_alpha"]), "target_modules": list(config["target_modules"]),
                   "lora_dropout": 0.0, "bias": "none", "base_model_name_or_path": base_path}
    (folder / "adapter_config.json").write_text(json.dumps(peft_config, indent=1) + "\n")


class AdapterServing:
    """The vLLM engine's side of RolloutEngine.load_adapter and SamplingParams.adapter (a mixin of VLLMEngine: it
    uses the engine's loop, swap gate, AsyncLLM and base-model reference)."""

    supports_adapters = False

    def _init_adapters(self, engine_args: dict) -> None:
        self.supports_adapters = bool(engine_args.get("enable_lora"))
        self.max_lora_rank = int(engine_args.get("max_lora_rank") or 16)
        self.adapters: dict[str, LoadedAdapter] = {}
        self._adapter_ids = itertools.count(1)
        self._adapter_root = Path(tempfile.mkdtemp(prefix="meshrl-vllm-adapters-")) if self.supports_adapters \
            else None

    def load_adapter(self, name: str, version: int, config: dict, tensors: dict[str, torch.Tensor]) -> None:
        if not self.supports_adapters:
            raise FailedPrecondition("load_adapter: this vllm replica serves no adapters; start it with "
                                     "rollout.vllm_engine_args {enable_lora: true, max_lora_rank: <rank>}")
        if not _ADAPTER_NAME.match(name or ""):
            raise ValueError(f"load_adapter: adapter name {name!r} must be 1-128 letters, digits, '.', '_' or '-'")
        check_weight_version(version)
        old = self.adapters.get(name)
        if old is not None and version <= old.version:
            raise ValueError(f"load_adapter: {name!r} version {version} is not newer than the loaded {old.version}")
        check_adapter_tensors(config, tensors, self.reference, self.max_lora_rank)
        from vllm.lora.request import LoRARequest

        folder = self._adapter_root / f"{name}-v{version}"
        write_peft_folder(folder, config, tensors, self.model_path)
        request = LoRARequest(lora_name=name, lora_int_id=next(self._adapter_ids), lora_path=str(folder),
                              base_model_name=self.model_path)
        try:
            self._loop.call(self._swap_adapter(name, LoadedAdapter(version, request, folder), old))
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        if old is not None:
            shutil.rmtree(old.folder, ignore_errors=True)

    async def _swap_adapter(self, name: str, new: LoadedAdapter, old: LoadedAdapter | None) -> None:
        async with self._gate.exclusive():
            if not await self.llm.add_lora(new.request):
                raise ValueError(f"load_adapter: vLLM did not load adapter {name!r} version {new.version}")
            self.adapters[name] = new
            # As the torch engine: a replica's version is the newest update applied, base or adapter (the trainer's
            # push checks the version UpdateWeights answers with; an adapter's samples carry its own version).
            self.weight_version = new.version
            if old is not None:
                await self.llm.remove_lora(old.request.lora_int_id)

    def loaded_adapters(self) -> dict[str, int]:
        return {n: a.version for n, a in self.adapters.items()} if self.supports_adapters else {}

    def unload_adapter(self, name: str) -> bool:
        """vLLM drops adapter `name` (its slot and cache entry) once no generation runs; False when not loaded."""
        if not self.supports_adapters:
            raise FailedPrecondition("unload_adapter: this vllm replica serves no adapters (enable_lora is off)")
        old = self.adapters.get(name)
        if old is None:
            return False
        self._loop.call(self._drop_adapter(name, old))
        shutil.rmtree(old.folder, ignore_errors=True)
        return True

    async def _drop_adapter(self, name: str, old: LoadedAdapter) -> None:
        async with self._gate.exclusive():
            if self.adapters.get(name) is old:
                del self.adapters[name]
                await self.llm.remove_lora(old.request.lora_int_id)

    def lora_request(self, adapter: str):
        """The LoRARequest of a request's adapter (None for the base model); an unknown name is refused by name."""
        if not adapter:
            return None
        loaded = self.adapters.get(adapter) if self.supports_adapters else None
        if loaded is None:
            have = ", ".join(sorted(getattr(self, "adapters", {}))) or "none"
            raise ValueError(f"sampling.adapter: {adapter!r} is not loaded on this replica (loaded: {have})")
        return loaded

    def close_adapters(self) -> None:
        if self._adapter_root is not None:
            shutil.rmtree(self._adapter_root, ignore_errors=True)
