"""Two runs, one after the other, against running meshrl services, from a plain gRPC client.

Nothing from meshrl is imported: the coordinator's methods and messages are found by gRPC reflection, as any
client in any language could. Each run asks its own learning rate and reward components; the script prints
what each run's step metrics show, or the coordinator's refusal naming the key. Both runs start from the
recipe's model.path (the second is not trained on from the first one's end), so both show the same held-out
accuracy before their first step; `run: {init_from: <first run id>}` would start the second from the first's
checkpoint instead (docs/coordinator.md, "Where a run starts from").

    python examples/run_api/two_runs.py --config examples/arith/grpo.yaml   # on `meshrl mesh`'s coordinator
    python examples/run_api/two_runs.py --coordinator 127.0.0.1:50050 --config examples/arith/grpo.yaml

The second config file (`--config`) is the services' own recipe (their addresses and data); each run sends
it with its own `actor.lr` and `reward.components` on top.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import grpc
import yaml
from google.protobuf import descriptor_pool, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

SERVICE = "meshrl.v1.Coordinator"
RUNS = (
    {"actor": {"lr": 1e-4}, "reward": {"components": [{"name": "exact_match"}]}},
    {"actor": {"lr": 3e-6}, "reward": {"components": [{"name": "exact_match", "label": "em"},
                                                      {"name": "boxed", "weight": 0.5}]}},
)


class Coordinator:
    """Callables for the coordinator's methods, built from the descriptors its reflection service serves."""

    def __init__(self, channel: grpc.Channel):
        pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
        self.service = pool.FindServiceByName(SERVICE)
        self.channel = channel

    def message(self, method: str, **fields):
        return message_factory.GetMessageClass(self.service.FindMethodByName(method).input_type)(**fields)

    def call(self, method: str, request):
        desc = self.service.FindMethodByName(method)
        reply = message_factory.GetMessageClass(desc.output_type)
        kind = self.channel.unary_stream if desc.server_streaming else self.channel.unary_unary
        return kind(f"/{SERVICE}/{method}", request_serializer=lambda m: m.SerializeToString(),
                    response_deserializer=reply.FromString)(request)


def mesh_coordinator() -> str:
    """The coordinator as `meshrl` finds it: MESHRL_COORDINATOR, the running mesh's file, then 127.0.0.1:50050."""
    if os.environ.get("MESHRL_COORDINATOR"):
        return os.environ["MESHRL_COORDINATOR"]
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    path = Path(cache) / "meshrl" / "mesh.json"
    if path.is_file():
        return json.loads(path.read_text()).get("coordinator") or "127.0.0.1:50050"
    return "127.0.0.1:50050"


def merged(base: dict, changes: dict) -> dict:
    out = dict(base)
    for section, values in changes.items():
        out[section] = {**out.get(section, {}), **values}
    return out


def one_run(coordinator: Coordinator, config: dict) -> dict:
    """Starts a run, follows its metrics to the end; returns what its steps showed."""
    start = coordinator.message("StartRun", config=json.dumps(config))   # YAML is a superset of JSON
    run_id = coordinator.call("StartRun", start).run_id
    steps = [dict(m.metrics) for m in coordinator.call("StreamMetrics", coordinator.message("StreamMetrics",
                                                                                             run_id=run_id))
             if "reward_mean" in m.metrics]
    status = coordinator.call("GetRun", coordinator.message("GetRun", run_id=run_id))
    state = status.DESCRIPTOR.fields_by_name["state"].enum_type.values_by_number[status.state].name
    return {"run_id": run_id, "state": state, "steps": len(steps),
            "heldout_accuracy_before": status.last_metrics.get("heldout_accuracy_before"),
            "actor/lr": sorted({m["actor/lr"] for m in steps}),
            "reward components": sorted({k for m in steps for k in m if k.startswith("reward/")})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coordinator", default="", help="HOST:PORT (default: the running mesh's, as meshrl finds it)")
    parser.add_argument("--config", required=True, help="the services' recipe (YAML)")
    args = parser.parse_args(argv)
    with open(args.config) as f:
        base = yaml.safe_load(f)
    with grpc.insecure_channel(args.coordinator or mesh_coordinator()) as channel:
        coordinator = Coordinator(channel)
        for changes in RUNS:
            try:
                print(json.dumps({"asked": changes, "shown": one_run(coordinator, merged(base, changes))}))
            except grpc.RpcError as e:
                print(json.dumps({"asked": changes, "refused": f"{e.code().name}: {e.details()}"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
