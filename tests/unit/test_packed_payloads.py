"""Packed payload fields (services/common/packed.py): the same values as the repeated fields, read in either
form, bad packed input named by field, and a packed TrainActor identical to a repeated one."""

from __future__ import annotations

import math

import numpy as np
import pytest

from meshrl.v1 import common_pb2, rollout_pb2
from services.common import convert as common_convert
from services.common.config import load_config
from services.common.packed import F32, I32, field_of, pack_f32, pack_i32
from services.rollout import convert as rollout_convert
from services.rollout.engine import PromptResult, SampleResult
from services.trainer import convert as trainer_convert
from services.trainer.batch import ActorLoss, validate_actor_batch
from services.trainer.engine import TrainerEngine, TrainerSettings
from services.trainer.testing import make_tiny_model, random_samples


def test_field_of_reads_either_form_and_names_bad_packed_input():
    s = common_pb2.TokenSequence(prompt_ids=[1, 2], response_ids_packed=pack_i32([3, 4, 5]))
    assert field_of(s, "prompt_ids", I32) == [1, 2]
    r = field_of(s, "response_ids", I32)
    assert isinstance(r, np.ndarray) and r.tolist() == [3, 4, 5]
    with pytest.raises(ValueError, match=r"sequences\[2\]\.response_ids_packed: 5 bytes"):
        field_of(common_pb2.TokenSequence(response_ids_packed=b"\x00" * 5), "response_ids", I32, "sequences[2].")
    with pytest.raises(ValueError, match="response_ids: both the repeated and the packed field are set"):
        field_of(common_pb2.TokenSequence(response_ids=[1], response_ids_packed=pack_i32([1])), "response_ids", I32)


def test_rollout_results_round_trip_packed_and_repeated_alike():
    results = [PromptResult(prompt_id="p0", prompt_ids=[4, 5], samples=[
        SampleResult(response_ids=[7, 8, 9], logprobs=[-0.5, -1.25, -3.0], text="x", finish_reason="stop",
                     weight_version=3)])]
    packed = rollout_convert.results_to_pb(results, packed=True)
    plain = rollout_convert.results_to_pb(results)
    assert not packed.responses[0].samples[0].response_ids and packed.responses[0].samples[0].response_ids_packed
    back = rollout_convert.results_from_pb(rollout_pb2.GenerateResponse.FromString(packed.SerializeToString()))
    assert back == rollout_convert.results_from_pb(plain) == results


def test_logprobs_round_trip_packed():
    batch = common_convert.SequenceBatch(ids=["a", "b"], prompts=[[1], [2, 3]], responses=[[4, 5], [6]])
    req = common_convert.sequences_to_pb(batch, packed=True)
    assert req.packed and not req.sequences[0].response_ids
    parsed = common_convert.sequences_from_pb(common_pb2.LogProbsRequest.FromString(req.SerializeToString()))
    assert [list(p) for p in parsed.prompts] == batch.prompts and [list(r) for r in parsed.responses] == batch.responses
    as_lists = common_convert.sequences_from_pb(req, as_lists=True)
    assert as_lists.responses == batch.responses and all(isinstance(r, list) for r in as_lists.responses)
    answer = common_convert.logprobs_to_pb(batch.ids, [[-0.25, -1.5], [-2.0]], 0, packed=True)
    assert common_convert.logprobs_from_pb(answer) == [[-0.25, -1.5], [-2.0]]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_packed") / "model")


def engine(model_path: str) -> TrainerEngine:
    return TrainerEngine(load_config(TrainerSettings, data={"model": {"path": model_path}, "actor": {"lr": 1e-3}}))


def test_a_packed_train_actor_request_trains_exactly_as_the_repeated_one(model_path):
    samples = random_samples(5, seed=2)
    for s in samples:
        s.ref_logprobs = [-1.0 - 0.01 * t for t in range(len(s.response_ids))]
    loss = ActorLoss(kl_coef=0.01)
    metrics = {}
    for packed in (False, True):
        request = trainer_convert.train_actor_to_pb(samples, loss, packed=packed)
        parsed, parsed_loss = trainer_convert.train_actor_from_pb(request)
        assert isinstance(parsed[0].advantages, np.ndarray) == packed
        m = engine(model_path).train_actor(parsed, parsed_loss)
        metrics[packed] = {k: v for k, v in m.items() if k not in ("seconds", "tokens_per_s")}
    assert metrics[True] == metrics[False]


def test_bad_packed_values_are_named_like_repeated_ones(model_path):
    samples = random_samples(2, seed=4)
    last = len(samples[1].advantages) - 1
    samples[1].advantages[last] = math.nan
    parsed, loss = trainer_convert.train_actor_from_pb(trainer_convert.train_actor_to_pb(samples, ActorLoss(),
                                                                                          packed=True))
    with pytest.raises(ValueError, match=rf"samples\[1\]\.advantages\[{last}\]: not finite"):
        validate_actor_batch(parsed, loss, vocab_size=64, max_len=None)
    samples = random_samples(2, seed=4)
    samples[0].response_ids[-1] = 999
    parsed, loss = trainer_convert.train_actor_from_pb(trainer_convert.train_actor_to_pb(samples, ActorLoss(),
                                                                                          packed=True))
    with pytest.raises(ValueError, match=r"samples\[0\]\.response_ids: token id 999 outside the vocabulary"):
        validate_actor_batch(parsed, loss, vocab_size=64, max_len=None)
    short = trainer_convert.train_actor_to_pb(random_samples(1, seed=5), ActorLoss(), packed=True)
    short.samples[0].advantages_packed = pack_f32([0.5])
    parsed, loss = trainer_convert.train_actor_from_pb(short)
    with pytest.raises(ValueError, match=r"samples\[0\]\.advantages: 1 values for"):
        validate_actor_batch(parsed, loss, vocab_size=64, max_len=None)
    assert F32.itemsize == 4


def test_packing_lists_and_arrays_gives_the_same_bytes_and_out_of_range_floats_follow_numpy():
    from services.common.packed import unpack

    ids, floats = [0, 7, 2**31 - 1, -5], [0.5, -1.25, float("inf"), 3.0e-41]
    assert pack_i32(ids) == np.asarray(ids, "<i4").tobytes() == pack_i32(np.asarray(ids, np.int64))
    assert pack_f32(floats) == np.asarray(floats, "<f4").tobytes() == pack_f32(np.asarray(floats))
    with np.errstate(over="ignore"):
        assert unpack(pack_f32([1e39, 2.0]), F32, "x").tolist() == [float("inf"), 2.0]   # as numpy casts it
    assert pack_i32([]) == pack_f32([]) == b""
