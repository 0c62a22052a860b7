"""Packed payload fields (services/common/tensors/packed.py): the same values as the repeated fields, read in either
form, bad packed input named by field, and a packed TrainActor identical to a repeated one."""

from __future__ import annotations

import math

import numpy as np
import pytest

from meshrl.v1 import common_pb2, rollout_pb2, trainer_pb2
from services.common import convert as common_convert
from services.common.config import load_config
from services.common.tensors.modeling import validate_sequences
from services.common.tensors.packed import F32, I32, field_of, pack_f32, pack_i32
from services.rollout import convert as rollout_convert
from services.rollout.types import PromptResult, SampleResult, SamplingParams
from services.trainer import convert as trainer_convert
from services.trainer.batch import is_on_policy, validate_actor_batch
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.testing import make_tiny_model, random_samples
from services.trainer.types import ActorLoss


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
    from services.common.tensors.packed import unpack

    ids, floats = [0, 7, 2**31 - 1, -5], [0.5, -1.25, float("inf"), 3.0e-41]
    assert pack_i32(ids) == np.asarray(ids, "<i4").tobytes() == pack_i32(np.asarray(ids, np.int64))
    assert pack_f32(floats) == np.asarray(floats, "<f4").tobytes() == pack_f32(np.asarray(floats))
    with np.errstate(over="ignore"):
        assert unpack(pack_f32([1e39, 2.0]), F32, "x").tolist() == [float("inf"), 2.0]   # as numpy casts it
    assert pack_i32([]) == pack_f32([]) == b""


# --- columnar payloads (Ragged rows: one message per batch) ------------------------------------------------

def test_columnar_logprobs_request_and_answer_round_trip_from_lists_and_arrays():
    prompts, responses = [[1], [2, 3], [4, 5, 6]], [[7, 8], [9], [10, 11, 12]]
    for form in (lambda r: r, lambda r: np.asarray(r, dtype=np.int32)):
        batch = common_convert.SequenceBatch(ids=["x", "y", "z"], prompts=[form(p) for p in prompts],
                                             responses=[form(r) for r in responses], temperature=0.5)
        req = common_pb2.LogProbsRequest.FromString(common_convert.sequences_to_pb(batch, columnar=True)
                                                    .SerializeToString())
        assert not req.sequences and req.HasField("response_rows")
        parsed = common_convert.sequences_from_pb(req)
        assert parsed.columnar and parsed.ids == ["0", "1", "2"] and parsed.temperature == 0.5
        assert [p.tolist() for p in parsed.prompts] == prompts and [r.tolist() for r in parsed.responses] == responses
        assert common_convert.sequences_from_pb(req, as_lists=True).responses == responses
    rows = [np.asarray([-0.25, -1.5], np.float32), np.asarray([-2.0], np.float32), np.zeros(3, np.float32)]
    answer = common_convert.logprobs_to_pb(parsed.ids, rows, 4, columnar=True)
    assert not answer.results and answer.weight_version == 4
    back = common_convert.logprobs_from_pb(common_pb2.LogProbsResponse.FromString(answer.SerializeToString()),
                                           as_arrays=True)
    assert [r.tolist() for r in back] == [r.tolist() for r in rows] and back[0].dtype == np.float32
    assert common_convert.logprobs_from_pb(answer) == [[-0.25, -1.5], [-2.0], [0.0, 0.0, 0.0]]


