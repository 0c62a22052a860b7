"""Protobuf <-> dataclasses of the trainer service; proto3 zeros of ActorLoss read as the documented defaults."""

from __future__ import annotations

import json

from meshrl.v1 import common_pb2, trainer_pb2
import numpy as np

from services.common.tensors.packed import (F32, I32, concat, field_of, pack_f32, pack_i32, row_lengths, row_lengths_of,
                                    set_rows, split_rows, unpack, unpack_rows)
from services.common.manifest import Manifest
from services.trainer.config import RUN_OPTIM_KEYS, OptimSection, RunOptim
from services.trainer.types import (ActorLoss, AdamParams, CriticLoss, CriticSample, Datum, DPOLoss, PreferencePair,
                                    PrimitiveLoss, RunStart, RunStep, TrainSample)


def actor_loss_from_pb(pb: trainer_pb2.ActorLoss) -> ActorLoss:
    """Unset (zero) fields take ActorLoss's defaults; the policy loss's settings arrive as a JSON object, read
    (not checked: batch.py checks them against the loss's settings class) into a plain map."""
    d = ActorLoss()
    try:
        settings = json.loads(pb.policy_loss_settings) if pb.policy_loss_settings else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"loss.policy_loss_settings: not JSON ({e})") from None
    if not isinstance(settings, dict):
        raise ValueError(f"loss.policy_loss_settings: expected a JSON object, got {pb.policy_loss_settings!r}")
    return ActorLoss(policy_loss=pb.policy_loss or d.policy_loss, policy_loss_settings=settings,
                     kl_coef=pb.kl_coef, kl_type=pb.kl_type or d.kl_type, entropy_coef=pb.entropy_coef,
                     loss_agg_mode=pb.loss_agg_mode or d.loss_agg_mode, loss_scale_factor=pb.loss_scale_factor,
                     ppo_epochs=pb.ppo_epochs or d.ppo_epochs, mini_batch_size=pb.mini_batch_size,
                     temperature=pb.temperature or d.temperature)


def actor_loss_to_pb(loss: ActorLoss) -> trainer_pb2.ActorLoss:
    return trainer_pb2.ActorLoss(policy_loss=loss.policy_loss,
                                 policy_loss_settings=json.dumps(loss.policy_loss_settings, sort_keys=True),
                                 kl_coef=loss.kl_coef, kl_type=loss.kl_type, entropy_coef=loss.entropy_coef,
                                 loss_agg_mode=loss.loss_agg_mode, loss_scale_factor=loss.loss_scale_factor,
                                 ppo_epochs=loss.ppo_epochs, mini_batch_size=loss.mini_batch_size,
                                 temperature=loss.temperature)


def train_actor_from_pb(request: trainer_pb2.TrainActorRequest) -> tuple[list[TrainSample], ActorLoss]:
    """Packed and columnar fields arrive as numpy arrays (no per-element copy), repeated ones as lists."""
    if request.HasField("columns"):
        if len(request.samples):
            raise ValueError("samples: set together with columns (send one form or the other)")
        return _train_columns(request.columns), actor_loss_from_pb(request.loss)
    samples = []
    for i, s in enumerate(request.samples):
        w = f"samples[{i}]."
        samples.append(TrainSample(prompt_ids=s.prompt_ids[:], response_ids=field_of(s, "response_ids", I32, w),
                                   advantages=field_of(s, "advantages", F32, w),
                                   old_logprobs=field_of(s, "old_logprobs", F32, w),
                                   ref_logprobs=field_of(s, "ref_logprobs", F32, w),
                                   loss_mask=unpack(s.loss_mask, U8, f"{w}loss_mask")))
    return samples, actor_loss_from_pb(request.loss)


