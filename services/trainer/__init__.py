"""meshrl services/trainer."""
