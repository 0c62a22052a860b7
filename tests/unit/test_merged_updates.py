"""Several runs' TrainActor calls in one pass (services/trainer/updates/merged.py, model/lora_mixed.py,
coalesce.TrainMerger): each adapter ends where its update alone takes it (weights, metrics, weight version, stored
push), concurrent calls of different adapters share one command, calls of one adapter or of another loop shape do
not, a call waits (a bounded time) for an adapter whose call is due, and a batch that cannot run in one pass runs
each call alone with its own answer.

Compared with allclose at float32: a merged micro-batch holds other rows (other padded widths) than a call alone,
which changes the kernels' reduction order (metrics about 1e-6 apart on CPU)."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from services.common.config import load_config
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.model import adapter_set
from services.trainer.model.lora import adapter_state, lora_layers
from services.trainer.testing import make_tiny_model
from services.trainer.types import ActorLoss, TrainSample
from services.trainer.updates import merged
from services.trainer.weights import snapshots
from tests.unit.test_trainer_reference_coalescing import _held

LORA = {"rank": 4, "alpha": 8}
NAMES = ["", "a", "b"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("merged_updates") / "m")


def _engine(model: str, device: str = "cpu", **actor) -> TrainerEngine:
    torch.manual_seed(0)            # the named adapters' A's start alike in every engine
    actor = {"lr": 1e-2, "lora": LORA, "compile": False, **actor}
    engine = TrainerEngine(load_config(TrainerSettings, data={"model": {"path": model, "device": device},
                                                              "actor": actor}))
    for name in NAMES[1:]:
        engine.create_adapter(name)
    for name in NAMES:
        snapshots.held(engine.rank, name, False)    # as a push would: updates store their pushes from now on
    return engine


def _samples(engine: TrainerEngine, seed: int, n: int = 4) -> list[TrainSample]:
    """n rows of random lengths, old log-probs the base's (every adapter starts as the base: B = 0)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 32) for _ in range(rng.randint(1, 6))] for _ in range(n)]
    responses = [[rng.randrange(3, 32) for _ in range(rng.randint(2, 9))] for _ in range(n)]
    old = engine.compute_logprobs(prompts, responses)
    return [TrainSample(p, r, [rng.uniform(-1, 1) for _ in r], o) for p, r, o in zip(prompts, responses, old)]


def _calls(engine: TrainerEngine) -> list[tuple]:
    """(samples, loss, adapter) per adapter: two epochs of two mini-batches each, each run its own loss settings."""
    losses = [ActorLoss(ppo_epochs=2, mini_batch_size=2),
              ActorLoss(ppo_epochs=2, mini_batch_size=2, entropy_coef=0.01,
                        policy_loss_settings={"clip_ratio_low": 0.1, "clip_ratio_high": 0.1}),
              ActorLoss(ppo_epochs=2, mini_batch_size=3, loss_agg_mode="seq-mean-token-mean")]
    return [(_samples(engine, seed), loss, name) for seed, (loss, name) in enumerate(zip(losses, NAMES))]


def _weights(engine: TrainerEngine) -> dict[str, dict[str, torch.Tensor]]:
    return {n: {k: v.clone() for k, v in adapter_state(engine.rank.actor.module, n or "default").items()}
            for n in NAMES}


def _close_metrics(got: dict, want: dict) -> None:
    for key in ("loss", "pg_loss", "entropy", "grad_norm", "clip_frac", "approx_kl", "num_optimizer_steps", "lr"):
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key


def test_merged_pass_equals_each_update_alone(model):
    merged_equals_alone(model, "cpu")


def merged_equals_alone(model: str, device: str) -> None:
    alone, together = _engine(model, device), _engine(model, device)
    before = _weights(alone)
    for n in NAMES:
        for k, v in before[n].items():
            torch.testing.assert_close(v, _weights(together)[n][k], rtol=0, atol=0)
    calls = _calls(alone)
    want = [alone.train_actor_step(samples, loss, None, name)[0] for samples, loss, name in calls]
    got = together.commands.run("train_actors", calls)
    for g, w in zip(got, want):
        _close_metrics(g, w)
    after_alone, after_together = _weights(alone), _weights(together)
    for n in NAMES:
        moved = max((after_together[n][k] - before[n][k]).abs().max().item() for k in before[n])
        assert moved > 1e-4, f"adapter {n!r} did not train"
        for k in before[n]:
            # AdamW's steps are about lr (1e-2) whatever the gradient's size: on an entry whose gradient is tiny, the
            # reduction order's 1e-7 moves its step by up to 1e-5 (seen: 9.5e-6); a wrong row or adapter moves 1e-2.
            torch.testing.assert_close(after_together[n][k], after_alone[n][k], rtol=1e-4, atol=3e-5)
    # Each adapter's own version moved once, and its push stored at it; only the run's adapter is active again.
    assert together.rank.weight_version == alone.rank.weight_version
    for n in NAMES[1:]:
        assert adapter_set.get(together.rank, n).weight_version == adapter_set.get(alone.rank, n).weight_version == 1
    for n in NAMES:
        state, version = snapshots.held(together.rank, n, False)
        assert version == (adapter_set.get(together.rank, n).weight_version if n else together.rank.weight_version)
    trainable = {name for name, p in together.rank.actor.module.named_parameters() if p.requires_grad}
    assert trainable and all(".default." in name for name in trainable)
    assert all(layer.active_adapters == ["default"] for layer in lora_layers(together.rank.actor.module).values())


