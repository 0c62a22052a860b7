"""The trainer's device mesh and how a model is laid out on it: dimensions and process groups, parallelization
(TP, PP, FSDP/DDP), pipeline stages, and this rank's share of a batch."""
