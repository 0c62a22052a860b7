"""An adapter push over grpc loopback on the CPU, this tree beside another checkout in the same run (issue 43's adapter
sync, its host side): bench/results/adapter_sync_cpu.json.

Each round runs in a child process of its own, importing services/ from one tree: it spawns a real rollout replica
(servicer, receivers, TorchEngine with rollout.enable_lora, max_loras 1) around a Qwen2.5-1.5B-shaped model (bf16 by
default, as the GPU replica's; its weights are left uninitialised: an adapter push never reads them) and pushes one
adapter (rank 16 on all 7 projections of 28 layers: 392 tensors, 36.9 MB in bf16, PEFT's names) `--repeats` times
with the trainer's own grpc sender, new values every push. Per push: `push_s`, from the call to the replica's version
reply, and `replica_s`, the replica's own share (UpdateWeightsResponse.seconds: received, checked, loaded); medians
over the pushes after the first, then over rounds. Rounds alternate the trees, so machine noise hits both alike.
Each round then times the push's parts in process, without the network (`phases`: the sender's payload, the
replica's receive, the bank's load); what the replica's share holds beyond its two parts is the gRPC stream.

    git archive <commit> | tar -x -C /tmp/base        # the baseline tree (no git metadata needed)
    OMP_NUM_THREADS=1 PYTHONPATH=.:protos python bench/adapter_sync.py --baseline /tmp/base --baseline-commit <commit> \
        [--rounds 5 --shared]
    PYTHONPATH=.:protos python bench/adapter_sync.py --tiny --out /tmp/adapter_sync.json    # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPES = {
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, tie_word_embeddings=True, max_position_embeddings=1024),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MIB = 2**20


def empty_model(size: str, dtype):
    """A Qwen2 of that shape whose weights are allocated, not initialised (random init of 1.5B takes half a minute
    and an adapter push never reads them)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPES[size], eos_token_id=None, pad_token_id=0)).to(dtype)
    return model.to_empty(device="cpu").eval().requires_grad_(False)


