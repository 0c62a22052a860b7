"""What the engines that hold their model in this process (torch, vllm) share: tokenizer and eos loading,
the length limit, and turning prompts into checked token ids."""

from __future__ import annotations

import logging
import os
from typing import Sequence

from services.common.tensors.modeling import load_tokenizer
from services.rollout.types import GenerateBatch, PromptInput, RolloutEngine

log = logging.getLogger("meshrl.rollout")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def try_tokenizer(path: str):
    """The tokenizer in `path`, or None (the replica then serves prompt_ids only)."""
    # AutoTokenizer would build an empty tokenizer from config.json alone, so look for its files first.
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        log.warning("no tokenizer files in %s; only prompt_ids are accepted", path)
        return None
    try:
        return load_tokenizer(path)
    except Exception as e:  # noqa: BLE001 - a model folder without a tokenizer serves prompt_ids only
        log.warning("no tokenizer in %s (%s: %s); only prompt_ids are accepted", path, type(e).__name__, e)
        return None


def end_of_turn_ids(tokenizer) -> set[int]:
    """The special token the chat template closes an assistant turn with (`<|im_end|>`, `<|eot_id|>`), found by
    rendering a turn and reading the token that follows its content; empty without a template or such a token."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return set()
    marker = "meshrl-end-of-turn-probe"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": marker}], tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render this turn has no end-of-turn to find
        return set()
    after = text[text.rfind(marker) + len(marker):] if marker in text else ""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    return {int(ids[0])} if ids and ids[0] in special else set()


def find_eos_ids(model, tokenizer) -> set[int]:
    """Every id that ends a sample: the model config's, its generation config's and the tokenizer's eos, and
    the chat template's end-of-turn token."""
    ids: set[int] = set()
    for src in (model.config.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                getattr(tokenizer, "eos_token_id", None)):
        if src is None:
            continue
        ids.update(int(x) for x in (src if isinstance(src, (list, tuple)) else [src]))
    return ids | end_of_turn_ids(tokenizer)


def model_len_limit(configured: int | None, model_config) -> int:
    """rollout.max_model_len, else the model's max_position_embeddings (else 2048); never past the model's."""
    model_len = getattr(model_config, "max_position_embeddings", None)
    limit = int(configured or model_len or 2048)
    if model_len and limit > model_len:
        raise ValueError(f"rollout.max_model_len: {limit} exceeds the model's max_position_embeddings ({model_len})")
    return limit


class LocalModelEngine(RolloutEngine):
    """An engine whose model and tokenizer are here: it checks prompts against its vocabulary and
    max_model_len itself, and maps text to ids and back with its tokenizer."""

    vocab_size: int
    max_model_len: int

    def check_batch(self, batch: GenerateBatch) -> list[list[int]]:
        """Token ids of every prompt, after refusing what this replica cannot serve."""
        prompt_ids = self.resolve_prompts(batch.prompts)
        if batch.sampling.stop and self.tokenizer is None:
            raise ValueError("sampling.stop: stop strings need a tokenizer, and this replica has none")
        return prompt_ids

    def resolve_prompts(self, prompts: Sequence[PromptInput]) -> list[list[int]]:
        """Token ids of every prompt (tokenizing text), checked against the vocabulary and max_model_len."""
        if len(prompts) == 0:
            raise ValueError("prompts: empty batch")
        texts: dict[bool, list[int]] = {}      # add_special_tokens -> indices of text prompts
        for i, p in enumerate(prompts):
            if p.prompt_ids:
                bad = [t for t in p.prompt_ids if t < 0 or t >= self.vocab_size]
                if bad:
                    raise ValueError(f"prompts[{i}].prompt_ids: token id {bad[0]} outside the vocabulary "
                                     f"[0, {self.vocab_size})")
            elif p.text:
                if self.tokenizer is None:
                    raise ValueError(f"prompts[{i}].text: this replica has no tokenizer; send prompt_ids")
                texts.setdefault(p.add_special_tokens, []).append(i)
            else:
                raise ValueError(f"prompts[{i}]: needs prompt_ids or text")
        out = [[int(t) for t in p.prompt_ids] for p in prompts]
        for special, idx in texts.items():   # one tokenizer call per kind: the fast tokenizer batches
            encoded = self.tokenizer([prompts[i].text for i in idx], add_special_tokens=special)["input_ids"]
            for i, ids in zip(idx, encoded):
                out[i] = list(ids)
        for i, ids in enumerate(out):
            if not ids:
                raise ValueError(f"prompts[{i}].text: tokenizes to no tokens")
            if len(ids) >= self.max_model_len:
                raise ValueError(f"prompts[{i}]: {len(ids)} tokens leave no room to generate within "
                                 f"max_model_len={self.max_model_len}")
        return out

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