def test_concurrent_calls_of_different_adapters_share_a_pass(model):
    engine = _engine(model)
    calls = _calls(engine)
    same = [(samples, ActorLoss(ppo_epochs=2, mini_batch_size=2), name) for samples, _, name in calls]
    # Run 0 and a second call of adapter "a" (its updates apply in order), then one of another temperature.
    extra = [(same[1][0], ActorLoss(ppo_epochs=2, mini_batch_size=2), "a"),
             (same[2][0], ActorLoss(ppo_epochs=2, mini_batch_size=2, temperature=0.7), "b")]
    jobs = [lambda c=c: engine.train_actor_step(c[0], c[1], None, c[2])[0] for c in same + extra]
    out = _held(engine, engine.train_merger, jobs)
    assert all(isinstance(m, dict) and m["num_optimizer_steps"] == 4 for m in out), out
    info = engine.train_merger.info("train")
    # The first three in one pass; the second "a" and the other temperature each wait for a command of their own
    # (the second "a" may meet the other-temperature "b": different keys never merge).
    assert info["train_merged_calls"] == 3 and info["train_calls"] == 5 and info["train_commands"] == 3, info
    assert adapter_set.get(engine.rank, "a").weight_version == 2


def test_a_batch_that_cannot_run_in_one_pass_runs_each_call_alone(model, monkeypatch):
    engine = _engine(model)
    calls = _calls(engine)
    monkeypatch.setattr(merged, "unmergeable", lambda rank, names: "test: no mixed forward")
    bad = (calls[1][0], calls[1][1], "gone")              # an adapter deleted after its call was checked
    out = engine.commands.run("train_actors", [calls[0], bad, calls[2]])
    assert isinstance(out[1], Exception) and "gone" in str(out[1])
    assert out[0]["num_optimizer_steps"] == 4 and out[2]["num_optimizer_steps"] == 4
    assert adapter_set.get(engine.rank, "b").weight_version == 1


