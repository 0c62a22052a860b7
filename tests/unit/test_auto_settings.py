"""`auto` speed switches: the rule each resolves by, refusals of explicit values that cannot work, the report."""

from __future__ import annotations

import json

import pytest
import yaml
from pydantic import ValidationError

from coordinator.recipe.run_settings import Running, resolved_recipe
from coordinator.runapi.runs import parse_run_config
from services.common.auto import AUTO, Resolved, parse
from services.common.placement import Placement, pick_transport
from services.rollout.config import RolloutConfig, RolloutSettings
from services.trainer.config import ActorConfig, WeightSyncConfig

TRAINER = Placement("host-a", "GPU-0", ("grpc", "ipc", "nccl"))


def test_speed_switches_default_to_auto():
    r, a = RolloutConfig(), ActorConfig()
    assert (r.cuda_graphs, r.cuda_graph_compile, r.max_batch_size) == (AUTO, AUTO, AUTO)
    assert (a.compile, a.fused_logprobs, a.use_remove_padding) == (AUTO, AUTO, AUTO)
    assert WeightSyncConfig().transport == AUTO


def test_explicit_values_still_parse_from_strings_as_flags_give_them():
    assert RolloutConfig(cuda_graphs="true").cuda_graphs is True
    assert RolloutConfig(max_batch_size="128").max_batch_size == 128
    with pytest.raises(ValidationError, match="max_batch_size"):
        RolloutConfig(max_batch_size=0)


def test_cuda_graphs_true_with_a_non_torch_engine_is_refused_by_name():
    with pytest.raises(ValidationError, match="cuda_graphs: true needs engine 'torch'"):
        RolloutConfig(engine="openai", cuda_graphs=True, server_url="http://127.0.0.1:1/v1")


def test_transport_is_ipc_for_a_replica_on_the_trainers_gpu():
    assert pick_transport(TRAINER, Placement("host-a", "GPU-0", ("grpc", "ipc")), nccl_here=True)[0] == "ipc"


def test_transport_is_nccl_for_another_gpu_of_the_same_host_only_when_both_ends_have_nccl():
    other = Placement("host-a", "GPU-1", ("grpc", "ipc", "nccl"))
    assert pick_transport(TRAINER, other, nccl_here=True)[0] == "nccl"
    assert pick_transport(TRAINER, other, nccl_here=False)[0] == "grpc"
    assert pick_transport(TRAINER, Placement("host-a", "GPU-1", ("grpc", "ipc")), nccl_here=True)[0] == "grpc"


def test_transport_is_grpc_for_cpu_ends_and_other_hosts():
    gpu_replica = Placement("host-a", "GPU-0", ("grpc", "ipc", "nccl"))
    assert pick_transport(Placement("host-a"), gpu_replica, nccl_here=False) == \
        ("grpc", "the trainer is not on a CUDA device")
    assert pick_transport(TRAINER, Placement("host-a"), nccl_here=True)[0] == "grpc"
    transport, why = pick_transport(TRAINER, Placement("host-b", "GPU-7", ("grpc", "ipc", "nccl")), nccl_here=True)
    assert transport == "grpc" and "another host" in why


def test_resolved_records_auto_and_explicit_choices_and_round_trips_through_getinfo_details():
    r = Resolved("rollout")
    assert r.pick("rollout.cuda_graphs", AUTO, True, "CUDA device") is True
    assert r.pick("rollout.max_batch_size", 32, 512, "unused") == 32
    assert r.pick("actor.compile", None, False, "device cpu") is False      # null is the old spelling of auto
    got = parse({"resolved": r.json()})
    assert got["rollout.cuda_graphs"] == {"value": True, "asked": "auto", "why": "CUDA device"}
    assert got["rollout.max_batch_size"] == {"value": 32, "asked": 32, "why": "set explicitly"}
    assert got["actor.compile"]["asked"] == "auto"
    assert parse({}) == {} and parse({"resolved": "not json"}) == {}


def _running(role: str, address: str, settings: dict, details: dict) -> Running:
    return Running(role, address, settings, details)


