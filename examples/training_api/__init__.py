"""Loops written over the training API (docs/training_api.md)."""