def test_bad_columnar_sequences_are_named_by_field():
    def request(**kw):
        return common_pb2.LogProbsRequest(**kw)

    rows = common_pb2.Ragged(lengths=pack_i32([1, 2]), values=pack_i32([1, 2, 3]))
    with pytest.raises(ValueError, match=r"response_rows\.values: 2 values, but the rows' lengths add up to 3"):
        common_convert.sequences_from_pb(request(prompt_rows=rows, response_rows=common_pb2.Ragged(
            lengths=pack_i32([1, 2]), values=pack_i32([1, 2]))))
    with pytest.raises(ValueError, match=r"prompt_rows\.lengths: row 1 has a negative length"):
        common_convert.sequences_from_pb(request(prompt_rows=common_pb2.Ragged(lengths=pack_i32([3, -1]),
                                                                                values=pack_i32([1, 2])),
                                                 response_rows=rows))
    with pytest.raises(ValueError, match=r"response_rows: 1 rows for 2 prompt_rows"):
        common_convert.sequences_from_pb(request(prompt_rows=rows, response_rows=common_pb2.Ragged(
            lengths=pack_i32([2]), values=pack_i32([1, 2]))))
    with pytest.raises(ValueError, match=r"prompt_rows\.lengths: 3 bytes"):
        common_convert.sequences_from_pb(request(prompt_rows=common_pb2.Ragged(lengths=b"\x01\x00\x00"),
                                                 response_rows=rows))
    with pytest.raises(ValueError, match=r"response_rows: row 1 is empty"):
        common_convert.sequences_from_pb(request(prompt_rows=rows, response_rows=common_pb2.Ragged(
            lengths=pack_i32([3, 0]), values=pack_i32([1, 2, 3]))))
    with pytest.raises(ValueError, match="sequences: set together with prompt_rows"):
        common_convert.sequences_from_pb(request(prompt_rows=rows, response_rows=rows,
                                                 sequences=[common_pb2.TokenSequence(prompt_ids=[1])]))

    # The engines' shared token check names the Ragged field and row, in either form the servicers read.
    out_of_vocab = request(prompt_rows=rows, response_rows=common_pb2.Ragged(lengths=pack_i32([1, 2]),
                                                                             values=pack_i32([1, 2, 99])))
    for as_lists in (False, True):
        batch = common_convert.sequences_from_pb(out_of_vocab, as_lists=as_lists)
        with pytest.raises(ValueError, match=r"^response_rows: row 1: token id 99 outside the vocabulary \[0, 64\)"):
            validate_sequences(batch.prompts, batch.responses, vocab_size=64)
        with pytest.raises(ValueError, match=r"^prompt_rows / response_rows: row 1: 4 tokens exceed the model's limit of 3"):
            validate_sequences(batch.prompts, batch.responses, vocab_size=128, max_len=3)


def test_packed_and_columnar_train_actor_requests_train_exactly_as_the_repeated_one(model_path):
    samples = random_samples(5, seed=2)
    for s in samples:
        s.ref_logprobs = [-1.0 - 0.01 * t for t in range(len(s.response_ids))]
    loss = ActorLoss(kl_coef=0.01)
    metrics = {}
    for form in ("repeated", "packed", "columnar"):
        request = trainer_convert.train_actor_to_pb(samples, loss, packed=form == "packed",
                                                    columnar=form == "columnar")
        assert bool(request.samples) != (form == "columnar")
        parsed, parsed_loss = trainer_convert.train_actor_from_pb(
            trainer_pb2.TrainActorRequest.FromString(request.SerializeToString()))
        assert isinstance(parsed[0].advantages, np.ndarray) == (form != "repeated")
        if form == "columnar":
            assert all(isinstance(s.prompt_ids, np.ndarray) and len(s.old_logprobs) == len(s.response_ids) for s in parsed)
            assert [s.ref_logprobs.tolist() for s in parsed] == [list(np.float32(s.ref_logprobs)) for s in samples]
        m = engine(model_path).train_actor(parsed, parsed_loss)
        metrics[form] = {k: v for k, v in m.items() if k not in ("seconds", "tokens_per_s")}
    assert metrics["packed"] == metrics["repeated"] and metrics["columnar"] == metrics["repeated"]


def test_bad_train_columns_are_named_and_misaligned_rows_never_leave_the_client():
    samples = random_samples(3, seed=4)
    t = len(samples[1].advantages) - 1
    samples[1].advantages[t] = math.nan
    request = trainer_convert.train_actor_to_pb(samples, ActorLoss(), columnar=True)
    k = len(samples[0].response_ids) + t
    with pytest.raises(ValueError, match=rf"columns\.advantages\[{k}\]: not finite \(nan; sample 1, token {t}\)"):
        trainer_convert.train_actor_from_pb(request)
    request = trainer_convert.train_actor_to_pb(random_samples(3, seed=4), ActorLoss(), columnar=True)
    request.columns.advantages = request.columns.advantages[:-4]
    with pytest.raises(ValueError, match=r"columns\.advantages: \d+ values, but the rows' lengths add up to"):
        trainer_convert.train_actor_from_pb(request)
    request.columns.advantages, request.samples.add().prompt_ids[:] = b"", [1]
    with pytest.raises(ValueError, match="samples: set together with columns"):
        trainer_convert.train_actor_from_pb(request)
    # A row one value short and another one long add up, but would put values on the wrong tokens.
    samples = random_samples(2, seed=6)
    samples[0].advantages, samples[1].advantages = samples[0].advantages[:-1], samples[1].advantages + [0.0]
    with pytest.raises(ValueError, match=r"samples\[0\]\.advantages: \d+ values for \d+ response tokens"):
        trainer_convert.train_columns_to_pb(samples)
    samples = random_samples(2, seed=6)
    samples[1].ref_logprobs = [-1.0] * len(samples[1].response_ids)      # some samples only: refused, not dropped
    with pytest.raises(ValueError, match=r"samples\[0\]\.ref_logprobs: 0 values for"):
        trainer_convert.train_columns_to_pb(samples)


