"""The reward service over real gRPC on port 0: Score, GetInfo, and status codes for bad input."""

import asyncio

import grpc
import pytest

from meshrl.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from services.common.rpc.channel import create_channel
from services.common.config import load_config
from services.reward.config import RewardSettings
from services.reward.servicer import start


async def with_service(reward: dict, fn):
    settings = load_config(RewardSettings, data={"reward": reward})
    mesh, port, engine = await start(settings, "127.0.0.1:0")
    try:
        async with create_channel(f"127.0.0.1:{port}", timeout=30) as channel:
            return await fn(reward_pb2_grpc.RewardStub(channel))
    finally:
        await mesh.stop(0)
        await engine.close()


def item(i, response, ground_truth):
    return reward_pb2.ScoreItem(id=f"s{i}", prompt=f"{i}+0=", response=response, ground_truth=ground_truth,
                                data_source="arith")


def test_score_returns_exact_match_of_the_response_text_in_request_order():
    async def call(stub):
        return await stub.Score(reward_pb2.ScoreRequest(items=[
            item(0, "82", "82"), item(1, " 82.0", "82"), item(2, "83", "82"), item(3, "+7", "7")]))

    response = asyncio.run(with_service({}, call))
    assert [r.id for r in response.results] == ["s0", "s1", "s2", "s3"]
    assert [r.score for r in response.results] == [1.0, 1.0, 0.0, 1.0]
    assert [dict(r.components) for r in response.results][2] == {"default": 0.0}   # exact_match of a row without data_source


def test_score_combines_weighted_components_over_grpc():
    reward = {"components": [{"name": "exact_match", "weight": 1.0},
                             {"name": "length_penalty", "weight": 0.5, "params": {"max_length": 4, "unit": "chars"}}]}

    async def call(stub):
        return await stub.Score(reward_pb2.ScoreRequest(items=[item(0, "12", "12")]))

    [r] = asyncio.run(with_service(reward, call)).results
    assert dict(r.components) == pytest.approx({"exact_match": 1.0, "length_penalty": -0.5})
    assert r.score == pytest.approx(0.75)


def test_an_empty_batch_is_invalid_argument_naming_items():
    async def call(stub):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Score(reward_pb2.ScoreRequest())
        return err.value

    err = asyncio.run(with_service({}, call))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "items" in err.details()


def test_a_batch_over_max_batch_size_is_invalid_argument():
    async def call(stub):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Score(reward_pb2.ScoreRequest(items=[item(i, "1", "1") for i in range(3)]))
        return err.value

    err = asyncio.run(with_service({"max_batch_size": 2}, call))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_batch_size=2" in err.details()


def test_get_info_reports_the_reward_role_and_lists_components():
    reward = {"components": [{"name": "exact_match", "weight": 0.8}, {"name": "gsm8k", "weight": 0.2}]}

    async def call(stub):
        return await stub.GetInfo(common_pb2.GetInfoRequest())

    info = asyncio.run(with_service(reward, call))
    assert info.role == "reward"
    assert info.details["components"] == "exact_match,gsm8k"
    assert info.details["component.gsm8k"].startswith("weight=0.2")


def test_python_m_services_reward_serves_the_config_file_and_announces_its_port(tmp_path):
    import subprocess
    import sys

    config = tmp_path / "run.yaml"
    config.write_text("reward:\n  components:\n    - {name: gsm8k, weight: 2.0}\n")
    proc = subprocess.Popen([sys.executable, "-m", "services.reward", "--config", str(config), "--port", "0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("meshrl reward listening on 127.0.0.1:"), line
        port = int(line.rsplit(":", 1)[1])

        async def call():
            async with create_channel(f"127.0.0.1:{port}", timeout=30) as channel:
                return await reward_pb2_grpc.RewardStub(channel).Score(
                    reward_pb2.ScoreRequest(items=[item(0, "#### 1,000", "1000")]))

        [r] = asyncio.run(call()).results
        assert r.score == 2.0 and dict(r.components) == {"gsm8k": 1.0}
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_score_routes_each_item_to_the_components_of_its_data_source_over_grpc():
    reward = {"components": [{"name": "exact_match"}], "by_data_source": {"gsm8k": [{"name": "gsm8k"}]}}

    async def call(stub):
        return await stub.Score(reward_pb2.ScoreRequest(items=[
            reward_pb2.ScoreItem(id="g", response="#### 12", ground_truth="12", data_source="gsm8k"),
            reward_pb2.ScoreItem(id="a", response="12", ground_truth="12", data_source="arith")]))

    g, a = asyncio.run(with_service(reward, call)).results
    assert (g.id, dict(g.components), g.score) == ("g", {"gsm8k": 1.0}, 1.0)
    assert (a.id, dict(a.components), a.score) == ("a", {"exact_match": 1.0}, 1.0)
