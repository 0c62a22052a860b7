"""Reference engine: a frozen copy of the initial policy that scores token sequences."""

from __future__ import annotations

import asyncio
import logging

from services.common.auto import Resolved
from services.common.tensors.compile import warm_up_forward
from services.common.tensors.fused import enable_fused_head, supports_fused_head
from services.common.tensors.modeling import (batched_logprobs, load_causal_lm, set_threads, tokenizer_fingerprint,
                                             validate_sequences)
from services.common.tensors.packing import enable_packing, supports_packing
from services.reference.config import ReferenceSettings

log = logging.getLogger("meshrl.reference")


class ReferenceEngine:
    """Serves log-probs of a frozen model (a services.reference.types.LogProbEngine); no gRPC here."""

    def __init__(self, settings: ReferenceSettings):
        ref, m = settings.reference, settings.model
        self.model_path = ref.model_path or m.path
        self.dtype = ref.dtype or m.dtype
        self.device = ref.device or m.device
        self.config = ref
        set_threads(m.num_threads)
        self.model = load_causal_lm(self.model_path, dtype=self.dtype, device=self.device)
        self.resolved = Resolved("reference", log)
        cuda = str(self.device).startswith("cuda")
        reason = supports_fused_head(self.model)
        self.fused = self.resolved.pick("reference.fused_logprobs", ref.fused_logprobs, reason is None,
                                        "the LM head can be fused" if reason is None else reason)
        if self.fused:
            enable_fused_head(self.model, key="reference.fused_logprobs")
        # As the trainer's actor.use_remove_padding: on CUDA in half precision.
        why_not = ("not on CUDA" if not cuda else f"dtype {self.dtype}" if self.dtype not in ("bfloat16", "float16")
                   else supports_packing(self.model))
        self.packed = bool(self.resolved.pick("reference.use_remove_padding", ref.use_remove_padding, why_not is None,
                                              "half precision on CUDA" if why_not is None else why_not))
        if self.packed:
            enable_packing(self.model, "reference.use_remove_padding")
        self.compiled = bool(self.resolved.pick("reference.compile", ref.compile, cuda,
                                                "CUDA device" if cuda else "not on CUDA"))
        if self.compiled:
            from services.common.tensors.compile import apply_compile

            apply_compile(self.model, True)
        self.pad_id = self.model.config.pad_token_id or 0
        self.vocab_size = self.model.config.vocab_size
        self.max_len = getattr(self.model.config, "max_position_embeddings", None)
        self.tokenizer = _fingerprint(self.model_path)
        # One forward at a time: torch CPU work is not faster when interleaved, and memory stays bounded.
        self._lock = asyncio.Lock()
        self.num_calls = 0
        self.warmup_seconds = 0.0
        log.info("reference model %s loaded on %s (%s)", self.model_path, self.device, self.dtype)

    def warm_up(self) -> float:
        """With compile: no-grad forwards at two packed lengths before serving (seconds taken), so torch.compile
        builds its static and dynamic-size graphs now rather than inside a run's first steps."""
        if not (self.compiled and self.config.warmup):
            return 0.0
        self.warmup_seconds = warm_up_forward(
            lambda ps, rs: batched_logprobs(self.model, ps, rs, pad_id=self.pad_id, temperature=1.0,
                                            token_budget=self.config.micro_batch_token_budget, fused=self.fused,
                                            packed=self.packed),
            vocab_size=self.vocab_size, device=self.device, max_len=self.max_len)
        log.info("reference: warm-up (compile) took %.1f s", self.warmup_seconds)
        return self.warmup_seconds

    def info(self) -> dict:
        return {"dtype": self.dtype, "device": self.device, "num_calls": self.num_calls, "micro_batch_token_budget":
                self.config.micro_batch_token_budget, "max_model_len": self.max_len, "fused_logprobs": self.fused,
                "use_remove_padding": self.packed, "compile": self.compiled,
                "resolved": self.resolved.json(), "warmup_seconds": round(self.warmup_seconds, 3),
                "tokenizer": self.tokenizer}

    def logprobs_sync(self, prompts, responses, temperature: float = 1.0, *, as_arrays: bool = False):
        """Rows as lists, or float32 numpy arrays with as_arrays."""
        validate_sequences(prompts, responses, vocab_size=self.vocab_size, max_len=self.max_len)
        if len(prompts) > self.config.max_batch_size:
            raise ValueError(f"sequences: {len(prompts)} exceed reference.max_batch_size={self.config.max_batch_size}")
        return batched_logprobs(self.model, prompts, responses, pad_id=self.pad_id, temperature=temperature,
                                token_budget=self.config.micro_batch_token_budget, fused=self.fused,
                                packed=self.packed, as_arrays=as_arrays)

    async def logprobs(self, prompts, responses, temperature: float = 1.0, *, as_arrays: bool = False):
        self.num_calls += 1
        async with self._lock:
            return await asyncio.to_thread(self.logprobs_sync, prompts, responses, temperature, as_arrays=as_arrays)


def _fingerprint(path: str) -> str:
    """The model folder's tokenizer fingerprint (GetInfo details["tokenizer"]: a distillation run checks its teacher
    with it); "" for a folder without a tokenizer, which a reference for KL terms does not need."""
    try:
        return tokenizer_fingerprint(path)
    except (OSError, ValueError) as e:
        log.info("no tokenizer in %s (%s): GetInfo reports none", path, e)
        return ""
