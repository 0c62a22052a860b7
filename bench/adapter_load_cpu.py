"""The rollout replica's host work per adapter push (issue 43: an ipc push's replica side is ~10 ms on an H200, mostly
host work per tensor), measured on the CPU in process, this tree beside another checkout in the same run:
bench/results/adapter_load_cpu.json.

The adapter is rank 16 on all 7 projections of 28 layers (196 A/B pairs, 392 tensors, PEFT's names, bf16 as the GPU
replica's). Two model shapes, both with 28 layers:
- `1.5b`: Qwen2.5-1.5B's projection shapes (hidden 1536, intermediate 8960; 36.9 MB adapter): memory traffic and
  host work together, as a CPU replica pays them;
- `narrow`: hidden 64, intermediate 128 (the same 392 tensors, a few KB each): host work alone, what a GPU replica
  pays on its CPU while the device copies are microseconds.
Only the bank's layers matter (their weights stay on the meta device). Per push, medians over `--repeats` after
warm-up, then over rounds (rounds alternate the trees, so machine noise hits both alike):
- `manifest_s`: the update's manifest from its protobuf (convert.manifest_from_pb, as the servicer calls it);
- `views_s`: the manifest checked (PayloadAssembler) and the tensors made views of the landed flat buffer
  (tensors_from_flat): the ipc and nccl receivers' host work besides their device copy and checksum;
- `receive_s`: transport grpc's receiver (HostReceiver: every bucket CRC-checked and staged, the views);
- `load_s`: the engine's load_adapter (TorchAdapters: names, ranks and shapes checked, the slot written);
- `ipc_host_s` = manifest + views + load; `grpc_s` = manifest + receive + load;
- `gpu_b_path` (trees with lora_load.py only): the load with the B's written as on a GPU, run on this CPU:
  `stacked` (one stacked multiply and copy per projection, AdapterBank.b_stacks) beside `foreach` (the stacks left out:
  one foreach multiply and a foreach copy that runs a copy per B, as 2f60487's CUDA branch did). On a GPU each of
  those per-B copies is also a kernel launch.

    git archive <commit> | tar -x -C /tmp/base
    OMP_NUM_THREADS=1 PYTHONPATH=.:protos python bench/adapter_load_cpu.py --baseline /tmp/base --baseline-commit <c>
    PYTHONPATH=.:protos python bench/adapter_load_cpu.py --tiny --out /tmp/adapter_load.json     # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPES = {
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960),
    "narrow": dict(hidden_size=64, num_hidden_layers=28, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128),
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=48),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PHASES = ("manifest_s", "views_s", "receive_s", "load_s")


def bank_of_shape(size: str, rank: int):
    """An AdapterBank (one slot) over a Qwen2 of that shape whose weights stay on the meta device but its embedding's
    (the bank takes its device and dtype from the first parameter)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from services.rollout.engine_torch.lora import AdapterBank

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPES[size], vocab_size=256, tie_word_embeddings=True)).bfloat16()
    model.model.embed_tokens.to_empty(device="cpu")
    return AdapterBank(model, max_loras=1, max_rank=rank, targets=TARGETS, max_rows=8)


def child(size: str, rank: int, repeats: int) -> dict:
    """One tree's phases at one shape, in this process (its services/ come from PYTHONPATH)."""
    import torch
    from meshrl.v1 import common_pb2
    from services.common.tensors.weight_transport import HostPayload, decode_bucket, encode_bucket, tensors_from_flat
    from services.common.tensors.weights import PayloadAssembler, build_manifest
    from services.rollout import convert
    from services.rollout.engine_torch.lora import TorchAdapters
    from services.rollout.weight_receivers import HostReceiver

    torch.set_num_threads(1)
    engine = TorchAdapters()
    engine.adapters, engine.weight_version = bank_of_shape(size, rank), 0
    g = torch.Generator().manual_seed(2)
    state = {}
    for path, m in engine.adapters.layers.items():
        for w, shape in (("A", (rank, m.in_features)), ("B", (m.out_features, rank))):
            state[f"base_model.model.{path}.lora_{w}.weight"] = (torch.randn(shape, generator=g) / 64).bfloat16()
    config = {"r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS}
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in state.values()])
    receiver = HostReceiver("cpu")
    times: dict[str, list[float]] = {k: [] for k in PHASES}

    async def push(version: int) -> None:
        manifest_pb = convert.manifest_to_pb(build_manifest(state, version))
        raw = common_pb2.WeightBucket(manifest=manifest_pb).SerializeToString()
        payload = HostPayload(state, version, 4 << 20)
        payload.start()
        wire = [encode_bucket(parts, await payload.crc(i)) for i, parts in enumerate(payload.buckets)]
        payload.close()

        async def buckets():
            for b in map(decode_bucket, wire):
                yield b.data, b.crc32

        t0 = time.perf_counter()
        manifest = convert.manifest_from_pb(decode_bucket(raw).manifest)
        t1 = time.perf_counter()
        PayloadAssembler(manifest)
        views = tensors_from_flat(flat, manifest)
        t2 = time.perf_counter()
        received = await receiver.receive(manifest, buckets())
        t3 = time.perf_counter()
        engine.load_adapter("default", version, config, dict(received.tensors))
        t4 = time.perf_counter()
        receiver.keep(received)
        assert len(views) == len(state)
        for k, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            times[k].append(dt)

    async def main():
        for i in range(repeats + 3):
            await push(i + 1)

    asyncio.run(main())
    out = {k: statistics.median(v[3:]) for k, v in times.items()}
    if hasattr(engine.adapters, "b_stacks"):
        out["gpu_b_path"] = gpu_b_path(engine, state, config, repeats)
    out["ipc_host_s"] = out["manifest_s"] + out["views_s"] + out["load_s"]
    out["grpc_s"] = out["manifest_s"] + out["receive_s"] + out["load_s"]
    bank = engine.adapters
    out["num_tensors"] = len(state)
    out["adapter_bytes"] = flat.numel()
    out["slot_checksum"] = float(sum(t.float().abs().sum() for t in bank.buffers()))   # both trees load alike
    return out


