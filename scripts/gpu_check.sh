#!/usr/bin/env bash
# The checks a lent GPU machine runs (issue #16), as one script: that machine has no network and a python3
# with a CUDA torch, so the five distributions are installed --no-deps into a scratch folder. Then:
#   the tests marked `gpu`; `hp demo` on nccl with the model on the GPU (one GPU: one rank, which recovers
#   from an exception in process; replicated and ZeRO-1: FSDP2 needs a torch with reset_iter_state);
#   scripts/gpu_probe.py (where the nccl abort and the GPU-to-shared-memory copy spend their time);
#   `hp bench hydrate --device cuda`; and, on that machine's 16 cores, `hp bench hydrate` on the CPU and
#   `hp demo --fsdp` / `--hsdp 2` over gloo with one rank per core.
# Every step's log goes to $OUT/gpu.log and each JSON result line to $OUT/gpu.jsonl, as {"step": ..., ...}.
#   usage: OUT=/some/dir [ONLY="tests nccl probe hydrate cpu16"] bash scripts/gpu_check.sh   (PY=python3 by default)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
PY=${PY:-python3}
SITE=${HP_GPU_SITE:-/tmp/hp-gpu-site}
LOG=$OUT/gpu.log
JSONL=$OUT/gpu.jsonl
: >"$LOG"
: >"$JSONL"
export PYTHONUNBUFFERED=1 HP_DATA_CACHE_DIR=${HP_DATA_CACHE_DIR:-/tmp/hp-gpu-cache}
mkdir -p "$HP_DATA_CACHE_DIR"

say() { echo "$*" | tee -a "$LOG"; }

# step NAME SECONDS CMD...: run it, keep its output in the log, its last line in gpu.jsonl when it is JSON
step() {
  local name=$1 limit=$2 start rc last
  shift 2
  say "== $name: $*"
  start=$(date +%s.%N)
  timeout "$limit" "$@" >"$OUT/$name.out" 2>&1
  rc=$?
  cat "$OUT/$name.out" >>"$LOG"
  last=$(tail -n 1 "$OUT/$name.out")
  if [[ $last == "{"* ]]; then
    "$PY" -c 'import json,sys; r=json.loads(sys.argv[2]); r.pop("final_state", None); print(json.dumps({"step": sys.argv[1], "rc": int(sys.argv[3]), **r}))' \
      "$name" "$last" "$rc" >>"$JSONL"
  else
    echo "{\"step\": \"$name\", \"rc\": $rc}" >>"$JSONL"
  fi
  rm -f "$OUT/$name.out"
  say "-- $name: rc=$rc in $(awk "BEGIN{printf \"%.1f\", $(date +%s.%N) - $start}") s"
}

say "== machine"
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
 "$PY" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
          "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)') >>"$LOG" 2>&1
# hp's dependencies that the lent machine's python lacks come as wheels in wheels/ (git-ignored; carry it:
#   pip download "setproctitle>=1.3" --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d wheels)
if compgen -G "wheels/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-deps --no-index --target "$SITE" wheels/*.whl >>"$LOG" 2>&1 || say "wheels/ failed to install"
fi
"$PY" -m pip install -q --no-deps --no-build-isolation --no-index --target "$SITE" packages/hp-core \
  packages/hp-checkpointless packages/hp-elastic packages/hp-tiered-ckpt packages/hp-chaos >>"$LOG" 2>&1 || {
  say "install failed"
  exit 1
}
export PYTHONPATH=$SITE
HP=("$PY" -m hp.core.cli)

want() { [[ -z ${ONLY:-} || " $ONLY " == *" $1 "* ]]; }  # ONLY="probe nccl": just those groups

if want tests; then
  step gpu_tests 240 "$PY" -m pytest -m gpu -q -p no:xdist packages/hp-checkpointless/tests/test_devices_state.py \
    packages/hp-chaos/tests/test_bench_hydrate.py
fi
if want nccl; then  # one GPU: one rank, recovering in process; 3 faults in backward for the spread
  for i in 1 2 3; do
    step "demo_nccl_$i" 240 "${HP[@]}" demo --transport nccl --nproc 1 --spares 0 --fault exception \
      --phase backward --model-size 25m --steps 16 --json
  done
  step demo_nccl_allreduce 240 "${HP[@]}" demo --transport nccl --nproc 1 --spares 0 --fault exception \
    --phase allreduce --model-size 25m --steps 16 --json
  step demo_nccl_zero 240 "${HP[@]}" demo --transport nccl --nproc 1 --spares 0 --fault exception \
    --phase backward --model-size 25m --steps 16 --zero --json
fi
if want probe; then
  step probe 240 "$PY" scripts/gpu_probe.py
fi
if want hydrate; then
  step hydrate_cuda 240 "${HP[@]}" bench hydrate --device cuda --json
  step hydrate_cpu16 240 "${HP[@]}" bench hydrate --json
fi
if want cpu16; then  # FSDP2/HSDP over gloo, one rank per core (FSDP2 recovery needs torch's reset_iter_state)
  step demo_fsdp_cpu16 300 "${HP[@]}" demo --fsdp --json
  step demo_hsdp_cpu16 300 "${HP[@]}" demo --hsdp 2 --json
fi
say "== done"
