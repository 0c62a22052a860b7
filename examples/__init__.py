"""meshrl examples."""
