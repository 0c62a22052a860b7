"""Multi-turn episodes in the rollout replica: the episode runner, its agent loops, the env role as they see it,
and the OpenAI-style pieces they share with the HTTP API (function calling, proxy-mode sessions)."""
