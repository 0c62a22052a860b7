#!/usr/bin/env bash
# meshrl GRPO through the mesh vs TRL's GRPOTrainer on the same work; writes one JSON.
#
#   bench/compare.sh                                   # CPU: the arith demo model, 16 x 8, 80 steps, 3 rounds
#   ROUNDS=5 STEPS=40 bench/compare.sh                 # fewer steps, more rounds
#   EXTRA=1 bench/compare.sh                           # + per round: meshrl without timers, TRL on 2 threads
#   bench/compare.sh --device cuda --shape qwen2.5-0.5b  # GPU variant (random 0.5B bf16, 64 x 8, 256 tokens)
#
# Creates .venv (make install) and bench/.venv-trl (torch pinned first, then trl; no vLLM) when missing.
# Rounds alternate meshrl and TRL (the first side alternates too), so machine noise hits both alike;
# round i samples with seed i on both sides (the prompt order is the same in every run), so the
# run-to-run spread of the reward curves is the noise they are compared against. The JSON holds every
# run and the medians over runs.
set -euo pipefail
cd "$(dirname "$0")/.."

DEVICE=cpu
SHAPE=arith
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --shape) SHAPE="$2"; shift 2 ;;
    *) echo "compare.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
ROUNDS="${ROUNDS:-3}"
EXTRA="${EXTRA:-0}"
STEPS="${STEPS:-}"
OUT="${OUT:-bench/results/vs_trl_$([ "$DEVICE" = cuda ] && echo gpu || echo "$DEVICE").json}"
# torch for the TRL venv: the local CPU wheel; on a GPU machine pass the CUDA build the meshrl venv uses.
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
# TRL pinned to the release the recorded results used (its defaults move between releases).
TRL_SPEC="${TRL_SPEC:-trl==1.16.0}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false

if [ ! -x .venv/bin/python ]; then
  make install
fi
TRL_VENV=bench/.venv-trl
if [ ! -x "$TRL_VENV/bin/python" ] || ! "$TRL_VENV/bin/python" -c "import trl" 2>/dev/null; then
  python3 -m venv "$TRL_VENV"
  # torch first and pinned: an unpinned resolve would pull a CUDA build from PyPI.
  "$TRL_VENV/bin/pip" install -q "$TORCH_SPEC"
  "$TRL_VENV/bin/pip" install -q "$TRL_SPEC" "$TORCH_SPEC"
fi

WORK="${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/meshrl-compare.XXXXXX")}"
mkdir -p "$WORK"
steps_arg=()
[ -n "$STEPS" ] && steps_arg=(--steps "$STEPS")
common=(--device "$DEVICE" --shape "$SHAPE" --work-dir "$WORK" "${steps_arg[@]}")
mesh_runs=()
trl_runs=()
plain_runs=()
trl2_runs=()
order=""

# run_mesh NAME SEED [flags]; run_trl NAME SEED [flags]
run_mesh() {
  local name="$1" seed="$2"; shift 2
  PYTHONPATH=.:protos .venv/bin/python bench/e2e_grpo.py run "${common[@]}" --seed "$seed" "$@" \
    --out "$WORK/$name.json" > "$WORK/$name.log" 2>&1 || { tail -40 "$WORK/$name.log" >&2; exit 1; }
  tail -1 "$WORK/$name.log"
  order+="$name "
}

run_trl() {
  local name="$1" seed="$2"; shift 2
  PYTHONPATH=. "$TRL_VENV/bin/python" bench/peers/trl_grpo.py "${common[@]}" --seed "$seed" "$@" \
    --out "$WORK/$name.json" > "$WORK/$name.log" 2>&1 || { tail -40 "$WORK/$name.log" >&2; exit 1; }
  tail -1 "$WORK/$name.log"
  order+="$name "
}

mesh_round() { run_mesh "meshrl-$1" "$1"; mesh_runs+=("$WORK/meshrl-$1.json"); }
trl_round() { run_trl "trl-$1" "$1"; trl_runs+=("$WORK/trl-$1.json"); }

for ((i = 1; i <= ROUNDS; i++)); do
  echo "round $i/$ROUNDS ($(date +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg))"
  if (( i % 2 )); then mesh_round "$i"; trl_round "$i"; else trl_round "$i"; mesh_round "$i"; fi
  if [ "$EXTRA" = 1 ]; then
    run_mesh "meshrl-plain-$i" "$i" --no-instrument; plain_runs+=("$WORK/meshrl-plain-$i.json")
    run_trl "trl-2threads-$i" "$i" --threads 2; trl2_runs+=("$WORK/trl-2threads-$i.json")
  fi
done

extra_args=()
[ "$EXTRA" = 1 ] && extra_args=(--meshrl-plain "${plain_runs[@]}" --trl-threads2 "${trl2_runs[@]}")
PYTHONPATH=.:protos .venv/bin/python bench/e2e_grpo.py combine --meshrl "${mesh_runs[@]}" --trl "${trl_runs[@]}" \
  "${extra_args[@]}" --order "$order" --out "$OUT"
echo "runs and logs in $WORK"
