"""meshrl services/rollout."""
