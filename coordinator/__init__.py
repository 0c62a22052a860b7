"""meshrl coordinator."""
