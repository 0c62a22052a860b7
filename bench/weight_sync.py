"""Weight sync trainer -> rollout: seconds and GB/s per transport for Qwen2.5-0.5B- and 1.5B-shaped bf16 weights.

The trainer side is this process: a bf16 state dict with the HF names and shapes of the model (tied
embedding once), pushed by the trainer's own sender (`services/trainer/weights/senders.py`). The rollout side
is a spawned process running the real rollout server (servicer, `TorchEngine`, receivers) around an
uninitialised Qwen2 of the same shape, so every push goes through the whole path: stream or handles,
checks (CRC / device checksums), staging, the all-or-nothing swap into the model, the version reply.
Timed from the call to the sender until it has every replica's reply; the first push of a device
transport (handles opened, groups formed) is reported apart.

- `--transport grpc` (CPU, loopback): beside it, in the same run, the floor of a gRPC stream of the
  same bytes with nothing else (raw-bytes messages of --bucket-mib, no manifest, CRC or apply; receiver in its
  own process too) and one memcpy of the payload.
- `--transport ipc` (one GPU shared by both processes): beside it, one device-to-device copy of every weight.
- `--transport nccl` (two GPUs: trainer on --device, replica on --replica-device): beside it, in the same
  run, a CuPy NCCL broadcast of the same bytes between the same two GPUs (nccl-tests' broadcast: a barrier,
  then the broadcasts, timed on both ranks, the slower counts), as one call and in buckets of --bucket-mib.
Correctness: after the last push the replica's fp64 sum of every tensor equals the trainer's.

    PYTHONPATH=.:protos python bench/weight_sync.py --transport grpc [--sizes 0.5b,1.5b] [--repeats 3,1]
    PYTHONPATH=.:protos python bench/weight_sync.py --transport ipc --device cuda:0
    PYTHONPATH=.:protos python bench/weight_sync.py --transport nccl --device cuda:0 --replica-device cuda:1

Results are merged into --out (bench/results/weight_sync.json) by (transport, size, CRC-32 implementation);
MESHRL_WEIGHT_CRC32=zlib measures the grpc transport without ISA-L.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "protos")]
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

SHAPES = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=1000, tie_word_embeddings=True, max_position_embeddings=64),
}
MIB = 2**20


def empty_model(size: str, device: str):
    """A Qwen2 of that shape in bf16 with uninitialised weights (no time spent on init)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPES[size])).to(torch.bfloat16)
    model.to_empty(device=device)
    model.tie_weights()                 # to_empty makes a new tensor per module: tie the head to the embedding again
    model.eval()
    return model


def trainer_state(size: str, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    from services.common.tensors.weights import named_weights

    model = empty_model(size, "meta")
    g = torch.Generator(device=device).manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
            for n, p in named_weights(model).items()}


def sums(tensors) -> list[float]:
    return [float(t.double().sum()) for t in tensors]


# --------------------------------------------------------------------------------------------------
# The rollout process


def rollout_proc(conn, size: str, device: str) -> None:
    """A real rollout replica around an empty model of `size`; answers 'checksum' on the pipe."""
    sys.path[:0] = [str(REPO), str(REPO / "protos")]
    from services.common.tensors.weights import named_weights
    from services.rollout.config import RolloutSettings
    from services.rollout.engine_torch.engine import TorchEngine
    from services.rollout.servicer import start

    torch.set_num_threads(1)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    model = empty_model(size, device)
    settings = RolloutSettings(model={"path": f"bench-qwen2-{size}", "dtype": "bfloat16", "device": device},
                               server={"max_message_bytes": 64 * MIB})
    engine = TorchEngine(settings, model=model, tokenizer=False)

    async def main():
        mesh, port, replica = await start(settings, "127.0.0.1:0", engine=engine)
        conn.send(port)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def serve_pipe():
            while True:
                msg = conn.recv()
                if msg == "checksum":
                    conn.send([engine.weight_version, sums(named_weights(model).values())])
                else:
                    loop.call_soon_threadsafe(stop.set)
                    return

        threading.Thread(target=serve_pipe, daemon=True).start()
        await stop.wait()
        await mesh.stop(0)
        await replica.close()

    asyncio.run(main())


def start_rollout(size: str, device: str):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=rollout_proc, args=(child, size, device), daemon=True)
    proc.start()
    if not parent.poll(600):
        raise RuntimeError("rollout process did not start")
    return proc, parent, f"127.0.0.1:{parent.recv()}"


def stop_rollout(proc, conn) -> None:
    conn.send("exit")
    proc.join(timeout=60)
    if proc.is_alive():
        proc.kill()


# --------------------------------------------------------------------------------------------------
# Baselines


