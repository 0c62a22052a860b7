"""Model loading and the log-prob math every model-holding service shares (trainer, reference, rollout)."""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from services.common.tensors.codec import DTYPES

log = logging.getLogger("meshrl.modeling")


def set_threads(num_threads: int) -> None:
    torch.set_num_threads(num_threads)


def load_causal_lm(path: str, *, dtype: str = "float32", device: str = "cpu", trainable: bool = False):
    """Loads a local Hugging Face causal LM with from_pretrained (never from a hub)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], local_files_only=True)
    model.to(device)
    model.train(trainable)
    if not trainable:
        model.requires_grad_(False)
    return model


def load_tokenizer(path: str):
    """The tokenizer of a local model folder, loaded as it was saved.

    transformers 5 builds the model type's own class for some types (Qwen2Tokenizer for a qwen2
    folder) even when tokenizer_config.json names the generic TokenizersBackend, and that class
    rebuilds the pipeline from the vocabulary: a custom tokenizer.json (the tiny models this project
    trains) would lose its pre-tokenizer. Generic ones are loaded as saved.
    """
    import json
    from pathlib import Path

    folder = Path(path)
    config_file = folder / "tokenizer_config.json"
    tokenizer_class = json.loads(config_file.read_text()).get("tokenizer_class") if config_file.is_file() else None
    if tokenizer_class in ("TokenizersBackend", "PreTrainedTokenizerFast") and (folder / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    # Imported only here: AutoTokenizer's import pulls in the auto model classes, generation and sklearn (2.7 s of a
    # fresh process on a CPU), which a coordinator loading a generic tokenizer never uses.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def validate_sequences(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *,
                       vocab_size: int, max_len: int | None = None, field: str = "sequences") -> None:
    """Bad token input is a ValueError naming the sequence and the field."""
    if len(prompts) == 0:
        raise ValueError(f"{field}: empty batch")
    if len(prompts) != len(responses):
        raise ValueError(f"{field}: {len(prompts)} prompts but {len(responses)} responses")
    # Columnar requests' rows (packed.Rows) name their Ragged field and row.
    columns = (getattr(prompts, "field", None), getattr(responses, "field", None))

    def where(i: int, which: int) -> str:
        return f"{columns[which]}: row {i}" if columns[which] else f"{field}[{i}].{('prompt_ids', 'response_ids')[which]}"

    for i, (p, r) in enumerate(zip(prompts, responses)):
        if len(p) == 0:
            raise ValueError(f"{where(i, 0)}: empty")
        if len(r) == 0:
            raise ValueError(f"{where(i, 1)}: empty")
        for which, ids in enumerate((p, r)):
            lo, hi = (int(ids.min()), int(ids.max())) if isinstance(ids, np.ndarray) else (min(ids), max(ids))
            if 0 <= lo and hi < vocab_size:                     # C loops (numpy's for packed fields)
                continue
            bad = next(t for t in ids if t < 0 or t >= vocab_size)
            raise ValueError(f"{where(i, which)}: token id {bad} outside the vocabulary [0, {vocab_size})")
        if max_len is not None and len(p) + len(r) > max_len:
            row = f"{columns[0]} / {columns[1]}: row {i}" if columns[0] else f"{field}[{i}]"
            raise ValueError(f"{row}: {len(p) + len(r)} tokens exceed the model's limit of {max_len}")


def pad_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *, pad_id: int,
              device: str | torch.device = "cpu"):
    """Right-padded [B, L] input ids and attention mask, plus [B, R] response positions and mask."""
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    B, L, R = len(prompts), max(lengths), max(len(r) for r in responses)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    # Position of the logit that predicts response token t: prompt_len - 1 + t.
    positions = torch.zeros((B, R), dtype=torch.long)
    response_mask = torch.zeros((B, R), dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids = list(p) + list(r)
        input_ids[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[i, :len(ids)] = 1
        positions[i, :len(r)] = torch.arange(len(p) - 1, len(p) - 1 + len(r))
        response_mask[i, :len(r)] = True
    targets = torch.gather(input_ids, 1, (positions + 1).clamp(max=L - 1))
    return (input_ids.to(device), attention_mask.to(device), positions.to(device), response_mask.to(device),
            targets.to(device))


def response_logprobs(model, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *,
                      pad_id: int, temperature: float = 1.0, with_entropy: bool = False):
    """Per-token log-probs [B, R] (and entropy) of the response tokens; padded entries are 0.

    Logits are taken in fp32 before the softmax so bf16 models stay accurate. Gradients flow when
    called under grad mode (the trainer), not otherwise (reference, rollout).
    """
    device = next(model.parameters()).device
    input_ids, _, positions, mask, targets = pad_batch(prompts, responses, pad_id=pad_id, device=device)
    # No attention mask: rows are right-padded, so under the causal mask no real token ever sees a pad and
    # the real positions' logits are the same. Without one, SDPA runs its causal kernel and transformers
    # skips building a [B, 1, L, L] mask (and its host sync checking the mask for padding).
    logits = model(input_ids=input_ids, use_cache=False).logits                                # [B, L, V]
    idx = positions.unsqueeze(-1).expand(-1, -1, logits.size(-1))
    logits = torch.gather(logits, 1, idx).float()                                             # [B, R, V]
    if temperature and temperature != 1.0:
        logits = logits / temperature
    logp_all = F.log_softmax(logits, dim=-1)
    logp = torch.gather(logp_all, 2, targets.unsqueeze(-1)).squeeze(-1) * mask                 # [B, R]
    if not with_entropy:
        return logp, mask
    entropy = -(logp_all.exp() * logp_all).sum(-1) * mask
    return logp, mask, entropy


def pack_by_token_budget(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Groups indices (sorted by length) into micro-batches whose padded size B * max_len stays within budget."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = max([lengths[j] for j in current] + [lengths[i]])
        if current and longest * (len(current) + 1) > budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


@torch.no_grad()
def batched_logprobs(model, prompts, responses, *, pad_id: int, temperature: float = 1.0,
                     token_budget: int = 16384, fused: bool = False, packed: bool = False, as_arrays: bool = False):
    """Log-probs of each response's tokens, computed in micro-batches of at most `token_budget` tokens.

    `fused`: through the fused LM head (the model went through services.common.tensors.fused.enable_fused_head).
    `packed`: each micro-batch one packed row (the model went through services.common.tensors.packing.enable_packing),
    filled to the budget; else right-padded rows whose batch * longest stays within it.
    Every micro-batch is queued before the one device-to-host copy at the end. Rows are lists, or float32
    numpy arrays with `as_arrays` (for packed answers: no per-element conversion).
    """
    from services.common.tensors.fused import sequence_logprobs
    from services.common.tensors.packing import pack_by_token_sum

    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    out: list[list[float] | None] = [None] * len(prompts)
    groups = (pack_by_token_sum if packed else pack_by_token_budget)(lengths, token_budget)
    device = next(model.parameters()).device
    results = []
    for group in groups:
        ps, rs = [prompts[i] for i in group], [responses[i] for i in group]
        results.append(sequence_logprobs(model, ps, rs, pad_id=pad_id, device=device, temperature=temperature,
                                         packed=packed, fused=fused)[0])
    for group, logp in zip(groups, results):
        rows = logp.float().cpu().numpy() if as_arrays else logp.cpu().tolist()
        for row, i in enumerate(group):
            out[i] = rows[row][:len(responses[i])]
    return out  # type: ignore[return-value]


def tokenizer_fingerprint(path: str) -> str:
    """A short hash of what makes two tokenizers' ids mean the same text: the token -> id map (added tokens
    included) and the bos/eos/pad/unk ids. Equal fingerprints: a model's log-probs of the other's ids are
    meaningful (on-policy distillation compares a teacher's with a student's)."""
    import hashlib
    import json

    tok = load_tokenizer(path)
    specials = {name: getattr(tok, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")}
    blob = json.dumps({"vocab": sorted(tok.get_vocab().items(), key=lambda kv: (kv[1], kv[0])),
                       "specials": specials}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
