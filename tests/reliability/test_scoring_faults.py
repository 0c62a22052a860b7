"""kill -9 of a reward or reference replica mid-call: the call is retried on the other replica and every
number of the run equals an undisturbed run with the same seed."""

import asyncio

import pytest
import yaml

from tests.reliability.procs import Procs, comparable, coordinator, run_config, with_addresses, write_config

pytestmark = [pytest.mark.slow, pytest.mark.redis]


@pytest.mark.parametrize("role", ["reward", "reference"])
def test_killing_a_scoring_replica_mid_call_retries_elsewhere_and_changes_no_number(arith_model_path, tmp_path,
                                                                                    redis_url, role):
    cfg = run_config(
        arith_model_path, tmp_path / "runs", run={"num_steps": 3},
        rollout={"n": 4},
        # Slow enough to be killed mid-call: a sleeping user reward, a reference that scores one sequence
        # per forward.
        reward={"components": [{"name": "exact_match", "function":
                                "tests.reliability.slow_reward:exact_match_slowly"}], "num_workers": 2},
        reference={"micro_batch_token_budget": 1},
        algorithm={"use_kl_loss": True, "kl_loss_coef": 0.01})
    path = write_config(tmp_path / "run.yaml", cfg)
    with Procs(path, tmp_path / "logs") as procs:
        trainer, rollout, reward1, reward2, ref1, ref2 = procs.start_all(
            [("trainer", []), ("rollout", []), ("reward", []), ("reward", []), ("reference", []),
             ("reference", [])])
        addresses = {"trainer": [trainer.address], "rollout": [rollout.address],
                     "reward": [reward1.address, reward2.address], "reference": [ref1.address, ref2.address]}
        victims = {"reward": (reward1, reward2), "reference": (ref1, ref2)}[role]
        config_text = yaml.safe_dump(with_addresses(cfg, addresses))

        async def main():
            async with coordinator(redis_url) as (engine, client):
                calm = await asyncio.to_thread(client.start_run, config_text, "undisturbed")
                assert (await asyncio.to_thread(client.wait, calm)).state == "COMPLETED"
                undisturbed = await engine.manager.metrics(calm)

                # A fresh trainer, so the second run starts from the same initial weights.
                Procs.kill9(trainer)
                await asyncio.to_thread(procs.restart, trainer)
                hit = await asyncio.to_thread(client.start_run, config_text, "disturbed")
                ctx = engine.manager.contexts[hit]
                pool = getattr(ctx, role)
                for _ in range(8000):
                    busy = [v for v in victims if (r := pool.replicas.get(v.address)) and r.load > 0]
                    if ctx.step >= 1 and busy:
                        break
                    await asyncio.sleep(0.002)
                else:
                    raise AssertionError(f"no {role} call was ever in flight")
                victim = busy[0]
                replica = pool.replicas[victim.address]
                Procs.kill9(victim)
                final = await asyncio.to_thread(client.wait, hit)
                assert final.state == "COMPLETED", final.message
                assert replica.failures >= 1                               # the call did fail over
                disturbed = await engine.manager.metrics(hit)
                assert [m["step"] for m in disturbed] == [m["step"] for m in undisturbed] == [0, 1, 2, 3, 3]
                for a, b in zip(undisturbed, disturbed):
                    assert comparable(a) == comparable(b), a["step"]
                assert "kl" in disturbed[1] and "reward_mean" in disturbed[1]

        asyncio.run(main())
