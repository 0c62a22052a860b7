"""The rank commands that run a model forward without an update: the actor's log-probs (plain or through the
pipeline schedule), the critic's values, and the compile warm-up. Each rank computes its DP shard of the batch;
rank 0 gets the whole answer (None elsewhere)."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from services.common.tensors.compile import warm_up_forward
from services.common.tensors.fused import sequence_logprobs
from services.trainer.model import lora_mixed
from services.trainer.model.lora import adapters_off
from services.trainer.parallel.mesh import gather_to_rank0
from services.trainer.parallel.pipeline import last_stage_head, stage_logprobs
from services.trainer.rank import Rank
from services.trainer.updates.critic import response_values


def warm_up(rank: Rank) -> None:
    """One forward + backward and one no-grad forward at the warm-up shapes (services/common/tensors/compile.py), through
    the training step's own log-prob call; the gradients are dropped."""
    def forward_backward(prompts, responses):
        with rank.layout.amp():
            logp, mask, entropy = sequence_logprobs(rank.actor.forward, prompts, responses, pad_id=rank.pad_id,
                                                    device=rank.device, packed=rank.layout.packed,
                                                    fused=rank.fused_logprobs)
        ((logp * mask).sum() + (entropy * mask).sum()).backward()

    for trained in rank.models():
        trained.optimizer.zero_grad(set_to_none=True)
    warm_up_forward(forward_backward, vocab_size=rank.vocab_size, device=rank.device, max_len=rank.max_len)
    for trained in rank.models():
        trained.optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        warm_up_forward(lambda ps, rs: actor_logprobs(rank, ps, rs, 1.0), vocab_size=rank.vocab_size,
                        device=rank.device, max_len=rank.max_len)


@torch.no_grad()
def compute_logprobs(rank: Rank, prompts, responses, temperature: float, base: bool = False):
    """The actor's log-probs; base=True: the LoRA base model's (adapters off for the call)."""
    with adapters_off(rank.actor.module) if base else nullcontext():
        return actor_logprobs(rank, prompts, responses, temperature)


def actor_logprobs(rank: Rank, prompts, responses, temperature: float,
                   row_adapters: tuple[list[str], list[int]] | None = None) -> list[list[float]] | None:
    """row_adapters (adapters' layer names, each row's index into them): each row under its own adapter, in one
    forward (model/lora_mixed.py; a trainer of one process)."""
    # Same packing and forward as services.common.tensors.modeling.batched_logprobs, so a one-rank trainer
    # and the reference service agree bit for bit on the same weights.
    if rank.dims.pp > 1:
        return _merge_on_rank0(rank, _pp_logprobs(rank, prompts, responses, temperature), len(prompts))
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    out: dict[int, list[float]] = {}
    for group in rank.layout.local_groups(range(len(prompts)), lengths, rank.cfg.micro_batch_token_budget):
        ps, rs = _group_ids(rank, group, prompts, responses)
        with _mixed(rank, row_adapters, group, ps, rs), rank.layout.amp():
            logp = sequence_logprobs(rank.actor.forward, ps, rs, pad_id=rank.pad_id, device=rank.device,
                                     temperature=temperature, packed=rank.layout.packed,
                                     fused=rank.fused_logprobs)[0]
        logp = logp.cpu()
        for row, i in enumerate(group or []):
            out[i] = logp[row, :len(responses[i])].tolist()
    return _merge_on_rank0(rank, out, len(prompts))


@torch.no_grad()
def _pp_logprobs(rank: Rank, prompts, responses, temperature: float) -> dict[int, list[float]]:
    layout = rank.layout
    rows = layout.pp_rows(list(range(len(prompts))))
    pad = [rank.pad_id]
    input_ids, positions, mask, targets = layout.pp_inputs(
        [prompts[i] if i is not None else pad for i in rows],
        [responses[i] if i is not None else pad for i in rows], [i is not None for i in rows])
    hidden = layout.run_pipeline(rank.actor.stages, input_ids)
    out: dict[int, list[float]] = {}
    if layout.is_last_stage:
        head = last_stage_head(rank.actor.stages)
        if hasattr(head, "placements") and head.device_mesh.mesh_dim_names != ("tp",):
            head = head.full_tensor()          # FSDP resharded the head after the schedule: one gather, no grad
        with layout.amp():
            logp, _ = stage_logprobs(hidden, head, positions, targets, mask, temperature)
        for row, i in enumerate(rows):
            if i is not None:
                out[i] = logp[row, :len(responses[i])].cpu().tolist()
    return out


@torch.no_grad()
def compute_values(rank: Rank, prompts, responses) -> list[list[float]] | None:
    """The critic's value of every response token."""
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    out: dict[int, list[float]] = {}
    for group in rank.layout.local_groups(range(len(prompts)), lengths, rank.critic.cfg.micro_batch_token_budget):
        ps, rs = _group_ids(rank, group, prompts, responses)
        values, _ = response_values(rank.layout, rank.critic.forward, ps, rs)
        values = values.cpu()
        for row, i in enumerate(group or []):
            out[i] = values[row, :len(responses[i])].tolist()
    return _merge_on_rank0(rank, out, len(prompts))


def _mixed(rank: Rank, row_adapters: tuple[list[str], list[int]] | None, group, prompts, responses):
    """The micro-batch's rows each under its own adapter (lora_mixed.by_row), or nothing to set."""
    if row_adapters is None:
        return nullcontext()
    names, of_row = row_adapters
    return lora_mixed.by_row(names, [of_row[i] for i in group], prompts, responses, packed=rank.layout.packed,
                             device=rank.device)


def _group_ids(rank: Rank, group: list[int] | None, prompts, responses):
    """A micro-batch's prompts and responses; a dummy group (None) runs one pad token, so collectives line up."""
    if group is None:
        return [[rank.pad_id]], [[rank.pad_id]]
    return [prompts[i] for i in group], [responses[i] for i in group]


def _merge_on_rank0(rank: Rank, part: dict[int, list[float]], n: int) -> list[list[float]] | None:
    """Every rank's {row: values} in row order on rank 0 (None elsewhere)."""
    parts = gather_to_rank0(part, rank.group)
    if parts is None:
        return None
    merged: dict[int, list[float]] = {}
    for p in parts:
        merged.update(p)
    return [merged[i] for i in range(n)]
