#!/usr/bin/env bash
# One script that proves a GPU run end to end, on whatever GPUs the machine has (1: TP 1;
# 2 or more: TP 2 as well), in about 8 minutes on one H100/H200, installing nothing from the
# network. Run from anywhere; it works in the repository root.
#
#   bash bench/gpu_acceptance.sh [--dry-run] [--cpu-smoke] [--only NAME,...]
#
# The checks: the tiny config (configs/tiny_cpu.yaml) for 30 steps in bf16 with the unfused
# and the fused loss; a run stopped by SIGUSR1 (exit 75) and resumed by the same command, equal
# to the straight run; init.hf from a tiny random Qwen-2 with tied embeddings, del-convert
# back, transformers' logits of the export against the checkpoint's; del-eval on a checkpoint
# and its export; then the benchmarks (hook vs megatron CE, fused vs unfused output layer +
# loss at V=152064, a training step of a 4-layer Llama-2-7B-width model: tokens/s, TFLOP/s,
# MFU, DEL over MLE). Every check runs the user's commands: launch/torchrun.sh (del-train),
# del-convert, del-eval, bench/*.py; bench/gpu_acceptance.py only builds inputs and reads
# what they wrote. Prints one table (a pass/fail/skipped row a check, with its figures) and,
# when OUT is set, writes $OUT/gpu_acceptance.json and $OUT/gpu_acceptance.log.
#
# Without a CUDA GPU it says "no GPU: N checks skipped" and exits 0. --dry-run lists every
# check with the commands it would run. --cpu-smoke runs what can run on the CPU at tiny
# sizes (fp32, a few steps) to prove the wiring, not for figures. --only runs the named
# checks (and those they need). Exit status: 1 if a check failed, else 0; what the machine
# lacks (Transformer Engine, a second GPU) is a skipped row, never a failure.
#
# Packages: megatron-core, DeepSpeed, pydantic and webdataset, when missing, are installed
# from .whl/ (bench/fetch_gpu_wheels.sh fetches them where PyPI is reachable) into
# $DEL_SITE (default /tmp/site); the project runs from this checkout via PYTHONPATH.
# Environment: OUT (results), DEL_PYTHON (interpreter; default .venv/bin/python if present,
# else python3), DEL_SITE.
# shellcheck disable=SC2329 # the check functions are called by name: check_<name>
set -euo pipefail
cd "$(dirname "$0")/.."

# The fused-loss benchmark: bf16, 16384 tokens, chunks 1024-8192, every path but torch.compile
# (minutes of compilation on a GPU), memory as ZeRO 2/3 hold it. --cpu-smoke appends FUSED_BENCH_SMOKE to it (argparse: the
# last value of a flag wins).
FUSED_BENCH=(bench/loss_fused.py --device cuda --dtype bf16 --tp 1 --tokens 16384 --chunk 1024
             --chunks "2048,4096,8192" --paths "megatron,hook,fused,fused-recompute"
             --memory fresh --repeats 3)
FUSED_BENCH_SMOKE=(--device cpu --dtype fp32 --vocab 4096 --hidden 256 --tokens 256 --chunk 64
                   --repeats 1 --chunks 128)

# Every check, in the order they run. Each name has a check_<name> function below.
CHECKS=(env transformer-engine data train-tp1 train-fused-tp1 stop-resume-tp1 train-tp2
        train-fused-tp2 stop-resume-tp2 init-hf del-eval bench-hook-ce bench-hook-ce-fp32
        bench-fused bench-train-step)

usage() { sed -n '2,29p' "$0" | sed 's/^# \{0,1\}//'; }
dry_run=0
mode=gpu
only=""
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) dry_run=1; shift ;;
    --cpu-smoke) mode=cpu-smoke; shift ;;
    --only) only=${2:-}; shift 2 ;;
    --only=*) only=${1#*=}; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu_acceptance.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

# ---- which checks --------------------------------------------------------------------------
# What a check needs from an earlier one (its data, the straight run it is compared with).
needs() {
  case $1 in
    train-* | init-hf) echo "env data" ;;
    stop-resume-tp1) echo "env data train-tp1" ;;
    stop-resume-tp2) echo "env data train-tp2" ;;
    del-eval) echo "env data train-tp1" ;;
    *) echo "env" ;;
  esac
}
declare -A selected=()
if [ -z "$only" ]; then
  for name in "${CHECKS[@]}"; do selected[$name]=1; done
