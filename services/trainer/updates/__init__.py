"""The trainer's update kinds (actor, critic, DPO), each a loss over the one shared loop in runner.py, and the pure
loss math they use (losses.py)."""
