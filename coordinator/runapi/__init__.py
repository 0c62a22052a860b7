"""The run API: the gRPC servicer (`python -m coordinator` serves it), the run manager, and the state a run keeps
across steps and coordinator restarts (store, recovery, checkpoints), with its metrics sinks and observability."""
