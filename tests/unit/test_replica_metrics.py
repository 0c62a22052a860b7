"""Per-rollout-replica metrics of a step: the share each replica generated and the weight version it served."""

import numpy as np

from coordinator.training import remote, reporting


def sample(replica: str, weight_version: int) -> remote.Sample:
    return remote.Sample(problem=None, group=0, prompt_ids=np.array([1], dtype=np.int32),
                         response_ids=np.array([2, 3], dtype=np.int32),
                         rollout_logprobs=np.array([-0.5, -0.25], dtype=np.float32), text="5",
                         finish_reason="stop", weight_version=weight_version, replica=replica)


def test_replica_metrics_count_each_replicas_samples_and_keep_its_oldest_weight_version():
    samples = [sample("rollout-a:50051", 7), sample("rollout-a:50051", 7), sample("rollout-b:50051", 7),
               sample("rollout-b:50051", 6), sample("", 7)]
    assert reporting.replica_metrics(samples) == {
        "rollout/samples/rollout-a:50051": 2.0, "rollout/weight_version/rollout-a:50051": 7.0,
        "rollout/samples/rollout-b:50051": 2.0, "rollout/weight_version/rollout-b:50051": 6.0}


def test_a_replica_that_served_nothing_has_no_metric():
    assert reporting.replica_metrics([sample("rollout-a:50051", 3)]).keys() == {
        "rollout/samples/rollout-a:50051", "rollout/weight_version/rollout-a:50051"}
