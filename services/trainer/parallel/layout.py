"""This rank's place on the trainer mesh and its share of every batch: DP shards packed into micro-batches,
pipeline rows and schedules, autocast, and the tied embedding's gradient across pipeline stages.

Every rank holds the whole batch, so each works out its own share without communication; a rank with
less to do runs zero-weight dummy rows so that every rank's collectives line up.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from services.common.tensors.codec import DTYPES
from services.common.tensors.fused import host_to_device
from services.common.tensors.modeling import pack_by_token_budget, pad_batch
from services.common.tensors.packing import pack_by_token_sum
from services.trainer.parallel.mesh import ParallelDims
from services.trainer.parallel.pipeline import build_schedule, tied_embedding


class RankLayout:
    """The (pp, dp, tp) mesh seen from this rank, and how this rank cuts a batch."""

    def __init__(self, dims: ParallelDims, device: torch.device, *, pad_id: int, compute_dtype: str, autocast: bool,
                 num_microbatches: int, schedule: str, packed: bool = False):
        self.dims, self.device, self.pad_id = dims, device, pad_id
        # Micro-batches run as packed rows filled to the token budget (services/common/tensors/packing.py).
        self.packed = packed
        self.mesh = dims.build_mesh(device.type)
        self.dp_rank = self.mesh["dp"].get_local_rank()
        self.dp_group = self.mesh["dp"].get_group()
        self.pp_mesh = self.mesh["pp"]
        self.pp_group = self.pp_mesh.get_group()
        self.pp_rank = self.pp_mesh.get_local_rank()
        self.tp_rank = self.mesh["tp"].get_local_rank()
        self.is_last_stage = self.pp_rank == dims.pp - 1
        # Pipeline micro-batches per mini-batch and DP rank, and the schedule that runs them.
        self.num_microbatches = num_microbatches
        self.schedule = schedule
        self.compute_dtype = compute_dtype
        self.autocast = autocast
        # This stage's copy of a tied embedding and the group that sums its gradient (see `tie`).
        self.tied: torch.Tensor | None = None
        self.tied_group = None

    def amp(self):
        """Autocast to the compute dtype (fp32 master weights). Without gradients its weight cache is off: it
        would keep a half copy of every weight until the pass ends (3 GB at 1.5B), the largest part of a log-prob
        pass's memory over the weights; each layer's copy now lives only while the layer runs."""
        if not self.autocast:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=DTYPES[self.compute_dtype], cache_enabled=torch.is_grad_enabled())

    def local_groups(self, indices: Sequence[int], lengths: Sequence[int], budget: int) -> list[list[int] | None]:
        """This DP rank's shard of `indices` grouped by token budget, padded with None (a zero-weight
        dummy micro-batch) so that every DP rank runs as many forwards as the busiest one: FSDP's
        collectives must line up. Every rank holds the whole batch, so this needs no communication.
        """
        packed = []
        group_by = pack_by_token_sum if self.packed else pack_by_token_budget
        for r in range(self.dims.dp):
            shard = list(indices[r::self.dims.dp])
            packed.append([[shard[j] for j in g] for g in group_by([lengths[i] for i in shard], budget)])
        mine: list[list[int] | None] = list(packed[self.dp_rank])
        return mine + [None] * (max(len(p) for p in packed) - len(mine))

    def padded(self, rows: list[list[float]], width: int) -> torch.Tensor:
        """Per-token rows right-padded with zeros to [len(rows), width], on the device."""
        out = np.zeros((len(rows), width), dtype=np.float32)
        for i, r in enumerate(rows):
            out[i, :len(r)] = r
        return host_to_device(torch.from_numpy(out), self.device)

    def pp_rows(self, idx: Sequence[int]) -> list[int | None]:
        """This DP rank's rows of a pipelined batch, padded with None to a multiple of num_microbatches."""
        shard = list(idx[self.dp_rank::self.dims.dp])
        longest = max(len(idx[r::self.dims.dp]) for r in range(self.dims.dp))
        n = self.num_microbatches
        size = max(1, -(-longest // n)) * n          # same row count on every DP rank, divisible by n
        return shard + [None] * (size - len(shard))

    def pp_inputs(self, prompts, responses, real: Sequence[bool]):
        """Input ids [B, L] and response positions, mask and targets [B, R] of pipelined rows; rows that are
        not `real` (dummies) have an empty mask."""
        input_ids, _, positions, mask, targets = pad_batch(prompts, responses, pad_id=self.pad_id, device=self.device)
        keep = torch.tensor(list(real), device=self.device).unsqueeze(1)
        return input_ids, positions, mask & keep, targets

    def run_pipeline(self, stages: Sequence[nn.Module], input_ids: torch.Tensor, target: torch.Tensor | None = None,
                     *, loss_fn=None):
        """One batch through a fresh schedule of this rank's stages: the first stage feeds the ids, the last gets
        the target; a training step with `loss_fn`, else eval. Returns the last stage's outputs."""
        schedule = build_schedule(stages, self.pp_mesh, self.device, num_microbatches=self.num_microbatches,
                                  schedule=self.schedule, loss_fn=loss_fn)
        args = (input_ids,) if self.pp_rank == 0 else ()
        kwargs = {"target": target} if (self.is_last_stage and target is not None) else {}
        with self.amp():
            return schedule.step(*args, **kwargs) if loss_fn is not None else schedule.eval(*args, **kwargs)

    def bubble_fraction(self, stages_per_rank: int) -> float:
        """Idle share of a pipeline step: (pp - 1) / (v * microbatches + pp - 1) with v stages per rank (1 under
        GPipe/1F1B; interleaving shrinks the bubble v times); 0 without PP."""
        pp = self.dims.pp
        return (pp - 1) / (stages_per_rank * self.num_microbatches + pp - 1)

    def tie(self, model: nn.Module, tie_word_embeddings: bool) -> None:
        """First and last pipeline stages each hold a tied embedding; their gradients are summed."""
        self.tied = tied_embedding(model, self.pp_mesh)
        self.tied_group = self._tied_group(tie_word_embeddings)

    @property
    def tied_copy(self) -> torch.Tensor | None:
        """The tied embedding's second copy (on the last stage), which the gradient norm counts once."""
        return self.tied if (self.tied is not None and self.pp_rank != 0) else None

    def sync_tied_grads(self) -> None:
        """Sums the tied embedding's gradient over the first and last pipeline stages (no-op otherwise)."""
        if self.tied is None or self.tied.grad is None:
            return
        g = self.tied.grad
        if hasattr(g, "placements") and g.placements != self.tied.placements:
            # The vocab-parallel embedding's gradient can come back replicated; match the head's shards.
            g = g.redistribute(g.device_mesh, self.tied.placements)
            self.tied.grad = g
        dist.all_reduce(g.to_local() if hasattr(g, "to_local") else g, group=self.tied_group)

    def _tied_group(self, tie_word_embeddings: bool):
        """A group of the first and last stage at each (dp, tp) coordinate; both shard the weight alike."""
        if self.dims.pp == 1 or not tie_word_embeddings:
            return None
        ranks = self.mesh.mesh                                                     # [pp, dp, tp]
        mine = None
        for d in range(self.dims.dp):
            for t in range(self.dims.tp):
                pair = [int(ranks[0, d, t]), int(ranks[-1, d, t])]
                group = dist.new_group(pair)                      # every rank creates every group, in order
                if dist.get_rank() in pair:
                    mine = group
        return mine
