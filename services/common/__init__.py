"""meshrl services/common."""
