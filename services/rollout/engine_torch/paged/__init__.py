"""Paged KV cache of the torch engine: block pool and prefix cache (blocks.py), KV storage (kv.py), the model
forward over block tables (forward.py) and the scheduler that admits, forks, preempts and resumes rows (decoder.py)."""
