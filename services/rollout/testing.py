"""Tiny random Qwen2 models with a character tokenizer, for rollout tests and benchmarks (CPU, seconds), and a
gate that holds the engine's decode thread at chosen model calls."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import torch

# Ids 0-2 are pad/bos/eos; the rest are single characters, so text and tokens line up one to one.
# Like examples/arith's tokenizer, encoding with special tokens prepends bos and the chat template
# starts with it.
SPECIALS = ["<pad>", "<s>", "</s>"]
CHARS = list("0123456789+-=*/ ().,?abcdexyz\n")   # 29 characters
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}a:{% endif %}")


def char_tokenizer():
    """A PreTrainedTokenizerFast that maps each character to one id and decodes by concatenation."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(path: str | Path, *, seed: int = 0, with_tokenizer: bool = True, hidden_size: int = 64,
                    num_hidden_layers: int = 2, max_position_embeddings: int = 64, init_scale: float = 8.0,
                    eos_logit_zero: bool = True) -> str:
    """Saves a random tiny Qwen2 (and the char tokenizer) to `path`; returns the path.

    init_scale sharpens the random distribution so greedy and top-p choices are not near-ties;
    eos_logit_zero zeroes eos's (tied) embedding so its logit is 0 and greedy decoding almost
    never picks it, which keeps "length" tests deterministic.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab_size = len(SPECIALS) + len(CHARS)
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=2 * hidden_size,
                      max_position_embeddings=max_position_embeddings, tie_word_embeddings=True,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.02 * init_scale)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    if eos_logit_zero:
        with torch.no_grad():
            model.model.embed_tokens.weight[2].zero_()
    path = Path(path)
    model.save_pretrained(path)
    if with_tokenizer:
        char_tokenizer().save_pretrained(path)
    return str(path)


def random_state_like(model: torch.nn.Module, *, seed: int) -> dict[str, torch.Tensor]:
    """New random tensors with the names, dtypes and shapes of a weight update for `model`."""
    from services.common.tensors.weights import named_weights

    g = torch.Generator().manual_seed(seed)
    return {name: (torch.randn(p.shape, generator=g) * 0.1).to(p.dtype) for name, p in named_weights(model).items()}


class Gate:
    """Stops the thread running `module`'s forward at given calls (1-based) until the test opens them: tests order
    a decode and an update by events, not sleeps. `handle.remove()` takes the hook off."""

    def __init__(self, module: torch.nn.Module, stops: tuple[int, ...]):
        self.calls = 0
        self.reached = {c: threading.Event() for c in stops}
        self.opened = {c: threading.Event() for c in stops}
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.calls += 1
        if self.calls in self.reached:
            self.reached[self.calls].set()
            assert self.opened[self.calls].wait(timeout=120), "the test never opened the gate"

    async def wait(self, call: int) -> None:
        assert await asyncio.to_thread(self.reached[call].wait, 120)

    def open(self, call: int) -> None:
        self.opened[call].set()