def _train_columns(c: trainer_pb2.TrainColumns) -> list[TrainSample]:
    prompts = unpack_rows(c.prompt_ids, I32, "columns.prompt_ids")
    lengths = row_lengths(c.response_ids.lengths, "columns.response_ids")
    responses = split_rows(unpack(c.response_ids.values, I32, "columns.response_ids.values"), lengths,
                           "columns.response_ids.values")
    if len(prompts) != len(responses):
        raise ValueError(f"columns.response_ids: {len(responses)} rows for {len(prompts)} prompt rows")

    def per_token(name: str, required: bool) -> list[np.ndarray]:
        data = getattr(c, name)
        if not data and not required:
            return [_EMPTY] * len(responses)
        flat = unpack(data, F32, f"columns.{name}")
        rows = split_rows(flat, lengths, f"columns.{name}")
        if not np.isfinite(flat).all():
            k = int(np.argmin(np.isfinite(flat)))
            i = int(np.searchsorted(np.cumsum(lengths), k, side="right"))
            raise ValueError(f"columns.{name}[{k}]: not finite ({flat[k]}; sample {i}, token "
                             f"{k - int(lengths[:i].sum())})")
        return rows

    advantages, old, ref = per_token("advantages", True), per_token("old_logprobs", False), \
        per_token("ref_logprobs", False)
    masks = split_rows(unpack(c.loss_mask, U8, "columns.loss_mask"), lengths, "columns.loss_mask") \
        if c.loss_mask else [_EMPTY_MASK] * len(responses)
    return [TrainSample(prompt_ids=p, response_ids=r, advantages=a, old_logprobs=o, ref_logprobs=f, loss_mask=m)
            for p, r, a, o, f, m in zip(prompts, responses, advantages, old, ref, masks)]


_EMPTY = np.empty(0, dtype=F32)
# The loss mask on the wire: one byte per response token (1 = the model's token, 0 = an observation).
U8 = np.dtype("u1")
_EMPTY_MASK = np.empty(0, dtype=U8)


def loss_mask_bytes(samples, *, first: int = 0) -> bytes:
    """The samples' loss masks (a `loss_mask` attribute: None or empty = all ones) as one uint8 column in the
    response layout; b"" when no sample has one (every token is the model's). A mask whose length is not its
    response's is a ValueError naming the sample (numbered from `first`)."""
    masks = [getattr(s, "loss_mask", None) for s in samples]
    if not any(m is not None and len(m) for m in masks):
        return b""
    rows = []
    for i, (s, m) in enumerate(zip(samples, masks), start=first):
        n = len(s.response_ids)
        if m is None or not len(m):
            rows.append(np.ones(n, dtype=U8))
            continue
        if len(m) != n:
            raise ValueError(f"samples[{i}].loss_mask: {len(m)} values for {n} response tokens")
        rows.append(np.asarray(m, dtype=U8))
    return np.concatenate(rows).tobytes()


def train_columns_to_pb(samples, into: trainer_pb2.TrainColumns | None = None) -> trainer_pb2.TrainColumns:
    """Any objects with TrainSample's fields as one TrainColumns (written into `into`, a request's `columns`, when
    given: nesting a built message copies its bytes). old_logprobs / ref_logprobs: every sample's or none (an
    empty column); a row whose length is not its response's is a ValueError naming the sample."""
    c = trainer_pb2.TrainColumns() if into is None else into
    response_lengths = row_lengths_of([s.response_ids for s in samples])

    def per_token(name: str, required: bool = False) -> bytes:
        rows = [getattr(s, name) for s in samples]
        lengths = row_lengths_of(rows)
        if not required and not lengths.any():
            return b""
        if (lengths != response_lengths).any():     # rows that only add up would land on the wrong tokens
            i = int(np.argmax(lengths != response_lengths))
            raise ValueError(f"samples[{i}].{name}: {lengths[i]} values for {response_lengths[i]} response tokens")
        return concat(rows, F32)

    advantages, old, ref = per_token("advantages", required=True), per_token("old_logprobs"), per_token("ref_logprobs")
    set_rows(c.prompt_ids, [s.prompt_ids for s in samples], I32)
    set_rows(c.response_ids, [s.response_ids for s in samples], I32)
    c.advantages, c.old_logprobs, c.ref_logprobs = advantages, old, ref
    c.loss_mask = loss_mask_bytes(samples)
    return c


