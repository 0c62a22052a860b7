"""`python -m services.trainer` and `torchrun --nproc_per_node=1 -m services.trainer` serve, log their rank, drain."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from meshrl.v1 import common_pb2, trainer_pb2_grpc
from services.common.rpc.channel import create_channel
from services.trainer.testing import make_tiny_model

REPO = Path(__file__).resolve().parents[2]

LAUNCHERS = {
    "python": [sys.executable, "-m", "services.trainer"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                 "-m", "services.trainer"],
}


@pytest.mark.slow
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_the_trainer_process_serves_logs_its_rank_line_and_stops_on_sigterm(tmp_path, launcher):
    model = make_tiny_model(tmp_path / "model")
    config = tmp_path / "trainer.yaml"
    config.write_text(f"model:\n  path: {model}\nactor:\n  lr: 1.0e-4\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = (tmp_path / "stderr").open("w")
    proc = subprocess.Popen([*LAUNCHERS[launcher], "--config", str(config), "--port", "0"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        line = ""
        for line in proc.stdout:
            if "listening on" in line:
                break
        assert line.startswith("meshrl trainer listening on 127.0.0.1:"), line
        port = int(line.rsplit(":", 1)[1])

        async def info():
            async with create_channel(f"127.0.0.1:{port}") as channel:
                return await trainer_pb2_grpc.TrainerStub(channel).GetInfo(common_pb2.GetInfoRequest())

        got = asyncio.run(info())
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        # The trainer drains and exits 0; torchrun forwards the signal and reports it as exit code 1.
        assert code == (0 if launcher == "python" else 1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert got.role == "trainer" and got.details["world_size"] == "1"
    assert "Rank 0: actor loaded on cpu (tp=1 pp=1 dp=1)" in (tmp_path / "stderr").read_text()


def test_a_bad_config_key_exits_naming_it(tmp_path):
    config = tmp_path / "trainer.yaml"
    config.write_text("actor:\n  lr: 1.0e-4\n  dp_sise: 2\n")
    proc = subprocess.run([sys.executable, "-m", "services.trainer", "--config", str(config)], cwd=REPO,
                          capture_output=True, text=True, timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    assert "actor.dp_sise: unknown key" in proc.stderr
