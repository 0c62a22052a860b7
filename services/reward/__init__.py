"""meshrl services/reward."""