def train_sample_to_pb(s, *, packed: bool = False, index: int = 0) -> trainer_pb2.TrainSample:
    """Any object with TrainSample's fields (the coordinator's Sample too); `index` numbers it in errors."""
    mask = loss_mask_bytes([s], first=index)
    if packed:
        return trainer_pb2.TrainSample(prompt_ids=s.prompt_ids, response_ids_packed=pack_i32(s.response_ids),
                                       advantages_packed=pack_f32(s.advantages),
                                       old_logprobs_packed=pack_f32(s.old_logprobs),
                                       ref_logprobs_packed=pack_f32(s.ref_logprobs), loss_mask=mask)
    return trainer_pb2.TrainSample(prompt_ids=s.prompt_ids, response_ids=s.response_ids, advantages=s.advantages,
                                   old_logprobs=s.old_logprobs, ref_logprobs=s.ref_logprobs, loss_mask=mask)


def train_actor_to_pb(samples: list[TrainSample], loss: ActorLoss, *, packed: bool = False,
                      columnar: bool = False) -> trainer_pb2.TrainActorRequest:
    if columnar:
        request = trainer_pb2.TrainActorRequest(loss=actor_loss_to_pb(loss))
        train_columns_to_pb(samples, into=request.columns)
        return request
    return trainer_pb2.TrainActorRequest(samples=[train_sample_to_pb(s, packed=packed, index=i)
                                                  for i, s in enumerate(samples)],
                                         loss=actor_loss_to_pb(loss))


def train_critic_from_pb(request: trainer_pb2.TrainCriticRequest) -> tuple[list[CriticSample], CriticLoss]:
    samples = [CriticSample(prompt_ids=s.prompt_ids[:], response_ids=s.response_ids[:], returns=s.returns[:],
                            old_values=s.old_values[:], loss_mask=unpack(s.loss_mask, U8, f"samples[{i}].loss_mask"))
               for i, s in enumerate(request.samples)]
    return samples, CriticLoss(clip_value=request.clip_value, ppo_epochs=request.ppo_epochs or 1,
                               mini_batch_size=request.mini_batch_size)


def train_critic_to_pb(samples: list[CriticSample], loss: CriticLoss,
                       run_step: RunStep | None = None) -> trainer_pb2.TrainCriticRequest:
    return trainer_pb2.TrainCriticRequest(
        samples=[trainer_pb2.CriticSample(prompt_ids=s.prompt_ids, response_ids=s.response_ids, returns=s.returns,
                                          old_values=s.old_values, loss_mask=loss_mask_bytes([s], first=i))
                 for i, s in enumerate(samples)],
        clip_value=loss.clip_value, ppo_epochs=loss.ppo_epochs, mini_batch_size=loss.mini_batch_size,
        run_step=run_step_to_pb(run_step))


def dpo_loss_from_pb(pb: trainer_pb2.DPOLoss) -> DPOLoss:
    """Unset (zero) loss_type and beta take DPOLoss's defaults (sigmoid, 0.1); a negative beta stays and fails
    validation."""
    d = DPOLoss()
    return DPOLoss(loss_type=pb.loss_type or d.loss_type, beta=pb.beta or d.beta, label_smoothing=pb.label_smoothing,
                   mini_batch_size=pb.mini_batch_size)


def dpo_loss_to_pb(loss: DPOLoss) -> trainer_pb2.DPOLoss:
    return trainer_pb2.DPOLoss(loss_type=loss.loss_type, beta=loss.beta, label_smoothing=loss.label_smoothing,
                               mini_batch_size=loss.mini_batch_size)


def train_dpo_from_pb(request: trainer_pb2.TrainDPORequest) -> tuple[list[PreferencePair], DPOLoss]:
    pairs = [PreferencePair(prompt_ids=p.prompt_ids[:], chosen_ids=p.chosen_ids[:],
                            rejected_ids=p.rejected_ids[:], ref_chosen_logprob=p.ref_chosen_logprob,
                            ref_rejected_logprob=p.ref_rejected_logprob) for p in request.pairs]
    return pairs, dpo_loss_from_pb(request.loss)


