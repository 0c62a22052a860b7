"""The `openai` rollout engine (engine.py): a proxy to an OpenAI-compatible server, whose weights it updates
through vLLM's HTTP endpoints (upstream_weights.py)."""