else
  IFS=, read -r -a wanted <<< "$only"
  for name in "${wanted[@]}"; do
    if [[ ! " ${CHECKS[*]} " == *" $name "* ]]; then
      echo "gpu_acceptance.sh: unknown check '$name'; the checks: ${CHECKS[*]}" >&2
      exit 2
    fi
    selected[$name]=1
    for need in $(needs "$name"); do selected[$need]=1; done
  done
fi
plan=()
for name in "${CHECKS[@]}"; do
  if [ -n "${selected[$name]:-}" ]; then plan+=("$name"); fi
done

# ---- the machine ---------------------------------------------------------------------------
if [ -n "${DEL_PYTHON:-}" ]; then
  PY=$DEL_PYTHON
elif [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
else
  PY=python3
fi
export DEL_PYTHON=$PY # launch/torchrun.sh and launch/tiny_data.sh run the project with it
HELPER=bench/gpu_acceptance.py

gpus=0
if [ "$mode" = gpu ]; then
  gpus=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
  if [ "$gpus" -gt 0 ]; then # the GPUs torch can use (a driver without a CUDA torch: none)
    gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' \
      2>/dev/null || echo 0)
  fi
  if [ "$gpus" = 0 ] && [ "$dry_run" = 0 ]; then
    echo "no GPU: ${#plan[@]} checks skipped (--cpu-smoke runs them on the CPU at tiny sizes)"
    exit 0
  fi
fi

if [ "$mode" = gpu ]; then
  DEVICE=cuda STEPS=30 STOP_AT=10 INIT_STEPS=10 DOCS=1500
  # bf16 tolerances. Step 1 of the fused and the unfused loss: the same weights and batch,
  # bf16 output-layer products summed in another order. A GPU run is not bit-reproducible
  # (atomic adds in backward), so a resumed run may drift from the straight one by a few
  # bf16 ulps a step: 0.02 in a weight is about 7 Adam steps at the tiny config's lr 3e-3.
  # del-eval of a checkpoint and its export: mean loss and digit entropy within 2e-2; digit
  # accuracy and number errors hang on argmax near-ties that bf16 flips, so are not judged.
  FUSED_TOL=1e-2 WEIGHTS_TOL=2e-2 LOSS_TOL=1e-2 LOGITS_TOL=5e-2 EVAL_TOL=2e-2
else
  DEVICE=cpu STEPS=12 STOP_AT=4 INIT_STEPS=3 DOCS=1500
  # float32 on the CPU: resume is bit-exact (tests/training assert it); the two model
  # implementations (megatron-core, transformers) agree to float32 rounding (.ci/run: every
  # del-eval metric within 1e-4)
  FUSED_TOL=1e-5 WEIGHTS_TOL=0 LOSS_TOL=0 LOGITS_TOL=1e-4 EVAL_TOL=1e-4
fi

# Seconds each check may take; the whole script aims at 8 minutes on one H200. The first
# training run there JIT-builds DeepSpeed's fused AdamW (a minute or so, cached after); on
# CPU DeepSpeed may build its shared-memory op first (minutes on two busy cores): 3x there.
limit_of() {
  local seconds
  case $1 in
    env | transformer-engine) seconds=120 ;;
    data) seconds=180 ;;
    train-*) seconds=240 ;;
    stop-resume-*) seconds=360 ;;
    init-hf | del-eval) seconds=300 ;;
    bench-fused) seconds=420 ;;
    *) seconds=300 ;;
  esac
  if [ "$mode" = cpu-smoke ]; then seconds=$((3 * seconds)); fi
  echo "$seconds"
}

if [ "$dry_run" = 1 ]; then
  WORK=${TMPDIR:-/tmp}/gpu-acceptance.XXXXXX # made by mktemp when the checks run
