"""The training API's messages <-> its dataclasses (services/training_api/types.py): the servicer and the light
client both convert here. Datums and AdamParams go as the trainer's messages (trainer.proto), which the service
forwards as they came."""

from __future__ import annotations

from meshrl.v1 import rollout_pb2, training_pb2
from services.training_api.types import ClientInfo, SampledSequence, SampleResponse, StateInfo


def client_to_pb(c: ClientInfo) -> training_pb2.TrainingClientInfo:
    return training_pb2.TrainingClientInfo(client_id=c.client_id, base_model=c.base_model, rank=c.rank,
                                           weight_version=c.weight_version, step=c.step, adapter=c.adapter)


def client_from_pb(pb: training_pb2.TrainingClientInfo) -> ClientInfo:
    return ClientInfo(pb.client_id, pb.base_model, pb.rank, pb.weight_version, pb.step, pb.adapter)


def sample_request_to_pb(client_id: str, prompts: list[list[int]], num_samples: int, *, max_tokens: int = 0,
                         temperature: float = 1.0, top_p: float = 0.0, stop: list[str] | None = None,
                         seed: int = 0) -> training_pb2.SampleRequest:
    """Unset (0) max_tokens, top_p and seed take the rollout replicas' defaults; temperature 0 is greedy."""
    sampling = rollout_pb2.SamplingParams(n=num_samples, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                                          stop=list(stop or ()), seed=seed)
    return training_pb2.SampleRequest(client_id=client_id, prompts=[training_pb2.ModelInput(tokens=p) for p in prompts],
                                      num_samples=num_samples, sampling_params=sampling)


def samples_to_pb(results: list[SampleResponse], weight_version: int) -> training_pb2.SampleResponse:
    return training_pb2.SampleResponse(weight_version=weight_version, results=[
        training_pb2.PromptSamples(sequences=[training_pb2.SampledSequence(tokens=s.tokens, logprobs=s.logprobs,
                                                                           stop_reason=s.stop_reason)
                                              for s in r.sequences]) for r in results])


def samples_from_pb(pb: training_pb2.SampleResponse) -> list[SampleResponse]:
    return [SampleResponse([SampledSequence(list(s.tokens), list(s.logprobs), s.stop_reason) for s in r.sequences])
            for r in pb.results]


def state_to_pb(s: StateInfo) -> training_pb2.StateResponse:
    return training_pb2.StateResponse(path=s.path, step=s.step, weight_version=s.weight_version)


def state_from_pb(pb: training_pb2.StateResponse) -> StateInfo:
    return StateInfo(pb.path, pb.step, pb.weight_version)
