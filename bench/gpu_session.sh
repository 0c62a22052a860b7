#!/usr/bin/env bash
# The GPU benchmarks and tests, run on a GPU machine with torch + CUDA (the device image of docs: torch 2.11,
# transformers 5.17, CuPy); each named part writes its log and JSON under $OUT.
#
#   OUT=/tmp/gpu bench/gpu_session.sh versions gputests reference wsipc meshrl trl bundle
#   parts: versions gputests pytest decodetests packtests wstest wgather wgathercpu fit meshtests multigpu rollout episodes decode mfu packing reference wsipc ipcbench paged_kv spy loratrain
#          loratests pagedtests cascade chain lora manyruns profile trainscale mergedtrain
#          mfuautotune upgpu
#          meshrl trl trl15 trllong asyncbench asynctests asyncsplit splittests bundle
#   async RL vs sync meshrl, fixed 256 and long-tailed (lognormal, median 96, cap 1,024) lengths, 3 modes each
#   (bench/async_rl.py; ~6 e2e runs, split the workloads over two calls when STEPS is large):
#     STEPS=8 WARMUP=2 bench/gpu_session.sh asynctests asyncbench bundle
#     ASYNC_WORKLOADS=longtail STEPS=12 bench/gpu_session.sh asyncbench bundle   # then ASYNC_WORKLOADS=fixed
#   TRL on both workloads (`trl trllong`, ~5 min) fits another call; combine the returned files here:
#     STEPS=8 WARMUP=2 bench/gpu_session.sh trl trllong bundle
#     tar xzf async-runs.tgz && python bench/async_rl.py combine --out-dir async --trl-fixed trl.json \
#         --trl-longtail trl_longtail.json --out bench/results/async_gpu.json
#   two GPUs (rollout on cuda:1, trainer and reference on cuda:0; weights through NCCL, SPLIT_TRANSPORT=grpc if not):
#     STEPS=8 WARMUP=2 bench/gpu_session.sh splittests asyncsplit bundle     # -> async_gpu_split.json
#   the figures of the docs at HEAD (bench/README.md, "Keeping figures honest"): two calls of < 10 minutes,
#     MESHRL_COMMIT=<short sha> bench/gpu_session.sh versions rollout decode mfu bundle
#     MESHRL_COMMIT=<short sha> STEPS=8 WARMUP=2 bench/gpu_session.sh meshrl trl bundle
#   each result JSON is stamped with the commit ($MESHRL_COMMIT, else .meshrl_commit's, else git's) and a digest of
#   the code it measures. The device's copy of .git may be an older commit's (its HEAD and status are not the tree's):
#   before a call run `git log -1 --format=%h > .meshrl_commit` here and name .meshrl_commit in the call's carry.
#   `meshrl up examples/gpu/grpo.yaml` with the recipe alone beside the tuned flags, one GPU (bench/up_gpu.py, #38;
#   ~8 min at 1.5B: the model is built first when examples/gpu/models/ lacks it, each run compiles cold):
#     UP_STEPS=8 bench/gpu_session.sh upgpu bundle        # -> $OUT/up_gpu.json, up-logs.tgz
#   UP_STEPS (steps per run, default 8), UP_WARMUP (left out of the steady median, 2), UP_SHAPE (qwen2.5-1.5b),
#   UP_RECIPE, UP_ORDER (defaults,tuned), UP_RUN_TIMEOUT (seconds one run may take, 300), UP_BUDGET (540)
#   LoRA adapters (bench/lora_gpu.py -> $OUT/lora_gpu.json; ~6 min at 1.5B, rank 16):
#     bench/gpu_session.sh versions loratests lora bundle
#   multi-GPU hosts: OUT=/tmp/gpu bench/gpu_session.sh versions meshtests wstest multigpu bundle
#
# Python packages the image lacks travel as wheels: .whl/ (meshrl's: pydantic, pydantic-settings, tenacity,
# redis, grpcio-health-checking/-reflection, isal, ...) goes to /tmp/site for every part; .whl-trl/ (trl,
# datasets, dill, multiprocess, fsspec) to /tmp/site-trl for the TRL part only. Without them the image's own are used.
# STEPS (meshrl / trl GRPO steps, default 12), WARMUP (left out of the medians, default 3); LIMIT_<PART> (seconds).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${MESHRL_COMMIT:-}" ] && [ -s .meshrl_commit ]; then export MESHRL_COMMIT="$(cat .meshrl_commit)"; fi
OUT="${OUT:-/tmp/meshrl-gpu}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
STEPS="${STEPS:-12}"
WARMUP="${WARMUP:-3}"
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$1" "${@:2}"; }
# Only the wheels whose distribution the image lacks: one it has (typing_extensions, httpx, ...) stays the image's,
# so what torch, transformers and JAX were built against is not shadowed by /tmp/site.
missing() {
  python3 - "$@" <<'PY'
import importlib.metadata as md, re, sys
for path in sys.argv[1:]:
    name = re.split(r"-\d", path.rsplit("/", 1)[-1], maxsplit=1)[0]
    try:
        md.version(name)
    except md.PackageNotFoundError:
        print(path)
PY
}
if compgen -G ".whl/*.whl" >/dev/null; then
  need=$(missing .whl/*.whl)
  if [ -n "$need" ]; then pipi /tmp/site $need || exit 1; fi
fi
if compgen -G ".whl-trl/*.whl" >/dev/null; then pipi /tmp/site-trl .whl-trl/*.whl || exit 1; fi
export PYTHONPATH="$PWD:$PWD/protos:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
WORK=/tmp/meshrl-gpu-work
mkdir -p "$WORK"

part() {  # part NAME SECONDS CMD...: runs CMD with a time limit, output to $OUT/NAME.log; never stops the session
  local name="$1" limit="$2"; shift 2
  local override="LIMIT_${name^^}"
  limit="${!override:-$limit}"
  local t0=$SECONDS
  echo "== $name ($(date +%H:%M:%S), limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0))s"
  tail -n 6 "$OUT/$name.log"
}
stamp() {  # stamp FILE STEM: the commit and the digest of STEM's measured code (bench/provenance.py)
  python3 bench/provenance.py stamp --as "$2" "$1"
}

for what in "$@"; do
  case "$what" in
    versions)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      python3 -c "import torch, transformers, grpc, google.protobuf as pb, pydantic; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'grpcio', grpc.__version__, 'protobuf', pb.__version__, 'pydantic', pydantic.__version__)"
      ;;
    gputests) part gputests 420 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu ;;
    pytest) # PYTEST_ARGS: test files or ids (and pytest flags) of one pytest run, e.g. one GPU test file after a fix
      part pytest 400 python3 -m pytest -q -rs -p no:cacheprovider ${PYTEST_ARGS:?PYTEST_ARGS names the tests} ;;
    decodetests) part decodetests 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_decode.py \
                   tests/gpu/test_fused_logprobs.py ;;
    rollout) part rollout 360 python3 bench/rollout_gpu.py --out "$OUT/rollout_throughput_gpu.json"
             stamp "$OUT/rollout_throughput_gpu.json" rollout_throughput_gpu ;;
    episodes) # tool-calling episodes/s (tool_agent, a calculator env replica of its own) beside one generate of the
              # same tokens, Qwen2.5-0.5B-shaped, CUDA-graph decode (bench/episodes.py); EPISODES_ARGS: more flags
      part episodes 240 python3 bench/episodes.py --device cuda --shape qwen2.5-0.5b ${EPISODES_ARGS:-} \
        --out "$OUT/episodes_gpu.json"
      stamp "$OUT/episodes_gpu.json" episodes_gpu ;;
    paged_kv) # issue 44: the paged KV cache (rollout.kv_cache: paged) beside today's engine in the same process:
              # GRPO 64 x 1,024-token prompts n=8, plain decode at batch 256, a long-tailed mix at the same KV bytes
              # (bench/paged_kv.py), then the tool episodes of bench/episodes.py with either cache
      # (PAGED_KV_ARGS: more flags, e.g. --variants none,paged_graphs; PAGED_EPISODES_CACHES: the episodes' caches)
      part paged_kv 420 python3 bench/paged_kv.py ${PAGED_KV_ARGS:-} --out "$OUT/paged_kv_gpu.json"
      stamp "$OUT/paged_kv_gpu.json" paged_kv_gpu
      part paged_episodes 540 python3 bench/episodes.py --device cuda --shape qwen2.5-0.5b --prompts 32 --n 8 --rounds 3 \
        --kv-caches "${PAGED_EPISODES_CACHES:-none,paged,paged_graphs}" --out "$OUT/paged_episodes_gpu.json" ;;
    chain) # issue 44: chained windows (paged/window.py: each window launched before the host settles the one before)
      # beside windows launched after it (-nochain), and the shared-prefix kernel's grid at N programs an SM (-ppsN),
      # in bench/paged_kv.py's cases (CHAIN_CASES, CHAIN_VARIANTS; the JSON holds this call's cases only)
      part chain_paged 560 python3 bench/paged_kv.py --cases "${CHAIN_CASES:-grpo,decode}" \
        --variants "${CHAIN_VARIANTS:-none,paged_graphs,paged_graphs-nochain}" --out "$OUT/paged_kv_gpu.json"
      stamp "$OUT/paged_kv_gpu.json" paged_kv_gpu ;;
    cascade) # issue 44: the shared-prefix decode attention (paged/cascade.py): one layer's attention call beside the
      # per-row kernel (bench/cascade_attention.py), then bench/paged_kv.py's GRPO and plain decode cases with and
      # without it (CASCADE_CASES, CASCADE_VARIANTS)
      # (CASCADE_SWEEP: the group kernel's tile:warps:stages:prefix-partitions configs, bench/cascade_attention.py --sweep)
      part cascade_attention 150 python3 bench/cascade_attention.py ${CASCADE_SWEEP:+--sweep "$CASCADE_SWEEP"} \
        --out "$OUT/cascade_attention_gpu.json"
      stamp "$OUT/cascade_attention_gpu.json" cascade_attention_gpu
      part cascade_paged 420 python3 bench/paged_kv.py --cases "${CASCADE_CASES:-grpo,decode}" \
        --variants "${CASCADE_VARIANTS:-none,paged_graphs,paged_graphs-noshare}" --out "$OUT/paged_kv_gpu.json"
      stamp "$OUT/paged_kv_gpu.json" paged_kv_gpu ;;
    decode) part decode 240 python3 bench/decode_step.py --variants "${DECODE_VARIANTS:-torch,fused,fused_bn64,fused_bn128}" \
              --out "$OUT/decode_step_gpu.json"
            stamp "$OUT/decode_step_gpu.json" decode_step_gpu ;;
    mfu) # merged into the committed file: its `earlier_variants` (the engine before these features) stay
         cp bench/results/trainer_mfu.json "$OUT/trainer_mfu.json"
         part mfu 560 python3 bench/trainer_mfu.py --sizes "${MFU_SIZES:-0.5b,1.5b}" \
           --variants "${MFU_VARIANTS:-plain,engine,engine_amp,engine_eager,engine_unfused}" --profile engine \
           --trace-dir "$WORK" --merge --out "$OUT/trainer_mfu.json"
         stamp "$OUT/trainer_mfu.json" trainer_mfu
         gzip -c "$WORK"/trace_0.5b_engine.json > "$OUT/trace_0.5b_engine.json.gz" 2>/dev/null ;;
    mfuautotune) # #23's open probes (bench/mfu_probes.py), 1.5B engine step (fixed 8 x 2,048): the engine beside a
                 # bf16 residual stream under autocast, q/k/v and gate/up fused into one matmul each, and bf16-only
                 # weights; then the engine with inductor's max-autotune (Triton GEMM templates with fused epilogues
                 # timed against cuBLAS). Each in its own process and inductor cache, profiled (by_kind_ms, idle_ms).
                 # Probes: not merged into trainer_mfu.json.
      part mfu_probes 200 env TORCHINDUCTOR_CACHE_DIR="$WORK/inductor-default" python3 bench/mfu_probes.py \
        --size 1.5b --out "$OUT/mfu_probes.json"
      part mfu_max_autotune 360 env TORCHINDUCTOR_CACHE_DIR="$WORK/inductor-max-autotune" TORCHINDUCTOR_MAX_AUTOTUNE=1 \
        python3 bench/mfu_probes.py --size 1.5b --probes engine --profile engine --out "$OUT/mfu_max_autotune.json" ;;
    packing) # remove padding (packed vs padded tokens/s, long-tailed lengths) and the fused head's memory (8 x 4,096,
             # vocab 151,936), Qwen2.5-1.5B-shaped; PACK_PARTS=spread or memory splits it over two calls;
             # PACK_VARIANTS: the spread's variants (bench/trainer_packing.py --variants); PACK_PROFILE=1 profiles each
             part packing 560 python3 bench/trainer_packing.py --size "${PACK_SIZE:-1.5b}" \
               --parts "${PACK_PARTS:-spread,memory}" ${PACK_VARIANTS:+--variants "$PACK_VARIANTS"} \
               --out "$OUT/trainer_packing.json"
             stamp "$OUT/trainer_packing.json" trainer_packing ;;
    packtests) part packtests 300 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_fused_logprobs.py \
                 tests/gpu/test_trainer_memory_features.py ;;
    meshtests) part meshtests 560 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/multiproc/test_trainer_mesh.py ;;
    multigpu)  # MULTI_PARTS (mfu,sync,grpo), MULTI_LAYOUTS (bench/multi_gpu.py's LAYOUTS names) split it over calls;
               # MULTI_GRPO_STEPS: the GRPO run's length (default 10)
      part multigpu 580 python3 bench/multi_gpu.py --parts "${MULTI_PARTS:-mfu,sync,grpo}" \
        ${MULTI_LAYOUTS:+--layouts "$MULTI_LAYOUTS"} ${MULTI_GRPO_STEPS:+--grpo-steps "$MULTI_GRPO_STEPS"} --work-dir "$WORK/multi" --out "$OUT/multi_gpu.json"
      (cd "$WORK/multi" && tar czf "$OUT/multi-logs.tgz" logs-* *.log grpo-runs/logs 2>/dev/null) ;;
    wgather) # the trainer side of a push, FSDP over every GPU, Qwen2.5-1.5B-shaped: full_tensor() on every rank vs
             # the bucketed gather to the sender (services/trainer/weights/gather.py)
      part wgather 300 python3 -m torch.distributed.run --standalone --nproc_per_node="$(nvidia-smi -L | wc -l)" \
        bench/weight_gather.py --size "${WGATHER_SIZE:-1.5b}" --out "$OUT/weight_gather_gpu.json" ;;
    wgathercpu) # the same comparison at 1.5B on this host's CPUs (gloo, 4 ranks): for when one GPU is all there is
      CUDA_VISIBLE_DEVICES= part wgathercpu 300 python3 -m torch.distributed.run --standalone --nproc_per_node=4 \
        bench/weight_gather.py --size "${WGATHER_SIZE:-1.5b}" --out "$OUT/weight_gather_cpu_1.5b.json" ;;
    fit) # the largest Qwen2.5 shape whose GRPO actor step (AdamW, bf16 compute, fp32 master, checkpointing on,
         # 8 x 2,048 tokens) fits one GPU, full fine-tuning and LoRA (bench/trainer_fit.py)
      part fit 560 python3 bench/trainer_fit.py --sizes "${FIT_SIZES:-0.5b,1.5b,3b,7b}" --out "$OUT/trainer_fit_gpu.json" ;;
    loratrain) # LoRA (rank 16) vs full actor steps through TrainerEngine at the 1.5B Qwen2.5 shape, 8 x 2,048 tokens:
         # step seconds and peak memory of full, lora and lora_peft (peft's own forward), one process each
         # (LORA_VARIANTS=full,lora drops the peft-forward row when the 560 s run out: each variant compiles cold;
         # LORA_VARIANTS=full,lora,lora_addmm sets the meshrl::lora_linear op beside the addmm forward it replaced)
         # LORA_CKPT=none|selective: both variants under that activation checkpointing (default full), written to
         # lora_train_gpu_<LORA_CKPT>.json; LORA_BUDGET=TOKENS: every variant's micro-batch token budget (default the
         # whole batch of 8 x 2,048), in the file's name too
      part loratrain 560 python3 bench/lora_train.py --shape "${LORA_SHAPE:-qwen2.5-1.5b}" --rank 16 \
        --checkpointing "${LORA_CKPT:-full}" --variants "${LORA_VARIANTS:-full,lora,lora_peft}" ${LORA_PROFILE:+--profile} \
        ${LORA_BUDGET:+--micro-batch-tokens "$LORA_BUDGET"} \
        --out "$OUT/lora_train_gpu${LORA_CKPT:+_$LORA_CKPT}${LORA_BUDGET:+_$LORA_BUDGET}.json" ;;
    wstest) part wstest 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_weight_sync.py \
              tests/gpu/test_adapter_push_snapshots_gpu.py -s ;;
    trainscale) # the eager LoRA trainer (as it runs beside several runs' adapters) at the many-runs bench's shape
      # (0.5B, rank 8, 24 + 128 tokens, budget 16,384, full checkpointing unless TRAINSCALE_VARIANTS says otherwise,
      # e.g. lora@none:16384): a step of 128 rows beside one of 512, with the kernel table
      for b in ${TRAINSCALE_BATCHES:-128 512}; do
        part "trainscale_$b" 300 python3 bench/lora_train.py --shape qwen2.5-0.5b --rank 8 --batch "$b" --prompt 24 \
          --response 128 --compile false --variants "${TRAINSCALE_VARIANTS:-lora@full:16384}" --profile \
          --out "$OUT/trainscale_$b.json"
      done ;;
    mergedtrain) # issue 45: several runs' updates in one merged pass (4 adapters, 32 rows each) beside one adapter's
      # update of the same 128 rows, the merged pass with its earlier optimizer steps (an adapter switch each) and
      # the eager step on the torch.library ops (bench/lora_train.py), at trainscale's shape; GPU kernels and host calls
      part mergedtrain 300 python3 bench/lora_train.py --shape qwen2.5-0.5b --rank 8 --batch "${MERGED_BATCH:-128}" \
        --prompt 24 --response 128 --compile false --adapters 4 --profile --host-profile \
        --variants "${MERGED_VARIANTS:-lora@full:16384,lora_merged@full:16384,lora_merged_switching@full:16384,lora_ops@full:16384}" \
        --out "$OUT/lora_merged_train_gpu.json" ;;
    reference) part reference 240 python3 bench/reference_gpu.py --out "$OUT/reference_gpu.json" ;;
    ipcbench) # CUDA IPC between two processes on one GPU vs a same-process copy (bench/weight_sync_ipc.py)
      part ipcbench 240 python3 bench/weight_sync_ipc.py --out "$OUT/weight_sync_ipc.json"
      stamp "$OUT/weight_sync_ipc.json" weight_sync_ipc ;;
    pagedtests) part pagedtests 300 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_paged_attention_gpu.py tests/gpu/test_paged_kv_gpu.py tests/gpu/test_paged_kv_lora_gpu.py ;;
    loratests) # LORATESTS_EXTRA: more test ids in the same pytest run
      part loratests 300 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_lora_decode_gpu.py tests/gpu/test_lora_train_gpu.py \
        tests/gpu/test_adapter_load_gpu.py ${LORATESTS_EXTRA:-} ;;
    lora) # LoRA at 1.5B, rank 16 (bench/lora_gpu.py): weight sync per step of the adapter vs the full weights over
      # grpc loopback and ipc, decode tokens/s with 4 adapters in a batch vs 1 vs the base. LORA_PARTS picks parts;
      # the parts already in bench/results/lora_gpu.json are kept beside the new ones. LORA_KV=paged (or auto, the
      # default on CUDA since 235906e) decodes on the paged cache instead of the series' unpaged decoder, into
      # $OUT/lora_gpu_paged.json (with LORA_PARTS=decode).
      [ -f bench/results/lora_gpu.json ] && [ ! -f "$OUT/lora_gpu.json" ] && cp bench/results/lora_gpu.json "$OUT/"
      part lora 560 python3 bench/lora_gpu.py --parts "${LORA_PARTS:-sync,decode}" --kv-cache "${LORA_KV:-none}" \
        --out "$OUT/lora_gpu${LORA_KV:+_$LORA_KV}.json" ;;
    profile) # where a decode step's GPU time goes: LoRA engine vs none, paged vs none (bench/decode_profile.py)
      # PROFILE_STEM names the result file and its provenance stem (decode_profile_paged_1_5b_gpu: the paged part at
      # the 1.5B shape, PROFILE_ARGS="--paged-shape 1.5b --batch 128 --n 8 --prompt-len 32 --new-tokens 256")
      part profile 300 python3 bench/decode_profile.py --parts "${PROFILE_PARTS:-lora,paged}" ${PROFILE_ARGS:-} \
        --out "$OUT/${PROFILE_STEM:-decode_profile_gpu}.json"
      stamp "$OUT/${PROFILE_STEM:-decode_profile_gpu}.json" "${PROFILE_STEM:-decode_profile_gpu}" ;;
    manyruns) # issue 45: 4 LoRA runs (0.5B shape, random weights) at once on one mesh vs one after another; the mesh
      # in process (MANY_MESH=inprocess, the default) or as `meshrl mesh` processes (MANY_MESH=processes);
      # MANY_MERGE_WAIT: the mesh's actor.merge_wait_passes (default 0.5; two values in one call: two OUT folders)
      part manyrunsmodel 240 python3 examples/gpu/make_model.py --shape qwen2.5-0.5b   # no-op when already built
      part manyruns 420 python3 bench/many_runs.py --device cuda --runs "${MANY_RUNS:-4}" --steps "${MANY_STEPS:-4}" --rounds "${MANY_ROUNDS:-1}" \
        --max-tokens "${MANY_MAX_TOKENS:-128}" --kv-cache "${MANY_KV:-auto}" --mesh "${MANY_MESH:-inprocess}" \
        ${MANY_MERGE_WAIT:+--merge-wait-passes "$MANY_MERGE_WAIT"} \
        --threads "$OMP_NUM_THREADS" --mesh-log "$OUT/many_runs_logs" --out "$OUT/many_runs_gpu.json" ;;
    wsipc) part wsipc 240 python3 bench/weight_sync.py --transport ipc --device cuda:0 --repeats 10 \
             --out "$OUT/weight_sync.json" ;;
    meshrl) TORCH_LOGS="${TORCH_LOGS:-recompiles}" part meshrl 560 python3 bench/e2e_grpo.py run --device cuda --shape qwen2.5-0.5b --steps "$STEPS" \
              --warmup-steps "$WARMUP" --seed 1 --threads "$OMP_NUM_THREADS" --work-dir "$WORK" --out "$OUT/meshrl.json"
            stamp "$OUT/meshrl.json" vs_trl_gpu   # e2e_grpo.py combine carries this stamp into vs_trl_gpu.json
            # the services' own logs, for a run that failed
            (cd "$WORK" && tar czf "$OUT/meshrl-logs.tgz" meshrl-*/logs meshrl-*/runs/*/metrics.jsonl meshrl-*/timing 2>/dev/null) ;;
    spy)  # py-spy (from .whl-spy/) samples every meshrl service for SPY_SECONDS while a `meshrl` part runs
          # (start this part right before it): flat profiles of where the mesh's host time goes.
      if compgen -G ".whl-spy/*.whl" >/dev/null; then pipi /tmp/spy .whl-spy/*.whl; fi
      ( sleep "${SPY_DELAY:-75}"; mkdir -p "$OUT/spy"
        for pid in $(pgrep -f "bench.peers.mesh_timing|coordinator"); do
          role=$(tr '\0' '\n' < /proc/$pid/environ 2>/dev/null | sed -n 's/^MESHRL_BENCH_ROLE=//p')
          [ -n "$role" ] && /tmp/spy/bin/py-spy record --pid "$pid" --duration "${SPY_SECONDS:-20}" --rate "${SPY_RATE:-100}" \
            --format raw --nonblocking -o "$OUT/spy/$role-$pid.txt" > "$OUT/spy/$role-$pid.log" 2>&1 &
        done; wait ) &
      ;;
    asynctests) part asynctests 300 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_partial_rollouts_gpu.py ;;
    asyncbench)  # per-run JSONs travel as async-runs.tgz; async_gpu.json combines the runs of this call
      part asyncbench 580 python3 bench/async_rl.py run --device cuda --shape qwen2.5-0.5b \
        --workloads "${ASYNC_WORKLOADS:-fixed,longtail}" --modes "${ASYNC_MODES:-sync,k1,k2}" --steps "$STEPS" \
        --warmup-steps "$WARMUP" --threads "$OMP_NUM_THREADS" --work-dir "$WORK" --out-dir "$WORK/async"
      python3 bench/async_rl.py combine --out-dir "$WORK/async" --out "$OUT/async_gpu.json" \
        $([ -f "$OUT/trl.json" ] && echo --trl-fixed "$OUT/trl.json") \
        $([ -f "$OUT/trl_longtail.json" ] && echo --trl-longtail "$OUT/trl_longtail.json") > "$OUT/asynccombine.log" 2>&1
      (cd "$WORK" && tar czf "$OUT/async-runs.tgz" async meshrl-*/runs/*/metrics.jsonl 2>/dev/null) ;;
    splittests) part splittests 400 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_async_two_gpu.py ;;
    asyncsplit)  # the same runs with the rollout on its own GPU: the step approaches max(generate, train)
      if [ "$(nvidia-smi -L | wc -l)" -lt 2 ]; then echo "asyncsplit: needs 2 GPUs" | tee "$OUT/asyncsplit.log"; continue; fi
      part asyncsplit 580 python3 bench/async_rl.py run --device cuda --shape qwen2.5-0.5b --placement split \
        --weight-transport "${SPLIT_TRANSPORT:-nccl}" --workloads "${ASYNC_WORKLOADS:-fixed,longtail}" \
        --modes "${ASYNC_MODES:-sync,k1,k2}" --steps "$STEPS" --warmup-steps "$WARMUP" --threads "$OMP_NUM_THREADS" \
        --work-dir "$WORK" --out-dir "$WORK/asyncsplit"
      python3 bench/async_rl.py combine --out-dir "$WORK/asyncsplit" --out "$OUT/async_gpu_split.json" \
        > "$OUT/asyncsplitcombine.log" 2>&1
      (cd "$WORK" && tar czf "$OUT/asyncsplit-runs.tgz" asyncsplit 2>/dev/null) ;;
    trllong) PYTHONPATH="$PWD:/tmp/site-trl:/tmp/site" part trllong 560 python3 bench/peers/trl_grpo.py --device cuda \
               --shape qwen2.5-0.5b --steps "$STEPS" --warmup-steps "$WARMUP" --seed 1 --threads "$OMP_NUM_THREADS" \
               --lengths longtail --work-dir "$WORK" --out "$OUT/trl_longtail.json" ;;
    trl) PYTHONPATH="$PWD:/tmp/site-trl:/tmp/site" part trl 560 python3 bench/peers/trl_grpo.py --device cuda \
           --shape qwen2.5-0.5b --steps "$STEPS" --warmup-steps "$WARMUP" --seed 1 --threads "$OMP_NUM_THREADS" \
           --work-dir "$WORK" --out "$OUT/trl.json" ;;
    trl15)  # TRL on examples/gpu/grpo.yaml's work (#38: 1.5B, 32 x 8, 512 tokens), on the model folder upgpu uses
      part trl15model 240 python3 examples/gpu/make_model.py --shape qwen2.5-1.5b   # no-op when already built
      PYTHONPATH="$PWD:/tmp/site-trl:/tmp/site" part trl15 300 python3 bench/peers/trl_grpo.py --device cuda \
        --shape qwen2.5-1.5b --model-path examples/gpu/models/qwen2.5-1.5b --steps "${TRL_STEPS:-4}" \
        --warmup-steps "${TRL_WARMUP:-1}" --seed 1 --threads "$OMP_NUM_THREADS" --work-dir "$WORK" \
        --out "$OUT/trl_1_5b.json" ;;
    upgpu)  # `meshrl up` with the recipe alone (defaults) and with the tuned flags, one call (bench/up_gpu.py)
      part upgpumodel 240 python3 examples/gpu/make_model.py --shape "${UP_SHAPE:-qwen2.5-1.5b}"   # no-op when built
      part upgpu 560 python3 bench/up_gpu.py --recipe "${UP_RECIPE:-examples/gpu/grpo.yaml}" \
        --shape "${UP_SHAPE:-qwen2.5-1.5b}" --steps "${UP_STEPS:-8}" --warmup "${UP_WARMUP:-2}" \
        --order "${UP_ORDER:-defaults,tuned}" --timeout-per-run "${UP_RUN_TIMEOUT:-300}" --budget "${UP_BUDGET:-540}" \
        --work-dir "$WORK/up" --out "$OUT/up_gpu.json"
      stamp "$OUT/up_gpu.json" up_gpu
      (cd "$WORK/up" && tar czf "$OUT/up-logs.tgz" */meshrl-up.log */runs/logs */runs/*/metrics.jsonl \
        */runs/*/recipe.yaml 2>/dev/null) ;;
    bundle)  # the device tool brings back at most 8 files: the logs travel as one archive
      wait
      (cd "$OUT" && tar czf logs.tgz --remove-files $(ls -d *.log meshrl-logs.tgz up-logs.tgz multi-logs.tgz async-runs.tgz asyncsplit-runs.tgz spy 2>/dev/null)) ;;
    *) echo "gpu_session.sh: unknown part $what" >&2; exit 2 ;;
  esac
done
