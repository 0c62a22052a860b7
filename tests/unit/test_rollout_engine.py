"""Unit tests of the rollout torch engine (no gRPC): sampling, stops, limits, log-prob parity, weight swaps."""

from __future__ import annotations

import asyncio
import pytest
import torch

from services.common.tensors.modeling import response_logprobs
from services.common.tensors.weights import build_manifest, iter_buckets
from services.rollout.config import RolloutSettings
from services.rollout.engine_torch.engine import TorchEngine
from services.rollout.engine_torch.sampling import sample_tokens, top_p_filter
from services.rollout.testing import make_tiny_model, random_state_like
from services.rollout.types import GenerateBatch, PromptInput, SamplingParams

PROMPTS = [[4, 5, 13, 6, 15], [7, 3, 9, 12, 8, 10, 11, 14, 16, 4, 4, 5], [20]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("rollout_model"))


@pytest.fixture(scope="module")
def bare_model_dir(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("rollout_bare"), with_tokenizer=False)


def make_engine(path: str, **rollout) -> TorchEngine:
    return TorchEngine(RolloutSettings(model={"path": path}, rollout=rollout))


@pytest.fixture(scope="module")
def engine(model_dir) -> TorchEngine:
    return make_engine(model_dir)


def gen(engine, prompts=PROMPTS, **sampling):
    batch = GenerateBatch([PromptInput(id=f"p{i}", prompt_ids=list(p)) for i, p in enumerate(prompts)],
                          SamplingParams(**sampling))
    return asyncio.run(engine.generate(batch))


def flat(results):
    return [s for r in results for s in r.samples]


def test_each_prompt_gets_n_samples_in_request_order(engine):
    results = gen(engine, n=3, temperature=1.0, max_tokens=6)
    assert [r.prompt_id for r in results] == ["p0", "p1", "p2"]
    assert [r.prompt_ids for r in results] == PROMPTS
    assert all(len(r.samples) == 3 for r in results)
    for s in flat(results):
        assert 1 <= len(s.response_ids) <= 6
        assert len(s.logprobs) == len(s.response_ids)
        assert s.finish_reason in ("stop", "length")
        assert s.weight_version == 0


def test_greedy_decoding_is_deterministic_and_the_same_for_every_sample(engine):
    a = gen(engine, n=2, temperature=0, max_tokens=10)
    b = gen(engine, n=1, temperature=0, max_tokens=10)
    for ra, rb in zip(a, b):
        assert ra.samples[0].response_ids == ra.samples[1].response_ids == rb.samples[0].response_ids


def test_greedy_tokens_are_the_argmax_of_a_full_forward_pass(engine):
    s = gen(engine, prompts=[PROMPTS[0]], temperature=0, max_tokens=8)[0].samples[0]
    ids = torch.tensor([PROMPTS[0] + s.response_ids])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0]
    expected = logits[len(PROMPTS[0]) - 1:-1].argmax(-1).tolist()
    assert s.response_ids == expected


def test_seeded_sampling_is_reproducible(engine):
    a = gen(engine, n=4, temperature=1.0, top_p=0.9, max_tokens=12, seed=1234)
    b = gen(engine, n=4, temperature=1.0, top_p=0.9, max_tokens=12, seed=1234)
    c = gen(engine, n=4, temperature=1.0, top_p=0.9, max_tokens=12, seed=4321)
    ids = lambda res: [s.response_ids for s in flat(res)]  # noqa: E731
    assert ids(a) == ids(b)
    assert ids(a) != ids(c)
    assert [s.logprobs for s in flat(a)] == [s.logprobs for s in flat(b)]


def test_seeded_sampling_does_not_depend_on_batch_chunking(model_dir):
    whole = make_engine(model_dir, max_batch_size=64)
    chunked = make_engine(model_dir, max_batch_size=2)
    a = gen(whole, n=3, temperature=1.0, max_tokens=10, seed=7)
    b = gen(chunked, n=3, temperature=1.0, max_tokens=10, seed=7)
    assert [s.response_ids for s in flat(a)] == [s.response_ids for s in flat(b)]


def test_a_seeded_sample_depends_on_its_prompt_not_on_its_position_in_the_batch(engine):
    together = gen(engine, n=2, temperature=1.0, max_tokens=10, seed=8)
    alone = gen(engine, prompts=[PROMPTS[2]], n=2, temperature=1.0, max_tokens=10, seed=8)
    assert [s.response_ids for s in together[2].samples] == [s.response_ids for s in alone[0].samples]


