"""Parts of the vllm rollout engine that need no vLLM: the start error without it, seeds, the swap gate."""

from __future__ import annotations

import asyncio
import sys

import pytest

from services.rollout.config import RolloutSettings
from services.rollout.engine_vllm.engine import _kv_cache_bytes, _SwapGate, prompt_seed
from services.rollout.engines import build_engine


def test_engine_vllm_without_vllm_installed_fails_at_start_naming_the_key(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)          # `import vllm` now raises ImportError
    with pytest.raises(ValueError, match=r"rollout.engine: 'vllm' needs vLLM .*meshrl\[vllm\]"):
        build_engine(RolloutSettings(rollout={"engine": "vllm"}))


def test_vllm_config_keys_are_validated():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        RolloutSettings(rollout={"engine": "vllm", "gpu_memory_utilization": 1.5})
    r = RolloutSettings(rollout={"engine": "vllm", "vllm_engine_args": {"enforce_eager": False}}).rollout
    assert r.vllm_engine_args == {"enforce_eager": False} and r.gpu_memory_utilization is None
    with pytest.raises(ValueError, match="kv_cache_gib"):
        RolloutSettings(rollout={"engine": "vllm", "kv_cache_gib": 0})


def test_cpu_kv_cache_is_an_explicit_size_never_share_minus_resident_memory():
    # vLLM's own CPU sizing is share x RAM - worker RSS, negative for a small share on a small host (CI once).
    small = RolloutSettings(rollout={"engine": "vllm", "gpu_memory_utilization": 0.01}).rollout
    assert _kv_cache_bytes(small, on_cpu=True) > 0
    default = RolloutSettings(rollout={"engine": "vllm"}).rollout
    assert _kv_cache_bytes(default, on_cpu=True) == pytest.approx(10 * _kv_cache_bytes(small, on_cpu=True), rel=1e-6)
    assert _kv_cache_bytes(default, on_cpu=False) is None                  # on GPUs vLLM's share stands
    sized = RolloutSettings(rollout={"engine": "vllm", "kv_cache_gib": 0.5}).rollout
    assert _kv_cache_bytes(sized, on_cpu=False) == _kv_cache_bytes(sized, on_cpu=True) == 2**29


def test_prompt_seed_depends_on_the_seed_and_the_prompt_only():
    assert prompt_seed(3, [1, 2, 3]) == prompt_seed(3, [1, 2, 3])
    assert prompt_seed(3, [1, 2, 3]) != prompt_seed(4, [1, 2, 3]) != prompt_seed(3, [1, 2, 4])
    assert 0 <= prompt_seed(2**40, list(range(100))) < 2**62        # vLLM adds the sample index to it


def test_swap_gate_waits_for_running_generations_and_holds_new_ones_back():
    async def main():
        gate, order = _SwapGate(), []
        early_in, early_may_end = asyncio.Event(), asyncio.Event()

        async def generation(name, entered=None, may_end=None):
            async with gate.shared():
                order.append(f"{name} start")
                if entered is not None:
                    entered.set()
                    await may_end.wait()
                order.append(f"{name} end")

        async def swap():
            async with gate.exclusive():
                order.append("swap")

        early = asyncio.create_task(generation("early", early_in, early_may_end))
        await early_in.wait()
        swapping = asyncio.create_task(swap())
        await asyncio.sleep(0)          # one loop turn: the swap registers and waits for the early generation
        late = asyncio.create_task(generation("late"))
        await asyncio.sleep(0)          # one loop turn: the late generation meets the waiting swap
        held = list(order)
        early_may_end.set()
        await asyncio.gather(early, swapping, late)
        return held, order

    held, order = asyncio.run(main())
    assert held == ["early start"]
    assert order == ["early start", "early end", "swap", "late start", "late end"]
