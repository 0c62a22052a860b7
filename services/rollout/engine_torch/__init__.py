"""The `torch` rollout engine (engine.py) and its decoding: the eager loop, the CUDA-graph decoder, its kernels."""
