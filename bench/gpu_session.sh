#!/usr/bin/env bash
# The GPU benchmarks and tests, run on a GPU machine with torch + CUDA (the device image of docs: torch 2.11,
# transformers 5.17, CuPy); each named part writes its log and JSON under $OUT.
#
#   OUT=/tmp/gpu bench/gpu_session.sh versions gputests reference wsipc meshrl trl bundle
#   parts: versions gputests decodetests wstest meshtests multigpu decode mfu reference wsipc spy meshrl trl bundle
#   multi-GPU hosts: OUT=/tmp/gpu bench/gpu_session.sh versions meshtests wstest multigpu bundle
#
# Python packages the image lacks travel as wheels: .whl/ (meshrl's: pydantic, pydantic-settings, tenacity,
# redis, grpcio-health-checking/-reflection, isal, ...) goes to /tmp/site for every part; .whl-trl/ (trl,
# datasets, dill, multiprocess) to /tmp/site-trl for the TRL part only. Without them the image's own are used.
# STEPS (meshrl / trl GRPO steps, default 12), WARMUP (left out of the medians, default 3); LIMIT_<PART> (seconds).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/meshrl-gpu}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
STEPS="${STEPS:-12}"
WARMUP="${WARMUP:-3}"
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$1" "${@:2}"; }
if compgen -G ".whl/*.whl" >/dev/null; then pipi /tmp/site .whl/*.whl || exit 1; fi
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

for what in "$@"; do
  case "$what" in
    versions)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      python3 -c "import torch, transformers, grpc, google.protobuf as pb, pydantic; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'grpcio', grpc.__version__, 'protobuf', pb.__version__, 'pydantic', pydantic.__version__)"
      ;;
    gputests) part gputests 420 python3 -m pytest -q -x -p no:cacheprovider tests/gpu ;;
    decodetests) part decodetests 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_decode.py \
                   tests/gpu/test_fused_logprobs.py ;;
    decode) part decode 240 python3 bench/decode_step.py ${DECODE_VARIANTS:+--variants "$DECODE_VARIANTS"} \
              --out "$OUT/decode_step_gpu.json" ;;
    mfu) part mfu 560 python3 bench/trainer_mfu.py --sizes "${MFU_SIZES:-0.5b,1.5b}" \
           --variants "${MFU_VARIANTS:-plain,engine,engine_amp,engine_eager,engine_unfused}" --profile engine \
           --trace-dir "$WORK" --out "$OUT/trainer_mfu.json"
         gzip -c "$WORK"/trace_0.5b_engine.json > "$OUT/trace_0.5b_engine.json.gz" 2>/dev/null ;;
    meshtests) part meshtests 560 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/multiproc/test_trainer_mesh.py ;;
    multigpu)  # MULTI_PARTS (mfu,sync,grpo), MULTI_LAYOUTS (bench/multi_gpu.py's LAYOUTS names) split it over calls;
               # MULTI_GRPO_STEPS: the GRPO run's length (default 10)
      part multigpu 580 python3 bench/multi_gpu.py --parts "${MULTI_PARTS:-mfu,sync,grpo}" \
        ${MULTI_LAYOUTS:+--layouts "$MULTI_LAYOUTS"} ${MULTI_GRPO_STEPS:+--grpo-steps "$MULTI_GRPO_STEPS"} --work-dir "$WORK/multi" --out "$OUT/multi_gpu.json"
      (cd "$WORK/multi" && tar czf "$OUT/multi-logs.tgz" logs-* *.log grpo-runs/logs 2>/dev/null) ;;
    wstest) part wstest 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_weight_sync.py -s ;;
    reference) part reference 240 python3 bench/reference_gpu.py --out "$OUT/reference_gpu.json" ;;
    wsipc) part wsipc 240 python3 bench/weight_sync.py --transport ipc --device cuda:0 --repeats 10 \
             --out "$OUT/weight_sync.json" ;;
    meshrl) TORCH_LOGS="${TORCH_LOGS:-recompiles}" part meshrl 560 python3 bench/e2e_grpo.py run --device cuda --shape qwen2.5-0.5b --steps "$STEPS" \
              --warmup-steps "$WARMUP" --seed 1 --threads "$OMP_NUM_THREADS" --work-dir "$WORK" --out "$OUT/meshrl.json"
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
    trl) PYTHONPATH="$PWD:/tmp/site-trl:/tmp/site" part trl 560 python3 bench/peers/trl_grpo.py --device cuda \
           --shape qwen2.5-0.5b --steps "$STEPS" --warmup-steps "$WARMUP" --seed 1 --threads "$OMP_NUM_THREADS" \
           --work-dir "$WORK" --out "$OUT/trl.json" ;;
    bundle)  # the device tool brings back at most 8 files: the logs travel as one archive
      wait
      (cd "$OUT" && tar czf logs.tgz --remove-files $(ls -d *.log meshrl-logs.tgz multi-logs.tgz spy 2>/dev/null)) ;;
    *) echo "gpu_session.sh: unknown part $what" >&2; exit 2 ;;
  esac
done
