"""Where a process's weights live, and the rule `weight_sync.transport: auto` picks a replica's transport by.

Pure and light (no torch, no grpc): the trainer's AutoSender follows it at each push, and the coordinator
applies it to the services' GetInfo when it writes the run's recipe.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """Where a process's weights live (GetInfo details host_id, device_uuid; services/common/tensors/weight_transport.py
    placement_of) and, for a replica, the transports it can receive."""

    host_id: str = ""
    device_uuid: str = ""               # "" when not on a CUDA device
    transports: tuple[str, ...] = ("grpc",)


def pick_transport(trainer: Placement, replica: Placement, *, nccl_here: bool) -> tuple[str, str]:
    """(transport, why) for one replica: ipc when it holds the trainer rank 0's GPU, nccl when it is on another GPU
    of the same host and both ends have NCCL, grpc otherwise. Pure: the rule `weight_sync.transport: auto` follows."""
    if not trainer.device_uuid:
        return "grpc", "the trainer is not on a CUDA device"
    if not replica.device_uuid:
        return "grpc", "the replica is not on a CUDA device"
    if replica.device_uuid == trainer.device_uuid:
        if "ipc" in replica.transports:
            return "ipc", "replica shares the trainer's GPU"
        return "grpc", "replica shares the trainer's GPU but does not take ipc"
    if replica.host_id and replica.host_id == trainer.host_id:
        if nccl_here and "nccl" in replica.transports:
            return "nccl", "replica on another GPU of this host"
        return "grpc", "replica on another GPU of this host, but NCCL (CuPy) is missing on one end"
    return "grpc", "replica on another host (set weight_sync.transport nccl where NCCL reaches it)"


def placement_from(details) -> Placement:
    """A service's Placement from its GetInfo details (host_id, device_uuid, weight_transports)."""
    return Placement(details.get("host_id", ""), details.get("device_uuid", ""),
                     tuple(t for t in details.get("weight_transports", "grpc").split(",") if t))
