"""Training families by `algorithm.kind`, and a run opened for one: its data loaded, its pools reachable.

A new family is one file defining its Algorithm (coordinator/training/context.py) and one line in ALGORITHMS (and
its name in AlgorithmConfig.kind). GRPO, PPO, RLOO and REINFORCE++ are one family that differs only in its
advantage estimator (ADVANTAGE_ESTIMATORS in coordinator/training/advantages.py).
"""

from __future__ import annotations

from pathlib import Path

import grpc

from coordinator.recipe import run_settings
from coordinator.recipe.config import RunConfig, distill_coef, trainer_losses
from coordinator.recipe.data import load_dataset
from coordinator.recipe.distill import check_teacher_replicas
from coordinator.training import advantages as adv_fns
from coordinator.training import dpo, loop, remote
from coordinator.training.context import Algorithm, GuardedTrainer, RunContext, TrainerAsReference, drop_adapter
from meshrl.v1 import trainer_pb2
from services.common.errors import FailedPrecondition
from services.common.rpc.channel import create_channel
from services.common.rpc.pools import ReplicaPool, configured
from services.trainer.types import RunStart

ALGORITHMS: dict[str, Algorithm] = {"rl": loop.RL, "dpo": dpo.DPO}

STUBS = {"rollout": remote.rollout_stub, "reward": remote.reward_stub, "reference": remote.reference_stub}


def _pools(cfg: RunConfig, algorithm: Algorithm, token: str | None, registry) -> dict[str, ReplicaPool | None]:
    """A pool per role the run uses: rollout and reward when the algorithm needs them or they are configured,
    reference when configured."""
    pools = {}
    for role, stub_factory in STUBS.items():
        section, kind = getattr(cfg, role), ReplicaPool
        used = configured(section) or (algorithm.needs_rollout and role != "reference")
        if role == "reference" and not used and _trainer_is_reference(cfg) and cfg.trainer.address:
            # Under actor.lora the trainer answers as the reference: its base model with the adapters off.
            section, used = section.model_copy(update={"servers": [cfg.trainer.address]}), True
            kind = TrainerAsReference
        pools[role] = kind.from_section(role, stub_factory, section, registry=registry,
                                        token=token) if used else None
    return pools


def _mesh_roles(cfg: RunConfig, algorithm: Algorithm, why_reference: str) -> tuple[list[str], list[str]]:
    """The roles a run takes from the mesh when its recipe lists none: those it needs, and those it uses when there
    (DPO's rollout and reward, for held-out accuracy). The reference only when the run needs one and the trainer
    does not answer as it (actor.lora without distillation)."""
    own = ["rollout", "reward"]
    required, optional = (own, []) if algorithm.needs_rollout else ([], own)
    if why_reference and not _trainer_is_reference(cfg):
        required = [*required, "reference"]
    return required, optional


def _trainer_is_reference(cfg: RunConfig) -> bool:
    """Under actor.lora the trainer's base model is the reference, unless the run distills: then the reference
    replicas serve the teacher (reference.model_path), which the trainer does not hold."""
    return cfg.actor.lora is not None and distill_coef(cfg.algorithm) == 0


def live_addresses(recorded: dict, cfg: RunConfig) -> dict:
    """A resumed run's recorded config with the addresses it reaches now: the run is held to the settings it
    trained with, not to the ports of the mesh it first ran on (`meshrl up --resume` starts the mesh again on
    others; the coordinator's default pools name them). Env addresses stay as recorded: the rollout replicas hold
    them from their start (a fixed key the replicas are checked against), the run's config names none."""
    out = {section: dict(v) if isinstance(v, dict) else v for section, v in recorded.items()}
    for role in ("rollout", "reward", "reference"):
        if isinstance(out.get(role), dict):
            live = getattr(cfg, role)
            out[role].update(servers=list(live.servers), dns=live.dns, registry=live.registry)
    if isinstance(out.get("trainer"), dict):
        out["trainer"]["address"] = cfg.trainer.address
    return out


def _heldout(cfg: RunConfig, tokenizer) -> list:
    """The held-out problems, through the same path as the training prompts (chat prompts as token ids)."""
    d = cfg.data
    if not d.heldout_files:
        return []
    ds = load_dataset(d.heldout_files, key="data.heldout_files", prompt_key=d.prompt_key, answer_key=d.answer_key,
                      reward_fn_key=d.reward_fn_key, tokenizer=tokenizer, apply_chat_template=d.apply_chat_template)
    heldout = ds.problems[:d.heldout_size] if d.heldout_size else ds.problems
    cfg.reward.check_data_sources({p.data_source: ds.sources[p.data_source] for p in heldout})
    return heldout