else
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-acceptance.XXXXXX")
fi
DATA=$WORK/data
mkdir_work() { mkdir -p "$WORK/logs" "$WORK/notes"; }

# ---- running a command of a check ----------------------------------------------------------
deadline=0
dry() { [ "$dry_run" = 1 ]; }
# Run a command of the current check, stopped at the check's deadline (timeout: 124), or,
# under --dry-run, print it.
x() {
  if dry; then
    local arg line="   "
    for arg in "$@"; do # shell-quoted only where needed, so that the listing stays readable
      if [[ $arg =~ ^[A-Za-z0-9_./=:,+@%-]+$ ]]; then
        line+=" $arg"
      else
        line+=" '${arg//\'/\'\\\'\'}'"
      fi
    done
    echo "$line"
    return 0
  fi
  local left=$((deadline - $(date +%s)))
  if [ "$left" -le 0 ]; then
    echo "gpu_acceptance.sh: the check ran out of time before: $*" >&2
    return 124
  fi
  # launch/torchrun.sh turns timeout's SIGTERM into a checkpoint and exit; --kill-after
  # bounds that
  timeout --kill-after=30 "$left" "$@"
}
say() { if dry; then echo "    # $*"; fi; }

notes_of() { echo "$WORK/notes/$1.json"; }

# The tiny config on this machine's device, its data, no wandb, no progress bar.
tiny() { # OUTPUT_DIR [override ...]
  local dir=$1
  shift
  printf '%s\n' configs/tiny_cpu.yaml "train.device=$DEVICE" "train.steps=$STEPS" \
    train.log_interval=10 "eval.max_batches=2" logging.wandb=disabled logging.progress_bar=false \
    "data.sources=[{manifest: $DATA/shards/train/manifest.json}]" "output_dir=$dir" "$@"
}
with_data() { # the run's tokenizer and held-out shards (init.hf brings its own tokenizer)
  printf '%s\n' "data.tokenizer=$DATA/tokenizer.model" \
    "eval.sources=[{manifest: $DATA/shards/heldout/manifest.json}]"
}
tp_of() { echo "${1##*-tp}"; }

# ---- the checks ----------------------------------------------------------------------------
check_env() {
  x "$PY" "$HELPER" env --mode "$mode" --notes "$(notes_of env)"
}

check_transformer_engine() {
  x "$PY" "$HELPER" transformer-engine --notes "$(notes_of transformer-engine)"
}

check_data() { # launch/quickstart.sh's corpus, tokenizer and shards, smaller
  x bash launch/tiny_data.sh "$DATA" "$DOCS"
}

train_check() { # NAME: the tiny config, straight to the end; fused: loss.fused_output=true
  local name=$1 tp fused=false reference=()
  tp=$(tp_of "$name")
  if [[ $name == train-fused-* ]]; then
    fused=true
    reference=(--reference "$WORK/train-tp$tp" --tol "$FUSED_TOL")
  fi
  local args=()
  mapfile -t args < <(tiny "$WORK/$name" "parallel.tensor_parallel=$tp" \
    "loss.fused_output=$fused"; with_data)
  x bash launch/torchrun.sh --nproc-per-node "$tp" "${args[@]}"
  if [ "$fused" = true ] && ! dry && [ ! -f "$WORK/train-tp$tp/metrics.jsonl" ]; then
    reference=() # the unfused run was not selected (--only) or failed: nothing to compare
  fi
  x "$PY" "$HELPER" train-figures "$WORK/$name" --steps "$STEPS" "${reference[@]}" \
    --notes "$(notes_of "$name")"
}
check_train_tp1() { train_check train-tp1; }
check_train_fused_tp1() { train_check train-fused-tp1; }
check_train_tp2() { train_check train-tp2; }
check_train_fused_tp2() { train_check train-fused-tp2; }

last_step() { # the step of metrics.jsonl's last line (0 before the first)
  local step
  step=$(tail -n 1 "$1" 2>/dev/null | sed -n 's/^{"step": \([0-9][0-9]*\),.*/\1/p')
  echo "${step:-0}"
}

