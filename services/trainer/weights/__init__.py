"""The actor's weights on their way out of the trainer: gathered from the mesh to rank 0, pushed to rollout replicas
by a sender per transport (grpc, ipc, nccl), exported as a Hugging Face folder."""
