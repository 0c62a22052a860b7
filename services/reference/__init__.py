"""meshrl services/reference."""
