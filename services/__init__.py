"""meshrl services."""