def test_recipe_yaml_holds_resolved_values_and_says_why():
    cfg = parse_run_config("rollout: {n: 2, max_tokens: 6}\n")
    trainer = Resolved("trainer")
    trainer.pick("actor.compile", AUTO, True, "CUDA device")
    rollout = Resolved("rollout")
    rollout.pick("rollout.cuda_graphs", AUTO, True, "CUDA device, torch engine")
    running = [
        _running("trainer", "t:1", {"weight_sync": {"transport": "auto"}},
                 {"resolved": trainer.json(), "host_id": "h", "device_uuid": "GPU-0",
                  "weight_transports": "grpc,ipc"}),
        _running("rollout", "r:1", {}, {"resolved": rollout.json(), "host_id": "h", "device_uuid": "GPU-0",
                                        "weight_transports": "grpc,ipc"}),
    ]
    text = resolved_recipe(cfg, running)
    data = yaml.safe_load(text)
    assert data["rollout"]["cuda_graphs"] is True
    assert data["actor"]["compile"] is True
    assert data["weight_sync"]["transport"] == "ipc"
    assert "#   weight_sync.transport: auto -> ipc on the rollout replica r:1 (replica shares the trainer's GPU)" in text
    assert parse_run_config(text).rollout.cuda_graphs is True       # runs again as is


def test_recipe_yaml_keeps_auto_where_replicas_chose_differently():
    cfg = parse_run_config("rollout: {n: 2, max_tokens: 6}\n")
    trainer = {"host_id": "h", "device_uuid": "GPU-0", "weight_transports": "grpc,ipc", "resolved": "{}"}
    running = [_running("trainer", "t:1", {"weight_sync": {"transport": "auto"}}, trainer),
               _running("rollout", "r:1", {}, {"host_id": "h", "device_uuid": "GPU-0", "weight_transports": "grpc,ipc"}),
               _running("rollout", "r:2", {}, {"host_id": "other", "weight_transports": "grpc"})]
    text = resolved_recipe(cfg, running)
    assert yaml.safe_load(text)["weight_sync"]["transport"] == "auto"
    assert "-> ipc on the rollout replica r:1" in text and "-> grpc on the rollout replica r:2" in text


def test_torch_engine_on_cpu_resolves_eager_decoding_and_refuses_cuda_graphs_true(arith_model_path):
    from services.rollout.engine_torch.engine import TorchEngine

    engine = TorchEngine(RolloutSettings(model={"path": arith_model_path}))
    resolved = json.loads(engine.info()["resolved"])
    assert resolved["rollout.cuda_graphs"]["value"] is False
    assert resolved["rollout.max_batch_size"]["value"] == 64 == engine.max_batch_size
    assert engine.warm_up() == 0.0
    with pytest.raises(ValueError, match="rollout.cuda_graphs: true cannot work here"):
        TorchEngine(RolloutSettings(model={"path": arith_model_path}, rollout={"cuda_graphs": True}),
                    model=engine.model, tokenizer=engine.tokenizer)


def test_meshrl_up_refuses_gpu_only_switches_on_a_cpu_recipe_before_anything_starts():
    from coordinator.recipe.preflight import check_speed_switches

    check_speed_switches(parse_run_config("model: {device: cpu}\n"))           # auto: nothing to refuse
    with pytest.raises(ValueError, match=r"^rollout.cuda_graphs: true needs a CUDA device \(model.device is 'cpu'\)"):
        check_speed_switches(parse_run_config("model: {device: cpu}\nrollout: {cuda_graphs: true}\n"))
    with pytest.raises(ValueError, match=r"^weight_sync.transport: ipc needs the trainer and replicas on CUDA"):
        check_speed_switches(parse_run_config("model: {device: cpu}\nweight_sync: {transport: ipc}\n"))
    check_speed_switches(parse_run_config("model: {device: cuda}\nweight_sync: {transport: nccl}\n"))


def test_a_bad_value_for_a_key_of_choice_or_auto_names_the_key_once_with_every_accepted_value():
    from services.common.config import load_config

    for section, value, message in [
        ({"kv_cache": "pagd"}, "pagd", "config: rollout.kv_cache: should be 'paged' or 'none' or 'auto' (got 'pagd')"),
        ({"enable_lora": "maybe"}, "maybe", "config: rollout.enable_lora: should be a valid boolean or 'auto' "
                                            "(got 'maybe')"),
    ]:
        with pytest.raises(ValueError) as err:
            load_config(RolloutSettings, data={"rollout": section})
        assert str(err.value) == message
    with pytest.raises(ValueError, match=r"^config: rollout.max_loras: Input should be a valid integer"):
        load_config(RolloutSettings, data={"rollout": {"max_loras": "x"}})