stop_resume_check() { # NAME: SIGUSR1 once step >= STOP_AT, exit 75, resume, compare
  local name=$1 tp dir
  tp=$(tp_of "$name")
  dir=$WORK/$name
  local args=()
  mapfile -t args < <(tiny "$dir" "parallel.tensor_parallel=$tp"; with_data)
  local command=(bash launch/torchrun.sh --nproc-per-node "$tp" "${args[@]}")
  if dry; then
    x "${command[@]}"
    say "SIGUSR1 to it once $dir/metrics.jsonl reaches step $STOP_AT; it must exit 75"
    x "${command[@]}"
    say "the same command again: launch/torchrun.sh resumes the same run (--resume same)"
    x "$PY" "$HELPER" compare-runs "$WORK/train-tp$tp" "$dir" --steps "$STEPS" \
      --stopped-at STEP --weights-tol "$WEIGHTS_TOL" --loss-tol "$LOSS_TOL" \
      --notes "$(notes_of "$name")"
    return 0
  fi
  # Not under `timeout`: it would die of the SIGUSR1 meant for launch/torchrun.sh. The loop
  # keeps the deadline itself.
  "${command[@]}" &
  local pid=$! sent=0 status=0
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
      echo "gpu_acceptance.sh: the stopped run ran out of time" >&2
      kill -TERM "$pid" 2>/dev/null || true
      wait "$pid" || true
      return 124
    fi
    if [ "$sent" = 0 ] && [ "$(last_step "$dir/metrics.jsonl")" -ge "$STOP_AT" ]; then
      echo "gpu_acceptance.sh: SIGUSR1 at step $(last_step "$dir/metrics.jsonl")"
      kill -USR1 "$pid"
      sent=1
    fi
    sleep 0.05
  done
  wait "$pid" || status=$?
  if [ "$status" != 75 ]; then
    local why="exit $status"
    [ "$sent" = 1 ] && [ "$status" = 0 ] && why="exit 0: it finished before the stop took effect"
    echo "gpu_acceptance.sh: the stopped run: $why, expected 75 (stopped)" >&2
    return 1
  fi
  local newest stopped_at
  newest=$(find "$dir/checkpoints" -maxdepth 1 -name 'step-*' | sort | tail -n 1)
  stopped_at=$((10#${newest##*step-}))
  echo "gpu_acceptance.sh: stopped with a checkpoint of step $stopped_at; resuming"
  x "${command[@]}"
  x "$PY" "$HELPER" compare-runs "$WORK/train-tp$tp" "$dir" --steps "$STEPS" \
    --stopped-at "$stopped_at" --weights-tol "$WEIGHTS_TOL" --loss-tol "$LOSS_TOL" \
    --notes "$(notes_of "$name")"
}
check_stop_resume_tp1() { stop_resume_check stop-resume-tp1; }
check_stop_resume_tp2() { stop_resume_check stop-resume-tp2; }

check_init_hf() { # tiny random tied Qwen-2 -> init.hf -> del-convert -> logits vs checkpoint
  local hf=$WORK/qwen2 run=$WORK/init-hf export=$WORK/init-hf-export checkpoint
  checkpoint=$run/checkpoints/step-$(printf '%07d' "$INIT_STEPS")
  x "$PY" "$HELPER" tiny-qwen2 "$hf" --tokenizer "$DATA/tokenizer.model"
  local args=()
  mapfile -t args < <(tiny "$run" parallel.tensor_parallel=1 "train.steps=$INIT_STEPS" \
    data.tokenizer=null "init.hf=$hf" model.family=qwen2 model.qkv_bias=true \
    model.tie_word_embeddings=true "eval.sources=[]")
  x bash launch/torchrun.sh --nproc-per-node 1 "${args[@]}"
  x "$PY" -m del_megatron.cli.convert megatron-to-hf --checkpoint "$checkpoint" --out "$export"
  x "$PY" "$HELPER" logits "$checkpoint" "$export" --device "$DEVICE" --tol "$LOGITS_TOL" \
    --notes "$(notes_of init-hf)"
}

check_del_eval() { # .ci/run's check on this device: a checkpoint and its export, one metric set
  local checkpoint export=$WORK/eval-export
  checkpoint=$WORK/train-tp1/checkpoints/step-$(printf '%07d' "$STEPS")
  x "$PY" -m del_megatron.cli.convert megatron-to-hf --checkpoint "$checkpoint" --out "$export"
  local model
  for model in "$checkpoint" "$export"; do
    local out=$WORK/eval-checkpoint
    [ "$model" = "$export" ] && out=$WORK/eval-hf
    x "$PY" -m del_megatron.cli.eval "$model" --heldout "$DATA/shards/heldout/manifest.json" \
      --seq-len 128 --max-batches 10 --device "$DEVICE" --quiet --out "$out"
  done
  local agree=() # every metric within float32 rounding: on the CPU only (see EVAL_TOL)
  if [ "$mode" = cpu-smoke ]; then agree=(--agree-within "$EVAL_TOL"); fi
  x "$PY" -m del_megatron.cli.eval compare "$WORK/eval-checkpoint" "$WORK/eval-hf" \
    "${agree[@]}" --out "$WORK/eval-compare"
  x "$PY" "$HELPER" eval-figures "$WORK/eval-checkpoint" "$WORK/eval-hf" --tol "$EVAL_TOL" \
    --notes "$(notes_of del-eval)"
}

bench() { # NAME KIND COMMAND...: a benchmark, its figures read from its output
  local name=$1 kind=$2
  shift 2
  if dry; then
    x "$@"
    x "$PY" "$HELPER" bench-figures "$kind" "$WORK/logs/$name.out" --notes "$(notes_of "$name")"
    return 0
  fi
  x "$@" | tee "$WORK/logs/$name.out"
  x "$PY" "$HELPER" bench-figures "$kind" "$WORK/logs/$name.out" --notes "$(notes_of "$name")"
}
# On the CPU the benchmarks' peak memory comes from the process's RSS: their logits must be
# tens of MiB to register (4 MiB read as 0 and bench/loss_tp.py divided by it).
check_bench_hook_ce() {
  if [ "$mode" = gpu ]; then
    bench bench-hook-ce hook-ce "$PY" bench/loss_tp.py --device cuda --dtype bf16 \
      --vocab 152064 --tokens 16384 --repeats 10
  else
    bench bench-hook-ce hook-ce "$PY" bench/loss_tp.py --device cpu --dtype bf16 \
      --vocab 8192 --tokens 2048 --repeats 1
  fi
}
check_bench_hook_ce_fp32() {
  if [ "$mode" = gpu ]; then
    bench bench-hook-ce-fp32 hook-ce "$PY" bench/loss_tp.py --device cuda --dtype fp32 \
      --vocab 152064 --tokens 16384 --repeats 10
  else
    bench bench-hook-ce-fp32 hook-ce "$PY" bench/loss_tp.py --device cpu --dtype fp32 \
      --vocab 8192 --tokens 2048 --repeats 1
  fi
}
check_bench_fused() {
  if [ "$mode" = gpu ]; then
    bench bench-fused fused "$PY" "${FUSED_BENCH[@]}"
  else
    bench bench-fused fused "$PY" "${FUSED_BENCH[@]}" "${FUSED_BENCH_SMOKE[@]}"
  fi
}
check_bench_train_step() { # the trainer's own train_step, DEL and MLE on one engine
  if [ "$mode" = gpu ]; then
    bench bench-train-step train-step "$PY" bench/train_step.py --gpu-7b --steps 6
  else # the tiny CPU model at TP 2: two processes
    bench bench-train-step train-step "$PY" -m torch.distributed.run --standalone \
      --nproc-per-node=2 bench/train_step.py --steps 1
  fi
}

# Why a check does not run here (nothing: it runs). The CPU smoke runs TP 2 on two processes.
reason_to_skip() {
  case $1 in
    *-tp2)
      if [ "$mode" = gpu ] && [ "$gpus" -lt 2 ]; then
        echo "needs 2 GPUs (this machine has $gpus)"
      fi
      ;;
    transformer-engine)
      if [ "$mode" = cpu-smoke ]; then echo "CPU smoke: Transformer Engine is for GPUs"; fi
      ;;
  esac
}