def replica_proc(conn, size: str, dtype: str, rank: int) -> None:
    import torch
    from services.rollout.config import RolloutSettings
    from services.rollout.engine_torch.engine import TorchEngine
    from services.rollout.servicer import start

    torch.set_num_threads(1)
    settings = RolloutSettings(
        model={"path": f"bench-qwen2-{size}", "dtype": dtype, "device": "cpu"},
        rollout={"enable_lora": True, "max_loras": 1, "max_lora_rank": rank, "lora_target_modules": TARGETS,
                 "max_batch_size": 8, "warmup": False},
        server={"max_message_bytes": 64 * MIB})
    engine = TorchEngine(settings, model=empty_model(size, getattr(torch, dtype)), tokenizer=False)

    async def main():
        mesh, port, replica = await start(settings, "127.0.0.1:0", engine=engine)
        conn.send(port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        threading.Thread(target=lambda: (conn.recv(), loop.call_soon_threadsafe(stop.set)), daemon=True).start()
        await stop.wait()
        await mesh.stop(0)
        await replica.close()

    asyncio.run(main())


def adapter_state(size: str, rank: int, dtype) -> dict:
    """Random lora_A / lora_B of every target projection under PEFT's saved names (the trainer's CPU state)."""
    import torch

    with torch.device("meta"):
        from transformers import Qwen2Config, Qwen2ForCausalLM

        model = Qwen2ForCausalLM(Qwen2Config(**SHAPES[size]))
    g = torch.Generator().manual_seed(2)
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS and ".layers." in name:
            out[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, m.in_features, generator=g) * 0.01
            out[f"base_model.model.{name}.lora_B.weight"] = torch.randn(m.out_features, rank, generator=g) * 0.01
    return {k: v.to(dtype) for k, v in out.items()}


def child(args) -> dict:
    """One round in this process (its services/ come from args.tree): the replica spawned, `repeats + 1` pushes."""
    import torch
    from services.trainer.weights.choice import build_sender
    from services.trainer.weights.senders import ManifestTags

    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    parent, conn = ctx.Pipe()
    proc = ctx.Process(target=replica_proc, args=(conn, args.size, args.dtype, args.rank), daemon=True)
    proc.start()
    try:
        if not parent.poll(600):
            raise RuntimeError("replica did not start")
        target = f"127.0.0.1:{parent.recv()}"
        state = adapter_state(args.size, args.rank, getattr(torch, args.dtype))
        tags = ManifestTags(adapter="default", adapter_config=json.dumps(
            {"r": args.rank, "lora_alpha": 2 * args.rank, "target_modules": TARGETS}))
        sender = build_sender("grpc", token=None, timeout=600.0)
        push, replica = [], []

        async def main():
            for i in range(args.repeats + 1):
                for t in state.values():          # new weights every push: the trainer just stepped
                    t.mul_(1.0001 if i % 2 else 0.9999)
                t0 = time.perf_counter()
                outcome = (await sender.push(state, i + 1, [target], bucket_bytes=int(args.bucket_mib * MIB),
                                             tags=tags))[0]
                push.append(time.perf_counter() - t0)
                replica.append(outcome.replica_seconds)
                if not outcome.ok:
                    raise RuntimeError(f"push failed: {outcome.error}")
            await sender.aclose()

        asyncio.run(main())
    finally:
        parent.send("exit")
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    return {"push_s": statistics.median(push[1:]), "replica_s": statistics.median(replica[1:]),
            "first_push_s": push[0], **phases(args, state, tags), "num_tensors": len(state),
            "adapter_bytes": sum(t.numel() * t.element_size() for t in state.values())}


def phases(args, state: dict, tags) -> dict:
    """A push's parts in this process, without the network (medians, first apart): `payload_s`, the sender's work (its
    manifest message, every bucket's CRC and wire bytes); `receive_s`, the replica's (decoding, checking and staging
    the buckets, the tensors' views: what its servicer calls for an adapter over grpc); `load_s`, the bank's load."""
    import torch
    from meshrl.v1 import common_pb2
    from services.common.tensors.weight_transport import HostPayload, decode_bucket, receive_host
    from services.rollout import convert
    from services.rollout.engine_torch.lora import AdapterBank, adapter_targets
    from services.trainer.convert import manifest_to_pb

    try:
        from services.rollout.weight_receivers import HostReceiver
        receiver = HostReceiver("cpu")
    except ImportError:         # a tree before it: the servicer called receive_host
        receiver = None
    with torch.device("meta"):
        from transformers import Qwen2Config, Qwen2ForCausalLM

        model = Qwen2ForCausalLM(Qwen2Config(**SHAPES[args.size])).to(getattr(torch, args.dtype))
    for m in [model.model.embed_tokens, *adapter_targets(model, TARGETS).values()]:
        m.to_empty(device="cpu")               # the bank's layers (and its device and dtype), nothing else
    bank = AdapterBank(model, max_loras=1, max_rank=args.rank, targets=TARGETS, max_rows=8)
    config = json.loads(tags.adapter_config)
    times: dict[str, list[float]] = {"payload_s": [], "receive_s": [], "load_s": []}

    async def wire(version: int, keep: bool) -> list[bytes]:
        """The sender's messages of one push; like the stream, it lets each go once made unless asked to keep them."""
        payload = HostPayload(state, version, int(args.bucket_mib * MIB))
        manifest_message = common_pb2.WeightBucket(manifest=tags.apply(manifest_to_pb(payload.manifest))
                                                   ).SerializeToString()
        payload.start()
        messages = [m async for m in payload.messages(manifest_message) if keep]
        payload.close()
        return messages

    async def main():
        messages = await wire(0, keep=True)
        for i in range(args.repeats + 1):
            t0 = time.perf_counter()
            await wire(i + 1, keep=False)
            t1 = time.perf_counter()
            manifest = convert.manifest_from_pb(decode_bucket(messages[0]).manifest)

            async def buckets():
                for raw in messages[1:-1]:
                    b = decode_bucket(raw)
                    yield b.data, b.crc32
            received = await (receiver.receive(manifest, buckets()) if receiver else receive_host(manifest, buckets()))
            t2 = time.perf_counter()
            bank.load("default", config, dict(received.tensors))
            t3 = time.perf_counter()
            if receiver:
                receiver.keep(received)
            for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[k].append(dt)

    asyncio.run(main())
    return {k: statistics.median(v[1:]) for k, v in times.items()}


def run_round(tree: Path, args) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{tree}:{tree / 'protos'}", "OMP_NUM_THREADS": os.environ.get(
        "OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--size", args.size, "--dtype", args.dtype,
           "--rank", str(args.rank), "--repeats", str(args.repeats), "--bucket-mib", str(args.bucket_mib)]
    out = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=1200)
    if out.returncode:
        raise RuntimeError(f"round in {tree} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="", help="a checkout of the commit to compare with (measured alike)")
    parser.add_argument("--baseline-commit", default="", help="the commit that checkout holds (recorded)")
    parser.add_argument("--tiny", action="store_true", help="tiny shape (a smoke test of the code paths)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--bucket-mib", type=float, default=4.0, help="grpc bucket size (actor.weight_bucket_bytes)")
    parser.add_argument("--shared", action="store_true", help="the machine runs other jobs too (stamped)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "adapter_sync_cpu.json"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return
    args.size = "tiny" if args.tiny else "1.5b"
    trees = {"head": REPO, **({"baseline": Path(args.baseline).resolve()} if args.baseline else {})}
    rounds: dict[str, list[dict]] = {name: [] for name in trees}
    load_before = os.getloadavg()[0]
    for r in range(args.rounds):
        for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
            rounds[name].append(run_round(trees[name], args))
            print(name, json.dumps(rounds[name][-1]), flush=True)
    result = {"size": args.size, "rank": args.rank, "dtype": args.dtype, "targets": TARGETS, "transport": "grpc",
              "bucket_mib": args.bucket_mib,
              "rounds": args.rounds, "repeats": args.repeats, "threads": os.environ.get("OMP_NUM_THREADS", "1"),
              "num_tensors": rounds["head"][0]["num_tensors"], "adapter_bytes": rounds["head"][0]["adapter_bytes"],
              "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
    for name, rs in rounds.items():
        result[name] = {k: round(statistics.median(x[k] for x in rs), 5)
                        for k in ("push_s", "replica_s", "payload_s", "receive_s", "load_s")}
        result[name]["rounds"] = rs
    if "baseline" in rounds:
        result["baseline"]["commit"] = args.baseline_commit or "?"
        result["speedup"] = {k: round(result["baseline"][k] / result["head"][k], 2)
                             for k in ("push_s", "replica_s", "payload_s", "receive_s", "load_s")}
    sys.path[:0] = [str(REPO / "bench")]
    from provenance import stamp

    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(stamp("adapter_sync_cpu", result, shared_machine=args.shared or None), indent=2)
                        + "\n")
    print(json.dumps({k: v for k, v in result.items() if k in ("head", "baseline", "speedup")}, default=str))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