def test_samples_of_one_prompt_differ_when_sampling(engine):
    r = gen(engine, prompts=[PROMPTS[0]], n=4, temperature=1.0, max_tokens=16, seed=3)[0]
    assert len({tuple(s.response_ids) for s in r.samples}) > 1


def test_max_tokens_ends_samples_with_length(engine):
    for s in flat(gen(engine, n=2, temperature=0, max_tokens=5)):
        assert s.finish_reason == "length"
        assert len(s.response_ids) == 5


def test_generation_stops_at_max_model_len(model_dir):
    eng = make_engine(model_dir, max_model_len=20)
    s = gen(eng, prompts=[list(range(3, 20))], temperature=0, max_tokens=10)[0].samples[0]
    assert len(s.response_ids) == 3            # 17 prompt tokens + 3 = 20
    assert s.finish_reason == "length"


def test_stop_string_ends_the_sample_and_is_cut_from_the_text(engine):
    free = gen(engine, prompts=[PROMPTS[0]], temperature=0, max_tokens=12)[0].samples[0]
    assert len(free.text) >= 6
    stop = free.text[3:5]
    cut = free.text.find(stop)
    s = gen(engine, prompts=[PROMPTS[0]], temperature=0, max_tokens=12, stop=[stop, "never-seen"])[0].samples[0]
    assert s.finish_reason == "stop"
    assert s.text == free.text[:cut]
    # The tokens that completed the stop string stay in response_ids (the trainer needs them).
    assert s.response_ids == free.response_ids[:cut + len(stop)]
    assert len(s.logprobs) == len(s.response_ids)


def test_eos_ends_the_sample_with_stop_and_is_included(model_dir):
    eng = make_engine(model_dir)
    free = gen(eng, prompts=[PROMPTS[1]], temperature=0, max_tokens=10)[0].samples[0]
    eos = free.response_ids[3]
    eng.eos_ids = {eos}
    s = gen(eng, prompts=[PROMPTS[1]], temperature=0, max_tokens=10)[0].samples[0]
    first = free.response_ids.index(eos)
    assert s.finish_reason == "stop"
    assert s.response_ids == free.response_ids[:first + 1]


def test_text_prompts_are_tokenized_and_responses_decoded(engine):
    r = asyncio.run(engine.generate(GenerateBatch([PromptInput(id="t", text="12+3=")],
                                                  SamplingParams(temperature=0, max_tokens=6))))[0]
    assert r.prompt_ids == [1, 4, 5, 13, 6, 15]          # bos, then one id per character
    s = r.samples[0]
    assert s.text == engine.tokenizer.decode(s.response_ids, skip_special_tokens=True)


@pytest.mark.parametrize("sampling", [dict(n=3, temperature=1.0, top_p=1.0, seed=11),
                                      dict(n=2, temperature=0.7, top_p=0.8, seed=12),
                                      dict(n=1, temperature=0)])
def test_sampled_logprobs_equal_the_trainers_right_padded_logprobs(model_dir, sampling):
    eng = make_engine(model_dir, max_batch_size=4)   # chunked, with rows finishing at different steps
    results = gen(eng, max_tokens=24, **sampling)
    prompts = [r.prompt_ids for r in results for _ in r.samples]
    samples = flat(results)
    lp, mask = response_logprobs(eng.model, prompts, [s.response_ids for s in samples], pad_id=eng.pad_id)
    for i, s in enumerate(samples):
        expected = lp[i, :len(s.response_ids)]
        assert torch.allclose(torch.tensor(s.logprobs), expected, atol=1e-4, rtol=0), i


def test_compute_logprobs_matches_generation_logprobs(engine):
    results = gen(engine, n=2, temperature=1.0, max_tokens=10, seed=5)
    prompts = [r.prompt_ids for r in results for _ in r.samples]
    samples = flat(results)
    logprobs, version = asyncio.run(engine.logprobs(prompts, [s.response_ids for s in samples]))
    assert version == 0
    for got, s in zip(logprobs, samples):
        assert max(abs(a - b) for a, b in zip(got, s.logprobs)) < 1e-4


def test_top_p_filter_keeps_the_smallest_set_reaching_the_mass():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert torch.equal(top_p_filter(probs, 0.7), torch.tensor([[0.5, 0.3, 0.0, 0.0]]))
    assert torch.equal(top_p_filter(probs, 0.5), torch.tensor([[0.5, 0.0, 0.0, 0.0]]))
    assert torch.equal(top_p_filter(probs, 1.0), probs)