@pytest.mark.parametrize("cuda_graphs,kv_cache,compiled", [(False, "paged", True), (True, "none", True),
                                                          (False, "none", False)])
def test_the_decode_layer_compiles_for_either_graph_path(monkeypatch, arith_model_path, cuda_graphs, kv_cache,
                                                         compiled):
    """cuda_graph_compile: auto is on wherever a captured step runs the compiled layer: the unpaged graph decoder or
    the paged cache's graphs (a paged recipe with cuda_graphs off once got uncompiled paged steps). The CUDA
    checks are patched: this machine has none."""
    from transformers import AutoModelForCausalLM

    from services.rollout.engine_torch import speed
    from services.rollout.engine_torch.paged import attention

    monkeypatch.setattr(attention, "graphs_reason", lambda *a: None)
    monkeypatch.setattr(speed, "_triton_available", lambda: True)
    monkeypatch.setattr(speed, "keep_compile_cache", lambda: None)
    model = AutoModelForCausalLM.from_pretrained(arith_model_path)
    r = RolloutConfig(cuda_graphs=cuda_graphs, kv_cache=kv_cache)
    out = speed.resolve_speed(r, "cuda:0", model)
    assert out.value("rollout.cuda_graph_compile") is compiled
    assert out.value("rollout.kv_cache_cuda_graphs") is (kv_cache == "paged")


@pytest.mark.parametrize("kernel_runs", [True, False])
def test_kv_cache_auto_takes_the_paged_cache_on_cuda_where_its_graph_step_runs(monkeypatch, arith_model_path,
                                                                              kernel_runs):
    """auto: the paged KV cache with its CUDA-graph step (and not the unpaged graph decoder beside it) where the
    Triton paged kernel runs; the unpaged CUDA-graph decoder where it does not; today's cache on CPU. The CUDA
    checks are patched: this machine has none."""
    from transformers import AutoModelForCausalLM

    from services.rollout.engine_torch import speed
    from services.rollout.engine_torch.paged import attention

    monkeypatch.setattr(attention, "graphs_reason", lambda *a: None if kernel_runs else "no Triton here")
    monkeypatch.setattr(speed, "_triton_available", lambda: True)
    monkeypatch.setattr(speed, "keep_compile_cache", lambda: None)
    model = AutoModelForCausalLM.from_pretrained(arith_model_path)
    out = speed.resolve_speed(RolloutConfig(), "cuda:0", model)
    assert out.value("rollout.kv_cache") == ("paged" if kernel_runs else "none")
    assert out.value("rollout.kv_cache_cuda_graphs") is kernel_runs
    assert out.value("rollout.cuda_graphs") is not kernel_runs
    assert out.value("rollout.max_batch_size") == 512 and out.value("rollout.cuda_graph_compile") is True
    assert ("no Triton here" in out.choices["rollout.kv_cache"].why) is not kernel_runs
    explicit = speed.resolve_speed(RolloutConfig(cuda_graphs=True), "cuda:0", model)    # the decoder asked for
    assert explicit.value("rollout.cuda_graphs") is True and explicit.value("rollout.kv_cache") == "none"
    both = speed.resolve_speed(RolloutConfig(cuda_graphs=True, kv_cache="paged"), "cuda:0", model)
    assert both.value("rollout.cuda_graphs") is True and both.value("rollout.kv_cache") == "paged"
    on_cpu = speed.resolve_speed(RolloutConfig(), "cpu", model)
    assert on_cpu.value("rollout.kv_cache") == "none" and on_cpu.value("rollout.max_batch_size") == 64


def test_the_paged_pools_auto_room_is_max_batch_size_rows_of_a_prompt_and_twice_max_tokens():
    from services.rollout.config import auto_kv_pool_tokens

    assert auto_kv_pool_tokens(512, 512, None) == 512 * (256 + 1024)
    assert auto_kv_pool_tokens(512, 512, 1024) == 512 * 1024                   # at most max_model_len a row
    assert auto_kv_pool_tokens(64, 16, 4096) == 64 * 288