def raw_server(conn) -> None:
    """A gRPC server that only counts the bytes of a raw stream: the floor of any gRPC transport."""
    import grpc

    opts = [("grpc.max_send_message_length", 64 * MIB), ("grpc.max_receive_message_length", 64 * MIB)]

    async def put(it, ctx):
        n = 0
        async for m in it:
            n += len(m)
        return n.to_bytes(8, "little")

    async def main():
        server = grpc.aio.server(options=opts)
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "bench.Raw", {"Put": grpc.stream_unary_rpc_method_handler(put)})])
        conn.send(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def raw_grpc_seconds(state, bucket_bytes: int, repeats: int) -> list[float]:
    import grpc

    from services.common.tensors.weight_transport import HostPayload

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=raw_server, args=(child,), daemon=True)
    proc.start()
    port = parent.recv()
    buckets = HostPayload(state, 0, bucket_bytes).buckets      # the same messages the transport sends
    total = sum(len(p) for parts in buckets for p in parts)

    async def main():
        opts = [("grpc.max_send_message_length", 64 * MIB), ("grpc.max_receive_message_length", 64 * MIB)]
        out = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts) as ch:
            call = ch.stream_unary("/bench.Raw/Put")
            for _ in range(repeats):
                async def chunks():
                    for parts in buckets:                # one copy per message, as the transport makes
                        yield b"".join(parts)
                t0 = time.perf_counter()
                got = int.from_bytes(await call(chunks()), "little")
                out.append(time.perf_counter() - t0)
                assert got == total
        return out

    try:
        return asyncio.run(main())
    finally:
        proc.kill()
        proc.join()


def memcpy_seconds(num_bytes: int, device: str, repeats: int) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del src, dst
    return statistics.median(times[1:])


def broadcast_times(comm, device: str, num_bytes: int, bucket_bytes: int, repeats: int) -> dict[str, list[float]]:
    """One rank's side of the NCCL broadcast baseline (root 0): seconds per repeat, whole and bucketed."""
    import cupy
    from cupy.cuda import nccl

    dev = torch.device(device)
    buf = torch.empty(num_bytes, dtype=torch.uint8, device=dev).fill_(1)
    stream = torch.cuda.current_stream(dev).cuda_stream
    out = {}
    with cupy.cuda.Device(dev.index):
        for mode, step in (("whole", num_bytes), ("bucketed", bucket_bytes)):
            times = []
            for _ in range(repeats + 1):          # the first repeat warms the channels up and is dropped
                comm.broadcast(buf.data_ptr(), buf.data_ptr(), 1, nccl.NCCL_UINT8, 0, stream)   # the barrier
                torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                for off in range(0, num_bytes, step):
                    n = min(step, num_bytes - off)
                    comm.broadcast(buf.data_ptr() + off, buf.data_ptr() + off, n, nccl.NCCL_UINT8, 0, stream)
                torch.cuda.synchronize(dev)
                times.append(time.perf_counter() - t0)
            out[mode] = times[1:]
    del buf
    return out


def broadcast_peer(conn, device: str, num_bytes: int, bucket_bytes: int, repeats: int) -> None:
    sys.path[:0] = [str(REPO), str(REPO / "protos")]
    from services.common.tensors.weight_transport import init_communicator

    torch.cuda.set_device(device)
    comm = init_communicator(conn.recv(), 2, 1, torch.device(device), 120.0)
    conn.send(broadcast_times(comm, device, num_bytes, bucket_bytes, repeats))
    comm.destroy()


def nccl_broadcast_seconds(num_bytes: int, device: str, peer_device: str, bucket_bytes: int,
                           repeats: int) -> dict[str, float]:
    """Median seconds of an NCCL broadcast of num_bytes from device to peer_device (a spawned process)."""
    from cupy.cuda import nccl

    from services.common.tensors.weight_transport import init_communicator

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=broadcast_peer, args=(child, peer_device, num_bytes, bucket_bytes, repeats), daemon=True)
    proc.start()
    uid = nccl.get_unique_id()
    parent.send(uid)
    comm = init_communicator(uid, 2, 0, torch.device(device), 120.0)
    try:
        mine = broadcast_times(comm, device, num_bytes, bucket_bytes, repeats)
        if not parent.poll(600):
            raise RuntimeError("nccl broadcast peer did not report")
        theirs = parent.recv()
    finally:
        comm.destroy()
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    return {mode: statistics.median(max(a, b) for a, b in zip(mine[mode], theirs[mode])) for mode in mine}


# --------------------------------------------------------------------------------------------------


def push_times(sender, state, target: str, repeats: int, bucket_bytes: int, *, first_apart: bool) -> list[float]:
    async def main():
        out = []
        for i in range(repeats + int(first_apart)):
            for t in state.values():            # new weights every round: the trainer just stepped
                t.mul_(1.0001 if i % 2 else 0.9999)
            t0 = time.perf_counter()
            outcomes = await sender.push(state, i + 1, [target], bucket_bytes=bucket_bytes)
            out.append(time.perf_counter() - t0)
            if not outcomes[0].ok:
                raise RuntimeError(f"push failed: {outcomes[0].error}")
        return out

    return asyncio.run(main())