def test_sampling_follows_the_tempered_distribution():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]])).repeat(20000, 1)
    torch.manual_seed(0)
    counts = torch.bincount(sample_tokens(logits, temperature=1.0, top_p=1.0, generators=None), minlength=3)
    assert torch.allclose(counts.float() / 20000, torch.tensor([0.6, 0.3, 0.1]), atol=0.015)
    nucleus = sample_tokens(logits, temperature=1.0, top_p=0.6, generators=None)
    assert set(nucleus.tolist()) == {0}


@pytest.mark.parametrize("prompts, sampling, field", [
    ([], dict(), "prompts: empty batch"),
    ([[4]], dict(n=0), "sampling.n"),
    ([[4]], dict(temperature=-1.0), "sampling.temperature"),
    ([[4]], dict(top_p=1.5), "sampling.top_p"),
    ([[4]], dict(top_p=-0.1), "sampling.top_p"),
    ([[4]], dict(max_tokens=0), "sampling.max_tokens"),
    ([[4, 99]], dict(), "prompts[0].prompt_ids: token id 99"),
    ([[4], [-1]], dict(), "prompts[1].prompt_ids: token id -1"),
    ([[4] * 64], dict(), "prompts[0]: 64 tokens"),
])
def test_bad_generate_input_is_a_value_error_naming_the_field(engine, prompts, sampling, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        gen(engine, prompts=prompts, **sampling)


def test_text_without_a_tokenizer_is_rejected_but_prompt_ids_work(bare_model_dir):
    eng = make_engine(bare_model_dir)
    assert eng.tokenizer is None
    with pytest.raises(ValueError, match=r"prompts\[0\].text"):
        asyncio.run(eng.generate(GenerateBatch([PromptInput(text="1+1=")], SamplingParams())))
    with pytest.raises(ValueError, match="sampling.stop"):
        gen(eng, stop=["x"])
    s = gen(eng, prompts=[[4, 5]], temperature=0, max_tokens=3)[0].samples[0]
    assert len(s.response_ids) == 3 and s.text == ""


async def _aiter(items):
    for x in items:
        yield x


def test_weight_update_swaps_every_tensor_and_sets_the_version(model_dir, tmp_path):
    eng = make_engine(model_dir)
    new = random_state_like(eng.model, seed=1)
    out = asyncio.run(eng.update_weights(build_manifest(new, 3), _aiter(iter_buckets(new, 1000))))
    assert out["weight_version"] == eng.weight_version == 3
    assert out["num_bytes"] == sum(t.numel() * t.element_size() for t in new.values())
    # Generation now reports the new version and log-probs of the new weights.
    reference = make_engine(model_dir)
    for name, p in reference.model.named_parameters():
        if name in new:
            p.data.copy_(new[name])
    results = gen(eng, n=2, temperature=1.0, max_tokens=8, seed=2)
    samples = flat(results)
    assert {s.weight_version for s in samples} == {3}
    prompts = [r.prompt_ids for r in results for _ in r.samples]
    lp, _ = response_logprobs(reference.model, prompts, [s.response_ids for s in samples], pad_id=0)
    for i, s in enumerate(samples):
        assert torch.allclose(torch.tensor(s.logprobs), lp[i, :len(s.logprobs)], atol=1e-4, rtol=0)


def test_a_bad_bucket_leaves_the_old_weights_and_version(model_dir):
    eng = make_engine(model_dir)
    before = {k: v.clone() for k, v in eng.model.state_dict().items()}
    new = random_state_like(eng.model, seed=2)
    buckets = list(iter_buckets(new, 4096))
    data, crc = buckets[2]
    buckets[2] = (data[:-1] + bytes([data[-1] ^ 1]), crc)
    with pytest.raises(ValueError, match="bucket 2: checksum mismatch"):
        asyncio.run(eng.update_weights(build_manifest(new, 1), _aiter(buckets)))
    assert eng.weight_version == 0
    assert all(torch.equal(before[k], v) for k, v in eng.model.state_dict().items())


def test_a_wrong_shape_tensor_is_rejected_by_name(model_dir):
    eng = make_engine(model_dir)
    new = random_state_like(eng.model, seed=3)
    name = "model.layers.1.mlp.up_proj.weight"
    new[name] = torch.zeros(3, 5)
    with pytest.raises(ValueError, match=f"{name}.*shape"):
        asyncio.run(eng.update_weights(build_manifest(new, 1), _aiter(iter_buckets(new))))
    assert eng.weight_version == 0


def test_a_truncated_payload_is_rejected(model_dir):
    eng = make_engine(model_dir)
    new = random_state_like(eng.model, seed=4)
    buckets = list(iter_buckets(new, 4096))[:-1]
    with pytest.raises(ValueError, match="truncated"):
        asyncio.run(eng.update_weights(build_manifest(new, 1), _aiter(buckets)))
    assert eng.weight_version == 0


def test_requests_that_queue_behind_a_running_one_are_decoded_together_with_their_own_settings(model_dir):
    eng = make_engine(model_dir)
    batches = [GenerateBatch([PromptInput(id="a", prompt_ids=PROMPTS[0])],
                             SamplingParams(n=2, temperature=1.0, max_tokens=20, seed=1)),
               GenerateBatch([PromptInput(id="b", prompt_ids=PROMPTS[1])], SamplingParams(temperature=0, max_tokens=3)),
               GenerateBatch([PromptInput(id="c", prompt_ids=PROMPTS[2]), PromptInput(id="d", prompt_ids=PROMPTS[0])],
                             SamplingParams(n=3, temperature=0.7, top_p=0.5, max_tokens=9, seed=2, top_logprobs=2))]
    solo = [eng.generate_sync(b) for b in batches]
    before = dict(eng.stats)

    async def together():
        return await asyncio.gather(*(eng.generate(b) for b in batches))

    coalesced = asyncio.run(together())
    assert eng.stats["requests"] - before["requests"] == 3
    assert eng.stats["decode_batches"] - before["decode_batches"] == 2    # the first alone, then b and c at once
    for got, want in zip(coalesced, solo):
        assert [r.prompt_id for r in got] == [r.prompt_id for r in want]
        assert [[s.response_ids for s in r.samples] for r in got] == [[s.response_ids for s in r.samples] for r in want]
    assert all(len(s.response_ids) == 3 for s in coalesced[1][0].samples)
    assert all(len(step) == 2 for s in flat(coalesced[2]) for step in s.top_logprobs)
    assert flat(coalesced[0])[0].top_logprobs is None
    samples = flat(coalesced[2])
    prompts = [r.prompt_ids for r in coalesced[2] for _ in r.samples]
    lp, _ = response_logprobs(eng.model, prompts, [s.response_ids for s in samples], pad_id=0)
    for i, s in enumerate(samples):
        assert torch.allclose(torch.tensor(s.logprobs), lp[i, :len(s.logprobs)], atol=1e-4, rtol=0)


def test_a_cancelled_generation_holds_the_lock_until_its_thread_ends(model_dir, monkeypatch):
    import threading

    import services.rollout.engine_torch.engine as engine_module

    eng = make_engine(model_dir, max_batch_size=1)
    order = []
    started, may_finish = threading.Event(), threading.Event()
    real_jobs, real_apply = eng._generate_jobs, engine_module.swap_in

    def held_jobs(jobs):
        started.set()
        assert may_finish.wait(60)          # the caller is cancelled meanwhile
        out = real_jobs(jobs)
        order.append("generation done")
        return out

    def apply(model, tensors, **kwargs):
        order.append("apply started")
        return real_apply(model, tensors, **kwargs)

    monkeypatch.setattr(eng, "_generate_jobs", held_jobs)
    monkeypatch.setattr(engine_module, "swap_in", apply)
    new = random_state_like(eng.model, seed=9)

    async def main():
        task = asyncio.create_task(eng.generate(GenerateBatch([PromptInput(prompt_ids=PROMPTS[0])],
                                                              SamplingParams(n=4, max_tokens=10))))
        assert await asyncio.to_thread(started.wait, 60)
        task.cancel()          # what grpc does when the client goes away
        await asyncio.sleep(0)  # one loop turn: the cancellation reaches the caller, whose thread still runs
        waiting = not task.done() and eng._lock.locked()
        may_finish.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        await eng.update_weights(build_manifest(new, 1), _aiter(iter_buckets(new)))
        return waiting

    assert asyncio.run(main())          # cancelled, yet still waiting for its thread under the lock
    assert order == ["generation done", "apply started"]
    assert eng.weight_version == 1
