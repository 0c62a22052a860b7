"""The env service: tools (calculator, sandboxed python, user functions) and text environments (docs/agentic.md)."""
