"""`meshrl up` hands its `--section.key value` flags to every service process it starts: a list flag
(`--reward.components '[{name: exact_match, label: em}]'`) reaches the service as the list, which it starts with."""

import json
from pathlib import Path

import grpc

from coordinator.cli.launcher import Launcher
from coordinator.cli.runs import _recipe_args
from meshrl.v1 import common_pb2, reward_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


def test_a_service_started_by_the_launcher_reads_a_list_flag(tmp_path):
    _, overrides = _recipe_args(["--reward.components", "[{name: exact_match, label: em}]"])
    with Launcher(str(ROOT / "examples/arith/grpo.yaml"), log_dir=tmp_path / "logs", overrides=overrides) as launcher:
        address = launcher.wait_ready(launcher.start("reward"))
        with grpc.insecure_channel(address) as channel:
            info = reward_pb2_grpc.RewardStub(channel).GetInfo(common_pb2.GetInfoRequest(), timeout=30)
    components = json.loads(info.details["settings"])["reward"]["components"]
    assert [(c["name"], c["label"]) for c in components] == [("exact_match", "em")]
