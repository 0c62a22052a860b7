"""The training API: the primitives of a user's own training loop, served beside the coordinator."""
