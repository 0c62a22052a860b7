"""The pure parts of bench/up_gpu.py and bench/peers/mesh_watch.py: which role a process is, what `meshrl up` printed, step medians, the goals and
the resolved settings."""

import json
import os
import subprocess
import sys
import time

import pytest

from bench import up_gpu
from bench.peers import mesh_watch


@pytest.mark.parametrize("argv, role", [
    (["/usr/bin/python3", "-m", "services.trainer", "--config", "r.yaml", "--port", "0"], "trainer"),
    (["/usr/bin/python3", "-m", "services.rollout", "--config", "r.yaml", "--config", "own.yaml"], "rollout"),
    (["python", "-m", "services.reference", "--config", "r.yaml"], "reference"),
    (["python", "-m", "services.reward", "--config", "r.yaml"], "reward"),
    (["python", "-m", "coordinator", "--config", "coordinator.yaml"], "coordinator"),
    # torchrun's agent and its ranks name the service module after torchrun's own
    (["python", "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "-m", "services.trainer"],
     "trainer"),
    (["python", "-m", "coordinator.cli", "up", "examples/gpu/grpo.yaml"], "launcher"),
    (["/v/bin/python", "/v/bin/meshrl", "up", "examples/gpu/grpo.yaml"], "launcher"),
    (["/v/bin/python", "/v/bin/meshrl", "serve", "rollout", "--config", "r.yaml"], "rollout"),
    (["bash", "-c", "sleep 1"], None),
    ([], None),
])
def test_role_of_a_process_comes_from_its_command_line(argv, role):
    assert mesh_watch.role_of(argv) == role


def test_the_timing_wrapper_takes_its_role_from_the_environment():
    argv = ["python", "-m", "bench.peers.mesh_timing", "--config", "r.yaml"]
    assert mesh_watch.role_of(argv, {"MESHRL_BENCH_ROLE": "rollout"}) == "rollout"
    assert mesh_watch.role_of(argv, {}) is None


def test_descendants_maps_a_child_process_to_its_role():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "-m", "services.reward"])
    try:
        for _ in range(50):   # until the child has exec'd
            tree = mesh_watch.descendants(os.getpid())
            if tree.get(child.pid) == "reward":
                break
            time.sleep(0.1)
        assert tree[child.pid] == "reward" and tree[os.getpid()] == "?"
    finally:
        child.kill()
        child.wait()


def test_mesh_up_and_run_end_lines_are_parsed():
    addresses = {"trainer": ["127.0.0.1:4001"], "rollout": ["127.0.0.1:4002", "127.0.0.1:4003"],
                 "coordinator": ["127.0.0.1:4004"]}
    up = up_gpu.parse_mesh_up(f"mesh up: {json.dumps(addresses)} (logs in runs/logs/20261205-101010)\n")
    assert up == {**addresses, "_logs": "runs/logs/20261205-101010"}
    assert up_gpu.parse_mesh_up("step   1/8  reward 0.5") is None
    end = up_gpu.parse_run_end("run gpu-grpo-1-abc COMPLETED after 8 steps; metrics in /tmp/x/runs/gpu-grpo-1-abc")
    assert end == {"run_id": "gpu-grpo-1-abc", "state": "COMPLETED", "steps": 8,
                   "run_dir": "/tmp/x/runs/gpu-grpo-1-abc"}
    assert up_gpu.parse_run_end("run gpu-grpo-1-abc started") is None


def _record(step, seconds, **phases):
    return {"step": step, "time/step": seconds, "samples_per_s": 256 / seconds,
            **{f"time/{k}": v for k, v in phases.items()}}


def test_step_records_skip_evaluations_and_cut_lines(tmp_path):
    lines = [json.dumps({"step": 0, "heldout_accuracy": 0.3}), json.dumps(_record(2, 5.0, train=1.0)),
             json.dumps(_record(1, 9.0, train=2.0)), json.dumps({"step": 2, "final": True, "heldout_accuracy": 0.4}),
             '{"step": 3, "time/st']
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert [r["step"] for r in up_gpu.load_step_records(path)] == [1, 2]


