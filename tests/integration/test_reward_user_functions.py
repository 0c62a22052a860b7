"""User reward functions behind a real server: hangs, crashes, errors and NaN fail one call, not the service."""

import asyncio
from pathlib import Path

import grpc
import pytest

from meshrl.v1 import reward_pb2, reward_pb2_grpc
from services.common.rpc.channel import create_channel
from services.common.config import load_config
from services.reward.config import RewardSettings
from services.reward.servicer import start

REPO = Path(__file__).resolve().parents[2]
FNS = "tests.fixtures.reward_user_fns"


@pytest.fixture(autouse=True)
def repo_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))


def request(*responses):
    return reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(id=f"s{i}", response=r, ground_truth="82")
                                          for i, r in enumerate(responses)])


async def score_or_error(stub, req):
    try:
        return await stub.Score(req)
    except grpc.aio.AioRpcError as e:
        return e


def run_calls(reward: dict, requests: list) -> list:
    """Starts a reward server, sends the requests one after the other, returns responses or errors."""
    async def main():
        mesh, port, engine = await start(load_config(RewardSettings, data={"reward": reward}), "127.0.0.1:0")
        try:
            async with create_channel(f"127.0.0.1:{port}", timeout=60) as channel:
                stub = reward_pb2_grpc.RewardStub(channel)
                return [await score_or_error(stub, r) for r in requests]
        finally:
            await mesh.stop(0)
            await engine.close()

    return asyncio.run(main())


def test_a_hanging_user_function_is_deadline_exceeded_and_the_next_call_works():
    hung, after = run_calls({"function": f"{FNS}:moody", "function_timeout_s": 1.0, "num_workers": 1},
                            [request("82", "hang"), request("82", "81")])
    assert isinstance(hung, grpc.aio.AioRpcError)
    assert hung.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert f"{FNS}:moody" in hung.details() and "items[1] (id 's1')" in hung.details()
    assert [r.score for r in after.results] == [1.0, 0.0]


def test_a_function_that_always_hangs_fails_every_call_quickly_instead_of_stalling():
    # Each call ends at its own function_timeout_s (the details name it), not at the client's deadline.
    results = run_calls({"function": f"{FNS}:hangs", "function_timeout_s": 0.5, "num_workers": 2},
                        [request("a"), request("b", "c")])
    assert [r.code() for r in results] == [grpc.StatusCode.DEADLINE_EXCEEDED] * 2
    assert all(f"{FNS}:hangs" in r.details() for r in results)


def test_a_crashing_user_function_is_internal_naming_the_function_and_the_next_call_works():
    crashed, after = run_calls({"function": f"{FNS}:moody", "num_workers": 1},
                               [request("crash"), request("82")])
    assert crashed.code() == grpc.StatusCode.INTERNAL
    assert f"{FNS}:moody" in crashed.details() and "exit code 7" in crashed.details()
    assert [r.score for r in after.results] == [1.0]


def test_a_function_that_always_crashes_fails_each_call_with_its_exit_code():
    results = run_calls({"function": f"{FNS}:crashes", "num_workers": 1}, [request("a"), request("b")])
    assert [r.code() for r in results] == [grpc.StatusCode.INTERNAL] * 2
    assert all("exit code 3" in r.details() for r in results)


def test_an_exception_or_a_non_number_fails_that_item_with_its_message_and_the_others_are_scored():
    [response] = run_calls({"function": f"{FNS}:moody", "num_workers": 1},
                           [request("raise", "text", "82")])
    raised, text, fine = response.results
    assert "RuntimeError: cannot score this one" in raised.error and "moody" in raised.error
    assert "items[0] (id 's0')" in raised.error
    assert "not a number" in text.error and "items[1]" in text.error
    assert fine.error == "" and fine.score == 1.0


def test_a_nan_from_a_user_function_fails_the_item_naming_the_function_and_the_sample():
    [response] = run_calls({"function": f"{FNS}:returns_nan"}, [request("fine", "also fine")])
    nan = response.results[0]
    assert "items[0] (id 's0')" in nan.error and "returns_nan" in nan.error and "not a finite number" in nan.error


def test_a_wrong_signature_fails_the_service_start_not_the_first_call():
    with pytest.raises(ValueError, match="does not accept keyword argument"):
        run_calls({"function": f"{FNS}:wrong_signature"}, [])


def test_a_hang_in_one_call_does_not_hold_up_a_concurrent_call_on_another_worker():
    async def main():
        reward = {"function": f"{FNS}:moody", "function_timeout_s": 3.0, "num_workers": 2}
        mesh, port, engine = await start(load_config(RewardSettings, data={"reward": reward}), "127.0.0.1:0")
        try:
            async with create_channel(f"127.0.0.1:{port}", timeout=60) as channel:
                stub = reward_pb2_grpc.RewardStub(channel)
                await stub.Score(request("82"))  # both workers up

                finished = []

                async def call(name, req):
                    result = await score_or_error(stub, req)
                    finished.append(name)
                    return result

                results = await asyncio.gather(call("hang", request("hang")), call("good", request("82")))
                return results, finished
        finally:
            await mesh.stop(0)
            await engine.close()

    (hung, good), finished = asyncio.run(main())
    assert hung.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # the good call was answered by the other worker while the hung one still waited for its timeout
    assert good.results[0].score == 1.0 and finished == ["good", "hang"]


def test_closing_the_engine_leaves_no_worker_process_behind():
    import multiprocessing

    run_calls({"function": f"{FNS}:moody", "num_workers": 2}, [request("82", "82"), request("crash")])
    assert [p.name for p in multiprocessing.active_children() if p.name.startswith("reward-fn")] == []


def test_the_service_process_runs_user_functions_in_workers_and_survives_a_crash(tmp_path):
    import os
    import subprocess
    import sys

    config = tmp_path / "run.yaml"
    config.write_text(f"reward:\n  function: '{FNS}:moody'\n  num_workers: 1\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "services.reward", "--config", str(config), "--port", "0"],
                            stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        port = int(proc.stdout.readline().rsplit(":", 1)[1])

        async def main():
            async with create_channel(f"127.0.0.1:{port}", timeout=60) as channel:
                stub = reward_pb2_grpc.RewardStub(channel)
                return [await score_or_error(stub, r) for r in (request("82"), request("crash"), request("82"))]

        ok, crashed, again = asyncio.run(main())
        assert ok.results[0].score == 1.0
        assert crashed.code() == grpc.StatusCode.INTERNAL and "exit code 7" in crashed.details()
        assert again.results[0].score == 1.0
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_the_service_refuses_to_start_with_a_wrong_signature_in_one_line(tmp_path):
    import os
    import subprocess
    import sys

    config = tmp_path / "run.yaml"
    config.write_text(f"reward:\n  function: '{FNS}:wrong_signature'\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "services.reward", "--config", str(config), "--port", "0"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("meshrl serve reward: reward.components[0] (wrong_signature)") and "Traceback" not in done.stderr
