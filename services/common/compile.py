"""The decoder blocks of a Hugging Face model, and regional torch.compile over them (trainer and reference)."""

from __future__ import annotations

import logging

from torch import nn

log = logging.getLogger("meshrl.modeling")


def blocks_container(model: nn.Module) -> nn.Module:
    """The module holding the repeated decoder layers (a ModuleList, or a ModuleDict on a pipeline stage)."""
    for path in ("model.layers", "model.model.layers", "layers"):
        node = model
        try:
            for part in path.split("."):
                node = getattr(node, part)
        except AttributeError:
            continue
        return node
    raise ValueError(f"{type(model).__name__}: no decoder layers found (expected model.layers)")


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder layers of a HF causal LM, a value model, or a pipeline stage (a ModuleDict)."""
    node = blocks_container(model)
    return list(node.values()) if isinstance(node, nn.ModuleDict) else list(node)


def apply_compile(model: nn.Module, enabled: bool, *, backend: str = "inductor") -> None:
    """torch.compile each decoder block in place (Module.compile: names and state dicts unchanged).

    Regional compilation: the blocks share one code object and their parameters are graph inputs, so
    one compiled graph (per shape regime and grad mode) serves every block; compiling the whole model
    would trace embeddings, head and loss too, for little gain and much longer start-up.
    """
    if not enabled:
        return
    blocks = transformer_blocks(model)
    for block in blocks:
        block.compile(backend=backend)
    log.info("Applied torch.compile to %d blocks", len(blocks))
