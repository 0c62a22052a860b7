"""Where a benchmark JSON came from: the commit and a digest of the code it measures, so a doc can say when it went stale.

Each results file names the source paths whose change makes its figures stale (`SOURCES`). A benchmark
stamps its JSON with `stamp()` (or `python bench/provenance.py stamp FILE...` after a GPU part); `staleness()`
compares the stamped digest with the working tree's. Files measured before stamps existed carry only a
`commit`; for them the comparison is `git diff <commit> -- <paths>` when git has that commit.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"

_MESH = ["services", "coordinator", "protos/meshrl"]
# results file stem -> the code whose change makes its figures stale (files or folders, relative to the repo)
SOURCES: dict[str, list[str]] = {
    # `meshrl up` of a recipe with its defaults beside the tuned flags: every service's code is measured.
    "up_gpu": ["services", "coordinator", "protos/meshrl", "examples/gpu", "bench/up_gpu.py",
               "bench/peers/mesh_watch.py"],
    "trainer_mfu": ["services/trainer", "services/common/tensors/fused.py", "services/common/tensors/compile.py",
                    "services/common/tensors/modeling.py", "bench/trainer_mfu.py"],
    "trainer_packing": ["services/trainer", "services/common/tensors/fused.py", "services/common/tensors/packing.py",
                        "services/common/tensors/vocab_parallel.py", "services/common/tensors/modeling.py", "bench/trainer_packing.py"],
    "trainer_packing_cpu": ["services/trainer", "services/common/tensors/fused.py", "services/common/tensors/packing.py",
                            "services/common/tensors/vocab_parallel.py", "services/common/tensors/modeling.py",
                            "bench/trainer_packing.py"],
    "rollout_throughput_gpu": ["services/rollout/engine_torch/engine.py", "services/rollout/engine_torch/decode.py",
                               "services/rollout/engine_torch/cuda_decode.py",
                               "services/rollout/engine_torch/graph_step.py",
                               "services/rollout/engine_torch/decode_attention.py",
                               "services/rollout/engine_torch/fused_sample.py",
                               "services/rollout/engine_torch/sampling.py", "bench/rollout_gpu.py"],
    "decode_step_gpu": ["services/rollout/engine_torch/cuda_decode.py", "services/rollout/engine_torch/graph_step.py",
                        "services/rollout/engine_torch/decode_attention.py",
                        "services/rollout/engine_torch/fused_sample.py", "bench/decode_step.py"],
    "decode_step_seeded_gpu": ["services/rollout/engine_torch/cuda_decode.py",
                               "services/rollout/engine_torch/graph_step.py",
                               "services/rollout/engine_torch/decode_attention.py",
                               "services/rollout/engine_torch/fused_sample.py", "bench/decode_step.py"],
    "vs_trl_gpu": [*_MESH, "bench/e2e_grpo.py", "bench/peers"],
    "observability_cpu": ["services/common/rpc/metrics.py", "services/common/rpc/tracing.py", "services/common/rpc/server.py",
                          "services/common/rpc/channel.py", "coordinator/runapi/observe.py",
                          "bench/observability_overhead.py"],
    "vs_trl_cpu": [*_MESH, "bench/e2e_grpo.py", "bench/peers"],
    "demo_cpu": [*_MESH, "examples/arith/grpo.yaml", "bench/demo_cpu.py"],
    "many_runs_cpu": [*_MESH, "examples/arith/grpo_lora.yaml", "bench/many_runs.py"],
    "many_runs_gpu": [*_MESH, "examples/arith/grpo_lora.yaml", "bench/many_runs.py"],
    "async_cpu": [*_MESH, "examples/arith/grpo.yaml", "bench/demo_cpu.py", "bench/async_cpu.py"],
    "async_gpu": [*_MESH, "bench/e2e_grpo.py", "bench/async_rl.py", "bench/peers"],
    "wordproblems_cpu": [*_MESH, "examples/wordproblems/grpo.yaml", "examples/wordproblems/reward.py",
                         "examples/wordproblems/model/model.safetensors", "bench/wordproblems_cpu.py"],
    "episodes_cpu": ["services/rollout/agents/episodes.py", "services/rollout/agents/loops.py",
                     "services/rollout/agents/env_client.py",
                     "services/rollout/engine_torch/engine.py", "services/rollout/engine_torch/decode.py",
                     "services/common/chat_delta.py", "services/env", "bench/episodes.py"],
    "episodes_gpu": ["services/rollout/agents/episodes.py", "services/rollout/agents/loops.py",
                     "services/rollout/agents/env_client.py",
                     "services/rollout/engine_torch/engine.py", "services/rollout/engine_torch/decode.py",
                     "services/rollout/engine_torch/cuda_decode.py", "services/rollout/engine_torch/graph_step.py",
                     "services/rollout/engine_torch/decode_attention.py",
                     "services/rollout/engine_torch/fused_sample.py",
                     "services/common/chat_delta.py", "services/env", "bench/episodes.py"],
    # bench/episodes.py --kv-caches none,paged,paged_graphs (gpu_session.sh paged_kv): the episode code and the cache
    "paged_episodes_gpu": ["services/rollout/agents/episodes.py", "services/rollout/agents/loops.py",
                           "services/rollout/agents/env_client.py", "services/rollout/engine_torch/engine.py",
                           "services/rollout/engine_torch/paged", "services/rollout/engine_torch/cuda_decode.py",
                           "services/rollout/engine_torch/graph_step.py", "services/rollout/engine_torch/fused_sample.py",
                           "services/common/chat_delta.py", "services/env", "bench/episodes.py"],
    "decode_profile_gpu": ["services/rollout/engine_torch", "bench/decode_profile.py"],
    # its LoRA part alone, from a later call (gpu_session.sh profile with PROFILE_PARTS=lora)
    "decode_profile_lora_gpu": ["services/rollout/engine_torch", "bench/decode_profile.py"],
    "decode_profile_paged_1_5b_gpu": ["services/rollout/engine_torch", "bench/decode_profile.py"],
    "cascade_attention_gpu": ["services/rollout/engine_torch/paged/attention.py",
                              "services/rollout/engine_torch/paged/cascade.py", "bench/cascade_attention.py"],
    "paged_kv_gpu": ["services/rollout/engine_torch/paged", "services/rollout/engine_torch/engine.py",
                     "services/rollout/engine_torch/decode.py", "services/rollout/engine_torch/cuda_decode.py",
                     "services/rollout/engine_torch/graph_step.py", "services/rollout/engine_torch/decode_attention.py",
                     "services/rollout/engine_torch/fused_sample.py", "bench/paged_kv.py"],
    "env_tools": ["services/env", "services/common/tool_calls.py", "protos/meshrl/v1/env.proto", "bench/env_tools.py"],
    "weight_sync": ["services/trainer/weights/senders.py", "services/trainer/weights/grpc_sender.py",
                    "services/trainer/weights/ipc_sender.py", "services/trainer/weights/nccl_sender.py",
                    "services/trainer/weights/choice.py",
                    "services/common/tensors/weight_transport.py", "services/common/tensors/device_staging.py",
                    "services/rollout/weight_receivers.py", "bench/weight_sync.py"],
    "weight_sync_ipc": ["services/common/tensors/weight_transport.py", "bench/weight_sync_ipc.py"],
    # LoRA at the 1.5B shape: adapter vs full weight sync (every transport's code) and multi-adapter decode.
    "lora_gpu": ["services/trainer/weights", "services/common/tensors/weight_transport.py",
                 "services/common/tensors/device_staging.py", "services/common/base_identity.py",
                 "services/rollout/weight_receivers.py", "services/rollout/servicer.py", "services/rollout/engine_torch", "bench/lora_gpu.py"],
    # An adapter push over grpc on the CPU (issue 43's host-side costs), beside a baseline checkout.
    "adapter_load_cpu": ["services/common/tensors/weight_transport.py", "services/common/tensors/weights.py",
                         "services/rollout/convert.py", "services/rollout/weight_receivers.py",
                         "services/rollout/engine_torch/lora.py", "bench/adapter_load_cpu.py"],
    "adapter_sync_cpu": ["services/trainer/weights", "services/common/tensors/weight_transport.py",
                         "services/common/tensors/weights.py", "services/rollout/weight_receivers.py",
                         "services/rollout/servicer.py", "services/rollout/engine_torch/lora.py",
                         "services/rollout/engine_torch/engine.py", "bench/adapter_sync.py"],
    "payloads": ["services/common/tensors/packed.py", "protos/meshrl/v1/common.proto", "protos/meshrl/v1/rollout.proto",
                 "protos/meshrl/v1/reference.proto", "protos/meshrl/v1/trainer.proto", "bench/payloads.py"],
    "multi_gpu": [*_MESH, "bench/multi_gpu.py"],
    "weight_gather": ["services/trainer/weights/gather.py", "services/trainer/parallel/parallelize.py",
                      "bench/weight_gather.py"],
    "weight_gather_gpu": ["services/trainer/weights/gather.py", "services/trainer/parallel/parallelize.py",
                          "bench/weight_gather.py"],
    "trainer_fit": ["services/trainer/model/lora.py", "services/trainer/parallel/parallelize.py",
                    "services/trainer/model/optim.py", "bench/trainer_fit.py"],
    "trainer_fit_gpu": ["services/trainer/model/lora.py", "services/trainer/parallel/parallelize.py",
                        "services/trainer/model/optim.py", "bench/trainer_fit.py"],
    # LoRA vs full actor steps through the trainer itself (its step, compile, fused head, master weights).
    "lora_train": ["services/trainer", "services/common/tensors/fused.py", "services/common/tensors/compile.py",
                   "bench/lora_train.py"],
    "lora_train_gpu": ["services/trainer", "services/common/tensors/fused.py", "services/common/tensors/compile.py",
                       "bench/lora_train.py"],
    # The LoRA graph step's extra GEMMs, kernel by kernel (cuBLAS at the 1.5B shape; the bench alone).
    "lora_decode_gemms_gpu": ["bench/lora_decode_gemms.py"],
    # The same, both variants at one setting other than the file above's (gpu_session.sh loratrain LORA_CKPT, LORA_BUDGET).
    "lora_train_gpu_none_4096": ["services/trainer", "services/common/tensors/fused.py",
                                 "services/common/tensors/compile.py", "bench/lora_train.py"],
    # ... at the trainer's defaults for both (no checkpointing, 16,384 tokens a micro-batch: the whole batch).
    "lora_train_gpu_none": ["services/trainer", "services/common/tensors/fused.py",
                            "services/common/tensors/compile.py", "bench/lora_train.py"],
    # LoRA vs full at the tiny width and 1.5B's 28 layers on a CPU: the host's own work a step (bench/lora_train.py
    # --shape tiny-deep), which a GPU step waits on when its kernels are small.
    "lora_train_host_cpu": ["services/trainer", "services/common/tensors/fused.py",
                            "services/common/tensors/compile.py", "bench/lora_train.py"],
    # The eager LoRA trainer's step at 128 and 512 rows (bench/gpu_session.sh trainscale: what merging runs saves).
    "lora_train_scale_gpu": ["services/trainer", "services/common/tensors/fused.py",
                             "services/common/tensors/compile.py", "bench/lora_train.py"],
    # Several runs' updates in one merged pass beside one adapter's of the same rows (bench/lora_train.py lora_merged
    # variants; gpu_session.sh mergedtrain on a GPU, --shape tiny-deep on a CPU: the host's work).
    "lora_merged_train_gpu": ["services/trainer", "services/common/tensors/fused.py",
                              "services/common/tensors/compile.py", "bench/lora_train.py"],
    "lora_merged_train_cpu": ["services/trainer", "services/common/tensors/fused.py",
                              "services/common/tensors/compile.py", "bench/lora_train.py"],
}


def _files(paths: list[str], root: Path) -> list[Path]:
    out: list[Path] = []
    for rel in paths:
        p = root / rel
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in {".py", ".proto", ".yaml", ".sh"}
                          and "__pycache__" not in f.parts)
        elif p.is_file():
            out.append(p)
    return out


def source_digest(stem: str, root: Path | None = None) -> str:
    """sha256 over the relative names and bytes of the files `SOURCES[stem]` covers, as they are on disk."""
    root = root or REPO
    h = hashlib.sha256()
    for f in _files(SOURCES[stem], root):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)


def head_commit() -> str:
    """$MESHRL_COMMIT when set (a copy of the tree on a GPU machine may carry an old .git of its own: its HEAD is not
    what ran), else the short commit of the tree."""
    if os.environ.get("MESHRL_COMMIT"):
        return os.environ["MESHRL_COMMIT"]
    got = _git("rev-parse", "--short", "HEAD")
    return got.stdout.strip() if got.returncode == 0 else "unknown"


def _edits(stem: str) -> bool | None:
    """Whether the tree's source paths differ from its commit; None when git cannot tell: no git, or a .git whose
    HEAD is not $MESHRL_COMMIT (a GPU machine's copy of an older .git: its status compares the wrong commit)."""
    named = os.environ.get("MESHRL_COMMIT")
    if named:
        here = _git("rev-parse", "--short", "HEAD").stdout.strip()
        if not here or not (here.startswith(named) or named.startswith(here)):
            return None
    dirty = _git("status", "--porcelain", "--", *SOURCES[stem])
    return bool(dirty.stdout.strip()) if dirty.returncode == 0 else None


def stamp(stem: str, result: dict, shared_machine: bool | None = None) -> dict:
    """Adds `provenance` (commit, whether the tree had edits, source digest, date, host) to `result`."""
    prov = {"commit": head_commit(),
            "source_paths": SOURCES[stem],
            "source_digest": source_digest(stem),
            "tree_had_uncommitted_edits": _edits(stem),
            "measured_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "host": f"{platform.machine()}, {os.cpu_count()} cores"}
    if shared_machine is not None:
        prov["machine_shared_with_other_jobs"] = shared_machine
    result["provenance"] = prov
    return result


def staleness(stem: str, data: dict) -> tuple[bool | None, str]:
    """(stale, commit): True when the measured code changed since; None when that cannot be told here."""
    prov = data.get("provenance") or {}
    machine = data.get("machine") if isinstance(data.get("machine"), dict) else {}
    commit = prov.get("commit") or machine.get("git_commit") or "?"
    if stem not in SOURCES:
        return None, commit
    if prov.get("source_digest"):
        return prov["source_digest"] != source_digest(stem), commit
    if commit == "?" or _git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        return None, commit
    diff = _git("diff", "--quiet", commit, "--", *SOURCES[stem])
    return (diff.returncode == 1) if diff.returncode in (0, 1) else None, commit


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("stamp", help="stamp result JSONs (stem from the file name) with the commit and digest")
    st.add_argument("files", nargs="+", type=Path)
    st.add_argument("--as", dest="stem", help="the results stem whose sources it measures (default: the file's)")
    st.add_argument("--restamp", action="store_true",
                    help="the file was measured on another machine (the GPU host, whose checkout has no git): keep "
                         "its measured_at and host, take the commit and digest from this checkout")
    sub.add_parser("check", help="print each results file's commit and whether the code changed since")
    args = ap.parse_args(argv)
    if args.cmd == "stamp":
        for f in args.files:
            if not f.exists():
                print(f"provenance: {f} not written, nothing to stamp", file=sys.stderr)
                continue
            data = json.loads(f.read_text())
            measured = {k: v for k, v in (data.get("provenance") or {}).items() if k in ("measured_at", "host")}
            if args.restamp and len(measured) < 2:
                print(f"provenance: {f}: --restamp needs the measuring machine's provenance.measured_at and host; "
                      "the file has no such stamp", file=sys.stderr)
                return 2
            data = stamp(args.stem or f.stem, data)
            if args.restamp:
                data["provenance"]["stamped_here_at"] = data["provenance"]["measured_at"]
                data["provenance"].update(measured)
            f.write_text(json.dumps(data, indent=1) + "\n")
        return 0
    for f in sorted(RESULTS.glob("*.json")):
        stale, commit = staleness(f.stem, json.loads(f.read_text()))
        print(f"{f.name:32} {commit:10} {'stale' if stale else 'fresh' if stale is False else 'unknown'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
