"""One run's training over the mesh: the RL loop and its phases, DPO, the training families' registry, advantage
estimators, async rollouts, rollout correction, episodes, what a step reports, and the typed calls to the services
(remote)."""