def gpu_b_path(engine, tensors: dict, config: dict, repeats: int) -> dict:
    """engine.load_adapter's median seconds with the GPU's B path on this CPU, the stacks used and left out."""
    bank = engine.adapters
    bank.batched_b_devices, stacks, out = (bank.device.type,), bank.b_stacks, {}
    for name, use in (("stacked", stacks), ("foreach", [])):
        bank.b_stacks, times = use, []
        for i in range(repeats + 3):
            t0 = time.perf_counter()
            engine.load_adapter("default", 1000 + i, config, tensors)
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times[3:])
    bank.b_stacks, bank.batched_b_devices = stacks, type(bank).batched_b_devices
    return out


def run_round(tree: Path, size: str, args) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{tree}:{tree / 'protos'}", "OMP_NUM_THREADS": os.environ.get(
        "OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", size, "--rank", str(args.rank),
           "--repeats", str(args.repeats)]
    out = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=1200)
    if out.returncode:
        raise RuntimeError(f"round in {tree} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(rounds: list[dict]) -> dict:
    keys = (*PHASES, "ipc_host_s", "grpc_s")
    out = {k: round(statistics.median(r[k] for r in rounds), 6) for k in keys}
    if "gpu_b_path" in rounds[0]:
        out["gpu_b_path"] = {k: round(statistics.median(r["gpu_b_path"][k] for r in rounds), 6)
                             for k in rounds[0]["gpu_b_path"]}
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="", help="a checkout of the commit to compare with (measured alike)")
    parser.add_argument("--baseline-commit", default="", help="the commit that checkout holds (recorded)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model (a smoke test of the code paths)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--shared", action="store_true", help="the machine runs other jobs too (stamped)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "adapter_load_cpu.json"))
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.rank, args.repeats)), flush=True)
        return
    trees = {"head": REPO, **({"baseline": Path(args.baseline).resolve()} if args.baseline else {})}
    sizes = ["tiny"] if args.tiny else ["narrow", "1.5b"]
    load_before = os.getloadavg()[0]
    result: dict = {"rank": args.rank, "dtype": "bfloat16", "targets": TARGETS, "rounds": args.rounds,
                    "repeats": args.repeats, "threads": os.environ.get("OMP_NUM_THREADS", "1"), "shapes": {}}
    for size in sizes:
        rounds: dict[str, list[dict]] = {name: [] for name in trees}
        for r in range(args.rounds):
            for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                rounds[name].append(run_round(trees[name], size, args))
                print(size, name, json.dumps(rounds[name][-1]), flush=True)
        row = {"model": SHAPES[size], "num_tensors": rounds["head"][0]["num_tensors"],
               "adapter_bytes": rounds["head"][0]["adapter_bytes"]}
        for name, rs in rounds.items():
            row[name] = {**summary(rs), "rounds": rs}
        if "baseline" in rounds:
            if rounds["baseline"][0]["slot_checksum"] != rounds["head"][0]["slot_checksum"]:
                raise RuntimeError(f"{size}: the trees loaded different slots")
            keys = (*PHASES, "ipc_host_s", "grpc_s")
            row["saved_ms"] = {k: round(1e3 * (row["baseline"][k] - row["head"][k]), 3) for k in keys}
            row["speedup"] = {k: round(row["baseline"][k] / row["head"][k], 2) for k in keys}
        result["shapes"][size] = row
    result["load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    if args.baseline:
        result["baseline_commit"] = args.baseline_commit or "?"
    sys.path[:0] = [str(REPO / "bench")]
    from provenance import stamp

    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(stamp("adapter_load_cpu", result, shared_machine=args.shared or None), indent=2)
                        + "\n")
    for size, row in result["shapes"].items():
        print(size, json.dumps({k: v for k, v in row.items() if k in ("saved_ms", "speedup")} or row["head"]))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