async def open_context(run_id: str, cfg: RunConfig, *, registry=None, position: int = 0,
                       recorded: dict | None = None, resume: bool = False, defaults=None,
                       start: RunStart | None = None, claim=None, adapter: str = "") -> RunContext:
    """Loads the run's data, connects to every pool and the trainer (fails early when a pool is empty), and
    settles the run's settings with the running services (coordinator/recipe/run_settings.py): fixed keys checked,
    the trainer's optimizer configured (and its weights set to `start`'s, for a run that starts); the context
    carries the effective config and where the weights came from. `defaults` (the mesh's replicas,
    coordinator/runapi/default_pools.py) fill the roles and the trainer the recipe names none for; `claim(cfg)`
    refuses a trainer another run holds, or answers the named adapter the run trains beside the others (`adapter`:
    a resumed run's, as recorded); a named adapter is made anew on the trainer (as the base) before it is set."""
    algorithm = ALGORITHMS[cfg.algorithm.kind]
    token = cfg.server.auth_token.get_secret_value() if cfg.server.auth_token else None
    data, state, heldout = _load(cfg, algorithm, position)
    why = algorithm.reference_needed(cfg, state)
    if defaults is not None:
        cfg = await defaults.fill_trainer(cfg)
        cfg = await defaults.fill(cfg, *_mesh_roles(cfg, algorithm, why))
    adapter = _check_beside(cfg, algorithm, claim(cfg) if claim is not None else adapter, start)
    if recorded is not None:
        recorded = live_addresses(recorded, cfg)
    pools = _pools(cfg, algorithm, token, registry)
    if why and pools["reference"] is None:
        raise ValueError(f"reference.servers: {why}; list reference replicas in the recipe (reference.servers), "
                         f"or start the run on a mesh that has one (`meshrl mesh RECIPE`)")
    if not cfg.trainer.address:
        raise ValueError("trainer.address: no trainer address configured")
    trainer_channel = create_channel(cfg.trainer.address, token=token, timeout=cfg.trainer.timeout_s)
    trainer = GuardedTrainer(remote.trainer_stub(trainer_channel), cfg.trainer.address)
    try:
        await _reach(pools)
        if adapter:
            await _new_adapter(trainer, adapter, cfg.trainer.address)
            trainer.adapter, start = adapter, None
        running: list[run_settings.Running] = []
        applied: list = []
        asked, cfg = cfg, await run_settings.settle(cfg, pools.values(), trainer, cfg.trainer.address,
                                                    recorded=recorded, resume=resume, seen=running, start=start,
                                                    applied=applied)
        if distill_coef(cfg.algorithm) > 0:        # the teachers the replicas serve: the student's token ids
            check_teacher_replicas(cfg.actor.model_path or cfg.model.path, running)
        if cfg.model.path != asked.model.path:      # the running services' model: its tokenizer
            data, state, heldout = _load(cfg, algorithm, position)
    except BaseException:
        if trainer.adapter:
            await drop_adapter(trainer, adapter)
        await _close(pools, trainer_channel)
        raise
    run_dir = Path(cfg.run.run_dir) / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    # What the run trains with, `auto` keys as the services resolved them (GetInfo details["resolved"]).
    (run_dir / "recipe.yaml").write_text(run_settings.resolved_recipe(cfg, running))
    ctx = RunContext(run_id, cfg, algorithm, run_dir, pools["rollout"], pools["reward"], pools["reference"],
                     trainer_channel, trainer, data, heldout, trainer_losses(cfg), state)
    ctx.started_from = applied[0].started_from if applied else ""
    if adapter:
        ctx.adapter, ctx.weight_version = adapter, applied[0].weight_version
        ctx.started_from = f"model.path {cfg.model.path} (the base, as named adapter {adapter!r} beside other runs)"
    return _with_kl(ctx)


def _with_kl(ctx: RunContext) -> RunContext:
    a = ctx.cfg.algorithm
    ctx.kl_coef = a.kl_coef
    if a.use_kl_in_reward and a.kl_ctrl == "adaptive":
        ctx.kl_controller = adv_fns.AdaptiveKLController(a.kl_coef, a.target_kl, a.kl_horizon)
    return ctx


def _check_beside(cfg: RunConfig, algorithm: Algorithm, adapter: str, start: RunStart | None) -> str:
    """A run beside others trains a new named adapter with the RL loop: what it cannot honour is refused by name.
    -> the adapter."""
    if not adapter:
        return adapter
    if start is not None and start.checkpoint:
        raise FailedPrecondition(f"run.init_from: this run trains beside others on the trainer, as a new adapter "
                                 f"{adapter!r} over the base; it cannot start from checkpoint {start.checkpoint}")
    if algorithm is not loop.RL:
        raise FailedPrecondition(f"algorithm.kind: {cfg.algorithm.kind} runs alone on its trainer; a run beside "
                                 f"others (named adapter {adapter!r}) is an RL run of a LoRA actor")
    return adapter


def _load(cfg: RunConfig, algorithm: Algorithm, position: int):
    """The run's data with the model's tokenizer: the family's stream, its own state and the held-out set."""
    from services.common.tensors.modeling import load_tokenizer

    tokenizer = load_tokenizer(cfg.model.path)
    data, state = algorithm.load(cfg, tokenizer, position)
    return data, state, _heldout(cfg, tokenizer)


async def _new_adapter(trainer: GuardedTrainer, name: str, address: str) -> None:
    """The run's named adapter, made fresh (a resumed run's left over from before is dropped first); a trainer that
    cannot hold one (not LoRA, several processes, compiled) is refused with its reason."""
    await drop_adapter(trainer, name)
    try:
        await trainer.CreateAdapter(trainer_pb2.AdapterRequest(name=name))
    except grpc.aio.AioRpcError as e:
        if e.code() not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
            raise
        raise FailedPrecondition(f"trainer.address: another run trains on the trainer at {address}, so this run "
                                 f"needs its own adapter there, which it refused: {e.details()}") from None


async def _reach(pools: dict[str, ReplicaPool | None]) -> None:
    for pool in pools.values():
        if pool is not None and not await pool.refresh():
            raise ValueError(f"{pool.role}.servers: no healthy {pool.role} replica reachable "
                             f"(tried {sorted(pool.replicas) or 'none configured'})")


async def _close(pools: dict[str, ReplicaPool | None], trainer_channel) -> None:
    for pool in pools.values():
        if pool is not None:
            await pool.close()
    await trainer_channel.close()