def test_summary_takes_step_one_apart_and_the_median_of_the_steady_steps():
    records = [_record(1, 12.0, generate=8.0, train=3.0, weight_sync=0.9),
               _record(2, 7.0, generate=4.0, train=2.0, weight_sync=0.3),
               _record(3, 6.0, generate=3.5, train=2.0, weight_sync=0.10),
               _record(4, 5.0, generate=3.0, train=1.5, weight_sync=0.12),
               _record(5, 5.5, generate=3.2, train=1.6, weight_sync=0.14),
               _record(6, 4.5, generate=2.8, train=1.4, weight_sync=0.11)]
    s = up_gpu.summarize_steps(records, warmup=2)
    assert s["steady_steps"] == 4 and s["warmup_steps_seconds"] == [12.0, 7.0]
    assert s["step1_seconds"] == 12.0
    assert s["steady_step_seconds_median"] == pytest.approx(5.25)
    assert s["step1_over_steady"] == pytest.approx(12.0 / 5.25)
    assert s["phase_seconds_median"] == pytest.approx({"generate": 3.1, "train": 1.55, "weight_sync": 0.115})
    assert s["weight_sync_seconds_median"] == pytest.approx(0.115)
    assert s["phase_seconds_step1"]["generate"] == 8.0
    assert s["samples_per_s_median"] == pytest.approx(256 / 5.25, rel=0.02)


def test_summary_of_no_steps_is_all_unknown():
    s = up_gpu.summarize_steps([], warmup=2)
    assert s["step1_seconds"] is None and s["steady_step_seconds_median"] is None and s["step1_over_steady"] is None
    assert s["phase_seconds_median"] == {} and s["steady_steps"] == 0


def test_goals_compare_the_defaults_with_the_limits_and_the_tuned_run():
    defaults = {"steady_step_seconds_median": 5.5, "weight_sync_seconds_median": 0.25, "step1_over_steady": 1.4}
    tuned = {"steady_step_seconds_median": 5.0}
    ratio, goals = up_gpu.compute_goals(defaults, tuned)
    assert ratio == pytest.approx(1.1)
    assert goals["steady_step_le_6s"] == {"value": 5.5, "limit": 6.0, "met": True}
    assert goals["weight_sync_le_0_2s"]["met"] is False
    assert goals["step1_le_1_5x_steady"]["met"] is True
    assert goals["default_over_tuned_le_1_10"]["met"] is True   # 1.1 <= 1.10
    ratio, goals = up_gpu.compute_goals(defaults, {"steady_step_seconds_median": 4.0})
    assert ratio == pytest.approx(1.375) and goals["default_over_tuned_le_1_10"]["met"] is False


def test_goals_without_a_run_are_unknown_not_failed():
    ratio, goals = up_gpu.compute_goals({"steady_step_seconds_median": 5.0}, None)
    assert ratio is None
    assert goals["default_over_tuned_le_1_10"] == {"value": None, "limit": 1.1, "met": None}
    assert goals["weight_sync_le_0_2s"]["met"] is None


RECIPE_YAML = """\
# The effective config of this run. Keys that were `auto` hold what the services resolved them to:
#   rollout.cuda_graphs: auto -> true on the rollout replica 127.0.0.1:4002 (CUDA device, torch engine)
#   rollout.max_batch_size: auto -> 512 on the rollout replica 127.0.0.1:4002 (CUDA-graph decode)
#   weight_sync.transport: auto -> ipc on the rollout replica 127.0.0.1:4002 (the replica is on the trainer's GPU)
#   actor.compile: auto -> true on the trainer (CUDA)
model:
  path: examples/gpu/models/qwen2.5-1.5b
rollout:
  cuda_graphs: true
weight_sync:
  transport: auto
"""


def test_resolved_settings_come_from_the_run_recipe_header_first():
    infos = {"trainer": [{"address": "a", "details": {"resolved": {
        "weight_sync.transport": {"value": "per replica", "asked": "auto", "why": "..."},
        "actor.fused_logprobs": {"value": True, "asked": "auto", "why": "fusable head"}}}}]}
    r = up_gpu.merge_resolved(infos, RECIPE_YAML)
    assert r["rollout.cuda_graphs"]["value"] is True and r["rollout.cuda_graphs"]["asked"] == "auto"
    assert r["rollout.max_batch_size"]["value"] == 512
    assert r["weight_sync.transport"] == {"value": "ipc", "asked": "auto", "source": "recipe.yaml",
                                          "why": "the replica is on the trainer's GPU",
                                          "on": "rollout replica 127.0.0.1:4002"}
    assert r["actor.fused_logprobs"]["source"] == "trainer GetInfo"


def test_resolved_settings_fall_back_to_getinfo_per_target_and_then_nothing():
    infos = {"trainer": [{"address": "a", "details": {"resolved": {
        "weight_sync.transport": {"value": "per replica", "asked": "auto", "why": "..."},
        "weight_sync.transport[127.0.0.1:4002]": {"value": "ipc", "asked": "auto", "why": "same GPU"}}}}],
        "rollout": [{"address": "b", "error": "UNAVAILABLE"}]}
    r = up_gpu.merge_resolved(infos, None)
    assert r["weight_sync.transport"]["value"] == "ipc"
    assert r["rollout.cuda_graphs"] is None
    assert up_gpu.merge_resolved({}, None) == {"rollout.kv_cache": None, "rollout.cuda_graphs": None,
                                               "weight_sync.transport": None}


