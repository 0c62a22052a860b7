"""Replica pools: the code lives in services/common/pools.py (the rollout replica calls the env role through it too);
this module keeps the coordinator's imports working."""

from services.common.pools import (RETRYABLE, Replica, ReplicaPool, configured, is_retryable,  # noqa: F401
                                   resolve_dns, split_round_robin)