def bench_size(size: str, transport: str, *, repeats: int, device: str, replica_device: str,
               bucket_mib: int) -> dict:
    from services.trainer.weights.choice import build_sender

    on_device = transport != "grpc"
    state = trainer_state(size, device if on_device else "cpu")
    num_bytes = sum(t.numel() * t.element_size() for t in state.values())
    bucket_bytes = bucket_mib * MIB
    from services.common.tensors.weight_transport import CRC32_IMPL

    row = {"transport": transport, "size": size, "crc32": CRC32_IMPL, "num_tensors": len(state),
           "num_bytes": num_bytes, "bucket_mib": bucket_mib, "repeats": repeats}
    if transport == "grpc":
        raw = raw_grpc_seconds(state, bucket_bytes, repeats)
        row.update(raw_grpc_seconds=[round(x, 3) for x in raw],
                   raw_grpc_gb_per_s=round(num_bytes / statistics.median(raw) / 1e9, 2))
        mc = memcpy_seconds(num_bytes, "cpu", 3)
        row.update(memcpy_seconds=round(mc, 4), memcpy_gb_per_s=round(num_bytes / mc / 1e9, 2))
    else:
        mc = memcpy_seconds(num_bytes, device, 5)
        row.update(device_copy_seconds=round(mc, 5), device_copy_gb_per_s=round(num_bytes / mc / 1e9, 1))
    if transport == "nccl":
        bc = nccl_broadcast_seconds(num_bytes, device, replica_device, bucket_bytes, 5)
        row.update(nccl_broadcast_seconds=round(bc["whole"], 5),
                   nccl_broadcast_gb_per_s=round(num_bytes / bc["whole"] / 1e9, 2),
                   nccl_broadcast_bucketed_seconds=round(bc["bucketed"], 5),
                   nccl_broadcast_bucketed_gb_per_s=round(num_bytes / bc["bucketed"] / 1e9, 2))
    proc, conn, target = start_rollout(size, replica_device if transport == "nccl" else
                                       (device if on_device else "cpu"))
    sender = build_sender(transport, token=None, timeout=600.0, collective_timeout=120.0)
    try:
        times = push_times(sender, state, target, repeats, bucket_bytes, first_apart=on_device)
        row["load_average_after"] = round(os.getloadavg()[0], 1)
        conn.send("checksum")
        version, theirs = conn.recv()
        row["versions_match"] = version == len(times)
        row["checksums_match"] = theirs == sums(state.values())
    finally:
        sender.close()
        stop_rollout(proc, conn)
    # Steady state, as every training step sees it: a device transport's first push opens handles / forms the
    # group; a CPU replica's first two receive into fresh buffers (page faults), later ones reuse the spare.
    warm = 1 if on_device else min(2, len(times) - 1)
    med = statistics.median(times[warm:])
    row.update(seconds=round(med, 4), gb_per_s=round(num_bytes / med / 1e9, 2),
               all_seconds=[round(x, 4) for x in times], first_push_seconds=round(times[0], 3))
    if transport == "grpc":
        row["vs_raw_grpc"] = round(med / statistics.median(raw), 2)
    if transport == "nccl":        # the share of the plain broadcast's bandwidth the whole push reaches
        row["vs_nccl_broadcast"] = round(row["nccl_broadcast_seconds"] / med, 3)
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", choices=["grpc", "ipc", "nccl"], default="grpc")
    parser.add_argument("--sizes", default="0.5b,1.5b")
    parser.add_argument("--repeats", default="5,3", help="pushes per size, in --sizes order (last one repeats)")
    parser.add_argument("--bucket-mib", type=int, default=None, help="default: 4 (grpc), 128 (ipc, nccl)")
    parser.add_argument("--device", default="cuda:0", help="trainer device (ipc, nccl)")
    parser.add_argument("--replica-device", default="cuda:1", help="replica device (nccl)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "weight_sync.json"))
    args = parser.parse_args(argv)
    sizes = args.sizes.split(",")
    repeats = [int(r) for r in args.repeats.split(",")]
    bucket_mib = args.bucket_mib or (4 if args.transport == "grpc" else 128)
    rows = []
    for i, size in enumerate(sizes):
        row = bench_size(size, args.transport, repeats=repeats[min(i, len(repeats) - 1)], device=args.device,
                         replica_device=args.replica_device, bucket_mib=bucket_mib)
        rows.append(row)
        print(json.dumps(row), flush=True)
    out_path = Path(args.out)
    old = json.loads(out_path.read_text()) if out_path.exists() else {}
    def key(r):
        return r["transport"], r["size"], r.get("crc32", "isal")

    keep = [r for r in old.get("results", []) if key(r) not in {key(r2) for r2 in rows}]
    env = {"cpu_count": os.cpu_count(), "machine": platform.machine(), "torch": torch.__version__}
    if args.transport != "grpc":
        env["device"] = torch.cuda.get_device_name(torch.device(args.device))
    out = {"benchmark": "weight_sync", "dtype": "bfloat16",
           "notes": "bytes counted once (the model's size); GB = 1e9 bytes; seconds = median push, call to every "
                    "reply, including checks, staging and the swap into the replica's model",
           "environments": {**old.get("environments", {}), args.transport: env},
           "results": keep + rows}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
