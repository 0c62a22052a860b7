"""The `vllm` rollout engine (engine.py) and the weight swap it runs inside vLLM's worker (weights.py)."""