# ---- --dry-run -----------------------------------------------------------------------------
if dry; then
  echo "gpu_acceptance.sh --dry-run: mode $mode, ${#plan[@]} checks, work directory $WORK"
  for name in "${plan[@]}"; do
    echo "$name (time limit $(limit_of "$name") s)$(
      [[ $name == *-tp2 ]] && [ "$mode" = gpu ] && echo ": with 2 or more GPUs")"
    if [ "$name" = transformer-engine ] && [ "$mode" = cpu-smoke ]; then
      echo "    # skipped: $(reason_to_skip "$name")"
    else
      "check_${name//-/_}"
    fi
  done
  exit 0
fi

# ---- the run -------------------------------------------------------------------------------
# What the image lacks, from the wheels that travelled with the checkout in .whl/.
missing=$("$PY" -c 'import importlib.util as u
print(" ".join(m for m in ("megatron", "deepspeed", "pydantic", "webdataset") if u.find_spec(m) is None))')
if [ -n "$missing" ]; then
  wheels=(.whl/*.whl)
  if [ -e "${wheels[0]}" ]; then
    site=${DEL_SITE:-/tmp/site}
    echo "installing .whl/ into $site (missing: $missing)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "${wheels[@]}"
    # bin/: ninja, which torch's extension builder runs for DeepSpeed's JIT-built ops
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
  else
    echo "missing: $missing, and no .whl/ (bench/fetch_gpu_wheels.sh): the env check will fail"
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export PYTHONWARNINGS=ignore::UserWarning,ignore::FutureWarning,ignore::DeprecationWarning
mkdir_work
results=$WORK/results.jsonl
log=$WORK/gpu_acceptance.log
started=$(date +%s)
echo "gpu_acceptance.sh: mode $mode, $gpus GPU(s), ${#plan[@]} checks; work directory $WORK"
[ "$mode" = gpu ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

env_failed=0
index=0
for name in "${plan[@]}"; do
  index=$((index + 1))
  part=$WORK/logs/$name.log
  reason=$(reason_to_skip "$name")
  if [ -z "$reason" ] && [ "$env_failed" = 1 ]; then reason="the environment check failed"; fi
  if [ -n "$reason" ]; then
    "$PY" "$HELPER" record "$results" --name "$name" --skipped "$reason"
    printf '[%2d/%d] %-20s skipped: %s\n' "$index" "${#plan[@]}" "$name" "$reason"
    continue
  fi
  printf '[%2d/%d] %-20s ' "$index" "${#plan[@]}" "$name"
  deadline=$(($(date +%s) + $(limit_of "$name")))
  begin=$(date +%s%N)
  status=0
  # A background subshell: `set -e` holds inside it (it would not in `check || status=$?`)
  ( "check_${name//-/_}" ) > "$part" 2>&1 &
  wait "$!" || status=$?
  seconds=$(awk -v a="$begin" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
  # the row: the exit status, and the verdict the check's notes give (e.g. skipped: the
  # transformer-engine check when it is not installed)
  "$PY" "$HELPER" record "$results" --name "$name" --rc "$status" --seconds "$seconds" \
    --notes "$(notes_of "$name")" --log "$part"
  verdict=$(tail -n 1 "$results" | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["status"])')
  echo "$verdict (${seconds} s)"
  if [ "$verdict" = fail ]; then
    tail -n 8 "$part" | sed 's/^/      | /'
    [ "$name" = env ] && env_failed=1
  fi
  { echo "===== $name: $verdict, exit $status, ${seconds} s"; cat "$part"; } >> "$log"
done

wall=$(($(date +%s) - started))
meta=$(printf '{"mode": "%s", "gpus": %d, "wall_s": %d, "work": "%s"}' "$mode" "$gpus" "$wall" "$WORK")
echo
table_status=0
json_args=()
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  json_args=(--json "$OUT/gpu_acceptance.json")
  cp "$log" "$OUT/gpu_acceptance.log"
fi
"$PY" "$HELPER" table "$results" --meta "$meta" "${json_args[@]}" || table_status=$?
echo "wall time ${wall} s; logs: $log${OUT:+; results: $OUT/gpu_acceptance.json}"
exit "$table_status"