def test_concurrent_logprob_calls_of_different_adapters_share_a_forward(model):
    engine = _engine(model)
    calls = _calls(engine)
    engine.commands.run("train_actors", calls)              # three different adapters now
    rows = [(samples, name) for samples, _, name in calls]
    want = [engine.compute_logprobs([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                                    adapter=name) for samples, name in rows]
    before = engine.actor_logprobs.info("logprobs")
    jobs = [lambda s=samples, n=name: engine.compute_logprobs([x.prompt_ids for x in s], [x.response_ids for x in s],
                                                              adapter=n) for samples, name in rows]
    got = _held(engine, engine.actor_logprobs, jobs)
    info = engine.actor_logprobs.info("logprobs")
    assert info["logprobs_commands"] - before["logprobs_commands"] == 1, info
    for g, w in zip(got, want):
        assert [len(r) for r in g] == [len(r) for r in w]
        for gr, wr in zip(g, w):
            torch.testing.assert_close(torch.tensor(gr), torch.tensor(wr), rtol=1.3e-6, atol=1e-5)
    # Each adapter's own: the adapters trained apart, so their log-probs differ.
    assert max(abs(a - b) for a, b in zip(want[1][0], want[2][0][:len(want[1][0])])) > 1e-4


def test_a_call_waits_for_an_adapter_whose_call_is_due_and_no_longer(model):
    engine = _engine(model)
    calls = _calls(engine)
    same = [(samples, ActorLoss(ppo_epochs=2, mini_batch_size=2), name) for samples, _, name in calls]
    merger = engine.train_merger
    merger._pass_s = 2.0                                    # a pass took 2 s: a leader waits up to 1 s
    now = time.monotonic()
    key = merged.merge_key(engine.rank, same[1][0], same[1][1])
    merger.cadence.arrived("b", now - 19.7, key)
    merger.cadence.arrived("b", now - 9.7, key)                                    # b's next call: in 0.3 s
    merger.cadence.arrived("c", now - 20.0, ("another key",))
    merger.cadence.arrived("c", now - 10.0, ("another key",))                      # due now, but never merges
    out: list = []
    first = threading.Thread(target=lambda: out.append(engine.train_actor_step(*same[1][:2], None, "a")[0]))
    first.start()
    deadline = time.monotonic() + 30
    while merger.queued() < 1:                              # a's call waits for b's (its leader gathering)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    second = engine.train_actor_step(*same[2][:2], None, "b")[0]
    first.join(30)
    info = merger.info("train")
    assert (info["train_commands"], info["train_merged_calls"], info["train_gathers"]) == (1, 2, 1), info
    assert info["train_gather_timeouts"] == 0 and second["num_optimizer_steps"] == out[0]["num_optimizer_steps"] == 4
    # b is due again (its cadence: about 10 s apart) but never comes: a's next call waits 1 s at most, then alone.
    merger._pass_s = 2.0
    merger.cadence.last["b"] = time.monotonic() - 9.7
    t0 = time.monotonic()
    engine.train_actor_step(*same[1][:2], None, "a")
    assert time.monotonic() - t0 >= 0.9
    info = merger.info("train")
    assert (info["train_commands"], info["train_gathers"], info["train_gather_timeouts"]) == (2, 2, 1), info
    # A deleted adapter is waited for no more; an adapter with no cadence yet neither.
    engine.delete_adapter("b")
    merger.cadence.last["b"] = time.monotonic() - 9.7     # as if it had not been forgotten: forget again
    merger.forget("b")
    engine.train_actor_step(*same[1][:2], None, "a")
    assert merger.info("train")["train_gathers"] == 2


def test_merge_wait_passes_sets_how_far_ahead_a_leader_looks_for_due_calls(model):
    """actor.merge_wait_passes: a call due 0.6 s from now is waited for within one pass of 0.8 s, not within the
    default half pass; 0 never waits."""
    for passes, gathers in ((0.5, 0), (1.0, 1), (0.0, 0)):
        engine = _engine(model, merge_wait_passes=passes)
        samples, loss, _ = _calls(engine)[1]
        merger = engine.train_merger
        merger._pass_s = 0.8
        key = merged.merge_key(engine.rank, samples, loss)
        now = time.monotonic()
        merger.cadence.arrived("b", now - 19.4, key)
        merger.cadence.arrived("b", now - 9.4, key)                 # b's next call: in 0.6 s; it never comes
        engine.train_actor_step(samples, loss, None, "a")
        info = merger.info("train")
        assert (info["train_gathers"], info["train_gather_timeouts"]) == (gathers, gathers), (passes, info)


def test_a_merged_pass_that_fails_before_any_step_runs_each_call_alone(model, monkeypatch):
    alone, engine = _engine(model), _engine(model)
    calls = _calls(engine)
    want = [alone.train_actor_step(samples, loss, None, name)[0] for samples, loss, name in _calls(alone)]
    from services.trainer.model import lora_mixed

    def fail(*args):
        raise torch.OutOfMemoryError("the merged pass did not fit")

    monkeypatch.setattr(lora_mixed, "mixed_linear", fail)
    got = engine.commands.run("train_actors", calls)
    for g, w in zip(got, want):
        _close_metrics(g, w)
    for n in NAMES:
        for k, v in _weights(engine)[n].items():
            torch.testing.assert_close(v, _weights(alone)[n][k], rtol=1e-4, atol=3e-5)


def test_a_mixed_pass_runs_each_blocks_adapters_through_four_grouped_ops(model):
    # q/k/v and gate/up each one lora_group op with the adapters' mask, o and down one each, as one adapter's pass
    # runs them. A row's logits are its own adapter's alone.
    from torch.profiler import ProfilerActivity, profile

    from services.trainer.model import lora_mixed
    from services.trainer.model.lora import lora_layers

    engine = _engine(model)
    module = engine.rank.actor.module
    names = [adapter_set.adapter_name(n) for n in NAMES]
    for layer in lora_layers(module).values():
        for n in names:
            torch.nn.init.normal_(layer.lora_B[n].weight, std=0.5)      # B = 0 would make every adapter the base
    ids = torch.randint(3, 32, (3, 5), generator=torch.Generator().manual_seed(0))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with lora_mixed.rows(names, torch.arange(3).repeat_interleave(5)):
            mixed = module(ids, use_cache=False).logits
        mixed.square().mean().backward()
    ops = [e.name for e in prof.events()]
    blocks = module.config.num_hidden_layers
    assert ops.count("_EagerGroup") == ops.count("_EagerGroupBackward") == 4 * blocks      # the eager trainer's op
    with torch.no_grad():
        for row, name in enumerate(NAMES):
            with adapter_set.using(engine.rank, name):
                alone = module(ids[row:row + 1], use_cache=False).logits[0]
            torch.testing.assert_close(mixed[row], alone, rtol=1e-4, atol=1e-5)