def test_a_recipe_without_a_header_gives_its_plain_values():
    r = up_gpu.merge_resolved({}, "rollout:\n  cuda_graphs: false\nweight_sync:\n  transport: grpc\n")
    assert r["rollout.cuda_graphs"]["value"] is False and r["weight_sync.transport"]["value"] == "grpc"


def test_replicas_that_chose_differently_keep_every_group():
    text = ("#   rollout.max_batch_size: auto -> 512 on the rollout replica a (graphs)\n"
            "#   rollout.max_batch_size: auto -> 64 on the rollout replica b (eager)\nrollout: {}\n")
    got = up_gpu.parse_recipe_choices(text)["rollout.max_batch_size"]
    assert got["value"] == 512 and [g["value"] for g in got["groups"]] == [512, 64]


def test_getinfo_details_are_decoded_and_the_settings_blob_left_out():
    d = mesh_watch.parse_details({"settings": "{...}", "resolved": '{"rollout.cuda_graphs": {"value": true}}',
                              "warmup_seconds": "41.5", "engine": "torch"})
    assert d == {"resolved": {"rollout.cuda_graphs": {"value": True}}, "warmup_seconds": 41.5, "engine": "torch"}
    infos = {"rollout": [{"details": d}], "reward": [{"details": {}}], "trainer": [{"error": "x"}]}
    assert up_gpu.warmup_seconds(infos) == {"reward": None, "rollout": 41.5, "trainer": None}


def test_newer_getinfo_answers_replace_older_ones_unless_they_failed():
    old = {"trainer": [{"address": "a", "details": {"step": 0}}]}
    new = {"trainer": [{"address": "a", "error": "UNAVAILABLE"}], "rollout": [{"address": "b", "details": {}}]}
    merged = mesh_watch.merge_infos(old, new)
    assert merged["trainer"] == [{"address": "a", "details": {"step": 0}}] and merged["rollout"][0]["address"] == "b"
    assert mesh_watch.merge_infos(merged, {"trainer": [{"address": "a", "details": {"step": 2}}]})["trainer"][0][
        "details"] == {"step": 2}


def test_tuned_flags_are_the_hand_set_cuda_switches_on_a_cuda_recipe():
    gpu = {"model": {"device": "cuda"}, "rollout": {"replicas": 1, "n": 8}, "data": {"rollout_batch_size": 32}}
    flags = up_gpu.tuned_flags(gpu)
    pairs = dict(zip(flags[::2], flags[1::2]))
    assert pairs == {"--rollout.cuda_graphs": "true", "--weight_sync.transport": "ipc", "--actor.compile": "true",
                     "--rollout.max_batch_size": "256"}
    cpu = {"rollout": {"replicas": 2, "n": 8}, "data": {"rollout_batch_size": 16}}
    assert up_gpu.tuned_flags(cpu) == ["--rollout.max_batch_size", "64"]


def test_each_run_gets_its_share_of_the_budget_left():
    assert up_gpu.run_timeout(300, None, 1000, 2) == 300
    assert up_gpu.run_timeout(300, 540, 40, 2) == pytest.approx((540 - 40 - 40) / 2)
    assert up_gpu.run_timeout(300, 540, 200, 1) == 300
    assert up_gpu.run_timeout(300, 540, 530, 1) == 30.0


def test_the_memory_sampler_is_off_without_nvidia_smi(monkeypatch):
    monkeypatch.setattr(mesh_watch.shutil, "which", lambda name: None)
    sampler = mesh_watch.MemorySampler(os.getpid()).start()
    sampler.stop()
    assert sampler.result() is None


def test_the_memory_sampler_puts_each_process_to_its_role(monkeypatch):
    rows = {"--query-compute-apps=pid,used_memory": [["101", "30000"], ["102", "9000"], ["103", "4000"],
                                                      ["999", "500"]],
            "--query-gpu=memory.used": [["43600"]]}
    monkeypatch.setattr(mesh_watch, "nvidia_smi", lambda q: rows[q])
    monkeypatch.setattr(mesh_watch, "descendants",
                        lambda root: {root: "launcher", 101: "trainer", 102: "rollout", 103: "reference"})
    sampler = mesh_watch.MemorySampler(7)
    sampler.sample()
    rows["--query-compute-apps=pid,used_memory"][0][1] = "20000"   # the trainer's memory drops: the peak stays
    sampler.sample()
    got = sampler.result()
    assert got["peak_mib_by_role"] == {"trainer": 30000.0, "rollout": 9000.0, "reference": 4000.0}
    assert got["peak_mib_gpu_total"] == 43600.0 and got["unmapped_pids"] == [999] and got["note"] is None
    assert got["peak_mib_by_pid"]["101"] == {"role": "trainer", "mib": 30000.0}