def train_dpo_to_pb(pairs: list[PreferencePair], loss: DPOLoss) -> trainer_pb2.TrainDPORequest:
    return trainer_pb2.TrainDPORequest(
        pairs=[trainer_pb2.PreferencePair(prompt_ids=p.prompt_ids, chosen_ids=p.chosen_ids,
                                          rejected_ids=p.rejected_ids, ref_chosen_logprob=p.ref_chosen_logprob,
                                          ref_rejected_logprob=p.ref_rejected_logprob) for p in pairs],
        loss=dpo_loss_to_pb(loss))


def train_response_to_pb(step: int, metrics: dict[str, float], repeated: bool = False) -> trainer_pb2.TrainResponse:
    return trainer_pb2.TrainResponse(step=step, metrics={k: float(v) for k, v in metrics.items()}, repeated=repeated)


def run_step_to_pb(run_step: RunStep | None) -> trainer_pb2.RunStep | None:
    if run_step is None:
        return None
    return trainer_pb2.RunStep(run_id=run_step.run_id, step=run_step.step, data_position=run_step.data_position,
                               metrics={k: float(v) for k, v in run_step.metrics.items()})


def run_step_from_pb(request) -> RunStep | None:
    """The request's `run_step`, None when unset; a set one needs a run id."""
    if not request.HasField("run_step"):
        return None
    pb = request.run_step
    if not pb.run_id:
        raise ValueError("run_step.run_id: empty")
    if pb.step < 0:
        raise ValueError(f"run_step.step: must be >= 0, got {pb.step}")
    if pb.data_position < 0:
        raise ValueError(f"run_step.data_position: must be >= 0, got {pb.data_position}")
    return RunStep(pb.run_id, pb.step, pb.data_position, dict(pb.metrics))


def values_request_from_pb(request: trainer_pb2.ValuesRequest) -> tuple[list[str], list[list[int]], list[list[int]]]:
    seqs = request.sequences
    return ([s.id for s in seqs], [field_of(s, "prompt_ids", I32, f"sequences[{i}].") for i, s in enumerate(seqs)],
            [field_of(s, "response_ids", I32, f"sequences[{i}].") for i, s in enumerate(seqs)])


def values_to_pb(ids: list[str], values: list[list[float]]) -> trainer_pb2.ValuesResponse:
    return trainer_pb2.ValuesResponse(results=[trainer_pb2.TokenValues(id=i, values=v) for i, v in zip(ids, values)])


def checkpoint_to_pb(result: dict) -> trainer_pb2.CheckpointResponse:
    return trainer_pb2.CheckpointResponse(path=result["path"], step=result["step"],
                                          weight_version=result["weight_version"],
                                          run_step=run_step_to_pb(result.get("run_step")))


def manifest_to_pb(m: Manifest) -> common_pb2.WeightManifest:
    return common_pb2.WeightManifest(version=m.version, total_bytes=m.total_bytes, adapter=m.adapter,
                                     adapter_config=m.adapter_config, base_id=m.base_id, tensors=[
        common_pb2.TensorSpec(name=t.name, dtype=t.dtype, shape=list(t.shape), offset=t.offset, nbytes=t.nbytes)
        for t in m.tensors])


def optim_to_pb(o: OptimSection) -> trainer_pb2.OptimSettings:
    """A section's RUN_OPTIM_KEYS as the OptimSettings message (its fields bear the same names)."""
    return trainer_pb2.OptimSettings(**{k: getattr(o, k) for k in RUN_OPTIM_KEYS})


def optim_from_pb(pb: trainer_pb2.OptimSettings) -> OptimSection:
    """The message as an OptimSection, unchecked: the section it lands in checks it (OptimSection.with_run, an
    error naming the key), as the YAML is."""
    return OptimSection.model_construct(**{k: tuple(pb.betas) if k == "betas" else getattr(pb, k)
                                           for k in RUN_OPTIM_KEYS})


