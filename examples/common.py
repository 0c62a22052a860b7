"""What the example tasks (arith, wordproblems, toolcalc) share: their data command line, the character-level
tokenizer and tiny Qwen2 they train, and the SFT schedule. Each task keeps its own vocabulary, template and
teacher; changing anything here changes every committed model a rerun would produce."""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path
from typing import Callable, Iterator

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

# Qwen2Tokenizer's pre-tokenizer split (transformers.models.qwen2.tokenization_qwen2).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def dataset_main(doc: str | None, build_datasets: Callable[..., tuple[Path, Path]], default_dir: Path) -> None:
    """The `python -m examples.<task>.task` command: writes the train and held-out files, prints their paths."""
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--out", default=str(default_dir))
    p.add_argument("--n-train", type=int, default=5000)
    p.add_argument("--n-heldout", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for path in build_datasets(args.out, n_train=args.n_train, n_heldout=args.n_heldout, seed=args.seed):
        print(path)


def char_tokenizer(vocab: list[str], special_tokens: list[str], *, eos: str, max_len: int, chat_template: str,
                   tags: list[str] = (), prepend_bos: bool = False) -> PreTrainedTokenizerFast:
    """A per-character tokenizer over `vocab` (in id order; pad must be id 0), lossless on decode. `tags`: plain
    tokens matched whole (tool-call markup); `prepend_bos`: encoding adds bos (else only the chat template does)."""
    ids = {tok: i for i, tok in enumerate(vocab)}
    # BPE with no merges == a pure per-character split.
    tk = Tokenizer(models.BPE(vocab=ids, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False,
                              continuing_subword_prefix="", end_of_word_suffix=""))
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    # ByteLevel decoding concatenates tokens (no " " joiner) and maps "Ġ" back to " ", so decode(encode(x)) == x.
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(special_tokens)
    if tags:
        tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in tags])
    if prepend_bos:
        tk.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", ids["<s>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token=eos,
                                   unk_token="<unk>", model_max_length=max_len, chat_template=chat_template)


def tiny_qwen2(tokenizer, *, hidden: int, layers: int, seed: int, max_len: int,
               max_new_tokens: int) -> Qwen2ForCausalLM:
    """A ~1M-parameter Qwen2 (GQA, RoPE, tied embeddings): the real HF code paths, cheap on a CPU."""
    torch.manual_seed(seed)
    ids = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_len, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, dtype="float32", **ids)
    config._attn_implementation = "sdpa"  # works on CPU; what the services default to
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(**ids, max_new_tokens=max_new_tokens)
    return model


def sft_steps(model, rows: list[dict], make_batch: Callable[[list[dict], random.Random], dict], *, steps: int,
              seed: int, lr: float, batch_size: int, warmup: int,
              stop_after: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
    """AdamW with linear warm-up then cosine decay to 10% over `steps`, on the batches make_batch(rows, rng) builds
    from rows reshuffled (seeded) each epoch. Yields (step, loss) after each update; `stop_after`: stop after that
    many steps of the schedule (the model of step N of a longer run)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))))
    model.train()
    order: list[int] = []
    for step in range(1, (min(stop_after, steps) if stop_after else steps) + 1):
        if len(order) < batch_size:  # epoch boundary: reshuffle deterministically
            order += rng.sample(range(len(rows)), len(rows))
        picked = [rows[j] for j in order[:batch_size]]
        del order[:batch_size]
        loss = model(**make_batch(picked, rng)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        yield step, loss