def test_on_policy_samples_travel_as_an_empty_old_logprobs_column():
    samples = random_samples(3, seed=7)
    for s in samples:
        s.old_logprobs = []
    request = trainer_convert.train_actor_to_pb(samples, ActorLoss(), columnar=True)
    assert request.columns.old_logprobs == b"" and request.columns.ref_logprobs == b""
    parsed, _ = trainer_convert.train_actor_from_pb(request)
    assert is_on_policy(parsed) and all(len(s.ref_logprobs) == 0 for s in parsed)


def test_reward_items_read_packed_response_ids():
    from meshrl.v1 import reward_pb2
    from services.reward.convert import items_from_pb

    items = items_from_pb(reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(id="a", response_ids_packed=pack_i32(
        [3, 4])), reward_pb2.ScoreItem(id="b", response_ids=[5])]))
    assert [it.response_ids for it in items] == [[3, 4], [5]]
    with pytest.raises(ValueError, match=r"items\[0\]\.response_ids_packed: 3 bytes"):
        items_from_pb(reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(response_ids_packed=b"\x00" * 3)]))


def test_columnar_generate_results_round_trip_and_bad_rows_are_named():
    results = [PromptResult(prompt_id=f"p{i}", prompt_ids=[4, 5 + i], samples=[
        SampleResult(response_ids=list(range(3 + j + i)), logprobs=[-0.5 * (t + 1) for t in range(3 + j + i)],
                     text=f"t{i}{j}", finish_reason="stop", weight_version=3) for j in range(2)]) for i in range(3)]
    pb = rollout_pb2.GenerateResponse.FromString(rollout_convert.results_to_pb(results, columnar=True)
                                                 .SerializeToString())
    assert not pb.responses[0].samples[0].response_ids_packed and len(pb.responses[2].samples) == 2
    assert rollout_convert.results_from_pb(pb) == results == rollout_convert.results_from_pb(
        rollout_convert.results_to_pb(results, packed=True))
    ids, logprobs = rollout_convert.sample_rows(pb)
    assert ids[3].tolist() == [0, 1, 2, 3, 4] and logprobs[3].dtype == np.float32
    del pb.responses[2].samples[1]
    with pytest.raises(ValueError, match=r"response_rows / logprob_rows: 6 / 6 rows for 5 samples"):
        rollout_convert.sample_rows(pb)


@pytest.mark.parametrize("form", ["columnar", "packed", "repeated"])
def test_the_coordinator_reads_every_generate_answer_form_alike(form):
    import asyncio

    from coordinator.training import remote
    from coordinator.recipe.data import Problem

    results = [PromptResult(prompt_id=f"p{i}", prompt_ids=[4, 5 + i], samples=[
        SampleResult(response_ids=[7 + i, 8, 9][:2 + j], logprobs=[-0.25, -1.5, -3.0][:2 + j], text=f"t{i}{j}",
                     finish_reason="stop", weight_version=2) for j in range(2)]) for i in range(2)]

    class Replica:
        async def Generate(self, request):
            assert request.columnar
            answer = rollout_convert.results_to_pb(results, columnar=form == "columnar", packed=form == "packed")
            return rollout_pb2.GenerateResponse.FromString(answer.SerializeToString())

    problems = [Problem(id=f"q{i}", prompt=f"{i}+1", ground_truth="1", data_source="arith") for i in range(2)]
    samples = asyncio.run(remote.generate(Replica(), problems, [0, 1], SamplingParams(
        n=2, temperature=1.0, top_p=1.0, max_tokens=4)))
    assert [(s.group, list(s.prompt_ids), list(s.response_ids), list(s.rollout_logprobs), s.text) for s in samples] \
        == [(i, [4, 5 + i], [7 + i, 8, 9][:2 + j], [-0.25, -1.5, -3.0][:2 + j], f"t{i}{j}")
            for i in range(2) for j in range(2)]