def run_optim_to_pb(r: RunOptim, *, response: bool = False):
    """A ConfigureRunRequest, or with response=True the ConfigureRunResponse that echoes the values in effect."""
    critic = optim_to_pb(r.critic) if r.critic is not None else None
    if response:
        return trainer_pb2.ConfigureRunResponse(actor=optim_to_pb(r.actor), critic=critic, actor_lr=r.actor_lr,
                                                started_from=r.started_from, weight_version=r.weight_version)
    start = trainer_pb2.RunStart(checkpoint=r.start.checkpoint) if r.start is not None else None
    return trainer_pb2.ConfigureRunRequest(actor=optim_to_pb(r.actor), critic=critic,
                                           reset_schedule=r.reset_schedule, start=start, adapter=r.adapter)


def run_optim_from_pb(pb) -> RunOptim:
    """A ConfigureRunRequest or ConfigureRunResponse as RunOptim; an unset actor is refused by name."""
    if not pb.HasField("actor"):
        raise ValueError("actor: ConfigureRun needs the actor's optimizer settings")
    critic = optim_from_pb(pb.critic) if pb.HasField("critic") else None
    request = isinstance(pb, trainer_pb2.ConfigureRunRequest)
    start = RunStart(pb.start.checkpoint) if request and pb.HasField("start") else None
    return RunOptim(optim_from_pb(pb.actor), critic, reset_schedule=getattr(pb, "reset_schedule", True),
                    start=start, actor_lr=getattr(pb, "actor_lr", 0.0),
                    started_from=getattr(pb, "started_from", ""), weight_version=getattr(pb, "weight_version", 0),
                    adapter=getattr(pb, "adapter", ""))


# ---- the training API's primitives (ForwardBackward, OptimStep) ------------------------------------------------

def datums_to_pb(data: list[Datum]) -> list[trainer_pb2.Datum]:
    return [trainer_pb2.Datum(model_input=d.model_input, target_tokens=d.target_tokens, weights=d.weights,
                              logprobs=d.logprobs, advantages=d.advantages) for d in data]


def forward_backward_to_pb(data: list[Datum], loss: PrimitiveLoss) -> trainer_pb2.ForwardBackwardRequest:
    return trainer_pb2.ForwardBackwardRequest(data=datums_to_pb(data), loss_fn=loss.loss_fn,
                                              loss_fn_config=loss.loss_fn_config)


def forward_backward_from_pb(pb: trainer_pb2.ForwardBackwardRequest) -> tuple[list[Datum], PrimitiveLoss]:
    data = [Datum(list(d.model_input), list(d.target_tokens), list(d.weights), list(d.logprobs), list(d.advantages))
            for d in pb.data]
    return data, PrimitiveLoss(pb.loss_fn or "cross_entropy", dict(pb.loss_fn_config))


def forward_backward_result_to_pb(metrics: dict[str, float],
                                  logprobs: list[list[float]]) -> trainer_pb2.ForwardBackwardResponse:
    return trainer_pb2.ForwardBackwardResponse(outputs=[trainer_pb2.DatumOutput(logprobs=lp) for lp in logprobs],
                                               metrics=metrics)


def adam_to_pb(a: AdamParams) -> trainer_pb2.AdamParams:
    return trainer_pb2.AdamParams(learning_rate=a.learning_rate, beta1=a.beta1, beta2=a.beta2, eps=a.eps,
                                  weight_decay=a.weight_decay, grad_clip_norm=a.grad_clip_norm)


def adam_from_pb(pb: trainer_pb2.AdamParams) -> AdamParams:
    """Unset betas and eps take Tinker's defaults (a set 0 is honoured); learning_rate has none."""
    d = AdamParams()
    return AdamParams(learning_rate=pb.learning_rate, beta1=pb.beta1 if pb.HasField("beta1") else d.beta1,
                      beta2=pb.beta2 if pb.HasField("beta2") else d.beta2, eps=pb.eps if pb.HasField("eps") else d.eps,
                      weight_decay=pb.weight_decay, grad_clip_norm=pb.grad_clip_norm)
