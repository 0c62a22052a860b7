"""Run-scoped settings against running services, through the plain gRPC run API: two runs one after the other
train with their own learning rates and reward components, a run asking a reward model the replica lacks or
another mesh is refused naming the key, and GetRun shows the effective config."""

import asyncio

import grpc
import pytest
import yaml

from coordinator.runapi.service import CoordinatorSettings, start as start_coordinator
from meshrl.v1 import coordinator_pb2, coordinator_pb2_grpc
from services.common.config import deep_merge, load_config
from services.local import start_local_mesh

pytestmark = pytest.mark.slow


def services_config(model_path: str, run_dir) -> dict:
    """What the services start with: the trainer's lr 2e-5 and the default reward (exact_match for arith rows)."""
    return {
        "model": {"path": model_path},
        "rollout": {"n": 2, "max_tokens": 4, "max_batch_size": 32},
        "actor": {"lr": 2e-5},
        "data": {"train_files": ["examples/arith/data/train.jsonl"],
                 "heldout_files": ["examples/arith/data/heldout.jsonl"], "heldout_size": 2, "rollout_batch_size": 2},
        "run": {"num_steps": 2, "run_dir": str(run_dir)},
    }


def run_config(mesh, *, drop: tuple[str, ...] = (), **changes) -> str:
    """The services' config with their addresses, less the `drop` keys, with this run's changes (dotted keys)."""
    data = deep_merge(mesh.config, {})
    for key in ("rollout.max_batch_size", *drop):
        section, leaf = key.split(".")
        data[section] = {k: v for k, v in data[section].items() if k != leaf}
    for key, value in changes.items():
        section, leaf = key.split(".")
        data = deep_merge(data, {section: {leaf: value}})
    return yaml.safe_dump(data)


def run_to_end(stub, config: str) -> tuple[coordinator_pb2.RunStatus, list[dict]]:
    run_id = stub.StartRun(coordinator_pb2.StartRunRequest(config=config)).run_id
    steps = [dict(m.metrics) for m in stub.StreamMetrics(coordinator_pb2.StreamMetricsRequest(run_id=run_id))
             if "reward_mean" in m.metrics]
    return stub.GetRun(coordinator_pb2.RunRequest(run_id=run_id)), steps


def refusal(stub, config: str) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        stub.StartRun(coordinator_pb2.StartRunRequest(config=config))
    return err.value.code(), err.value.details()


def against_services(model_path: str, tmp_path, scenario):
    """Runs `scenario(stub, mesh)` in a thread against a local mesh and a coordinator; returns (mesh, result)."""
    async def main():
        mesh = await start_local_mesh(services_config(model_path, tmp_path), num_rollout=1, num_reference=0)
        server, port, engine = await start_coordinator(load_config(CoordinatorSettings, data={}), "127.0.0.1:0")
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        try:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            return mesh, await asyncio.to_thread(scenario, stub, mesh)
        finally:
            channel.close()
            await engine.close()
            await server.stop(0)
            await mesh.stop()

    return asyncio.run(main())


def test_runs_train_with_their_own_learning_rate_and_components_and_fixed_keys_are_refused(arith_model_path,
                                                                                          tmp_path):
    def scenario(stub, mesh):
        first = run_to_end(stub, run_config(mesh, **{"actor.lr": 0.5}))
        # Leaves actor.lr out (the trainer's 2e-5 applies) and asks other components.
        second = run_to_end(stub, run_config(mesh, drop=("actor.lr",), **{
            "reward.components": [{"name": "boxed", "weight": 2.0}, {"name": "exact_match", "label": "em"}]}))
        # rollout.n left out: the replica's 2 applies, so GRPO has its groups (the check runs on the effective
        # config); asked for explicitly, 1 is refused before any service is called.
        third = run_to_end(stub, run_config(mesh, drop=("rollout.n",)))
        one_sample = refusal(stub, run_config(mesh, **{"rollout.n": 1}))
        model = refusal(stub, run_config(mesh, **{"reward.components": [{"name": "embedding"}]}))
        mesh_size = refusal(stub, run_config(mesh, **{"actor.tp_size": 3}))
        no_trainer = refusal(stub, run_config(mesh, **{"trainer.address": "127.0.0.1:1"}))
        stub.StartRun(coordinator_pb2.StartRunRequest(config=run_config(mesh, **{"run.num_steps": 1000}),
                                                      run_id="long"))
        busy = refusal(stub, run_config(mesh))
        stub.StopRun(coordinator_pb2.RunRequest(run_id="long"))
        return first, second, third, one_sample, model, mesh_size, no_trainer, busy

    mesh, ((first, first_steps), (second, second_steps), (third, _), one_sample, model, mesh_size, no_trainer,
           busy) = \
        against_services(arith_model_path, tmp_path, scenario)
    assert third.state == coordinator_pb2.RUN_STATE_COMPLETED
    assert yaml.safe_load(third.config)["rollout"]["n"] == 2
    assert one_sample == (grpc.StatusCode.INVALID_ARGUMENT, (
        "rollout.n: algorithm.adv_estimator grpo compares the samples of each prompt and needs rollout.n >= 2, "
        "got 1 (one sample has no baseline and trains on nothing)"))
    assert first.state == second.state == coordinator_pb2.RUN_STATE_COMPLETED
    assert [m["actor/lr"] for m in first_steps] == [0.5, 0.5]
    assert [m["actor/lr"] for m in second_steps] == [2e-5, 2e-5]
    assert all("reward/default" in m and "reward/boxed" not in m for m in first_steps)
    assert all({"reward/boxed", "reward/em"} <= m.keys() and "reward/default" not in m for m in second_steps)
    reward_at = mesh.addresses["reward"][0]
    assert model == (grpc.StatusCode.INVALID_ARGUMENT, (
        f'reward.components: the running reward replica {reward_at} has [{{"call": "meshrl", "function": null, '
        f'"label": null, "name": "default", "params": {{}}, "weight": 1.0}}], this run asks [{{"call": "meshrl", '
        f'"function": null, "label": null, "name": "embedding", "params": {{}}, "weight": 1.0}}] (reward models '
        f'and user functions are loaded when the replica starts; restart it to change, or use built-in rules only)'))
    assert mesh_size == (grpc.StatusCode.INVALID_ARGUMENT, "actor.tp_size: the running trainer has 1, this run "
                                                           "asks 3 (set when the trainer starts; restart it to change)")
    # nobody answers at the recipe's trainer: its key, not INTERNAL (nor UNAVAILABLE, which clients retry)
    assert no_trainer[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert no_trainer[1].startswith("trainer.address: no trainer answers at 127.0.0.1:1 (trainer 127.0.0.1:1 "
                                    "unavailable during "), no_trainer
    trainer_at = mesh.addresses["trainer"][0]
    assert busy == (grpc.StatusCode.FAILED_PRECONDITION, (
        f"trainer.address: the trainer at {trainer_at} is training full-parameter run 'long'; a full-parameter run "
        f"holds its trainer alone (stop that run or wait for its end, or start another trainer)"))
    effective = yaml.safe_load(first.config)
    assert effective["actor"]["lr"] == 0.5
    # Left out by the runs, reported by the running services.
    assert effective["reward"]["components"][0]["name"] == "default"
    assert effective["rollout"]["max_batch_size"] == 32 and effective["actor"]["tp_size"] == 1
    assert "auth_token" not in effective["server"]
    second_effective = yaml.safe_load(second.config)
    assert second_effective["actor"]["lr"] == 2e-5
    assert [c["name"] for c in second_effective["reward"]["components"]] == ["boxed", "exact_match"]
