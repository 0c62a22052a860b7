"""The trainer's update kinds (actor, critic, DPO), each a loss over the one shared loop in runner.py."""
