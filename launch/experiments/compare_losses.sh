#!/usr/bin/env bash
# DEL against MLE, NTL, DIST2, MixCE and EMO on the tiny CPU model: every kind trained on the
# same data for the same steps with 3 seeds, each run evaluated with del-eval (teacher-forced
# numeric metrics on the held-out shards, greedy answers to held-out problems), then
# docs/results.md and its plots (docs/results/*.png) written from nothing.
#
#   bash launch/experiments/compare_losses.sh          # about 35 minutes on 2 CPU cores
#   bash launch/experiments/compare_losses.sh --ci     # 2 kinds, 1 seed, 20 steps, into runs/
#
# Runs go to $ROOT/runs/KIND-SEED (default runs/compare); a finished run is not trained again
# and an evaluated one not evaluated again, so an interrupted comparison continues where it
# stopped.
set -euo pipefail
cd "$(dirname "$0")/../.."

kinds=(mle ntl_was dist2 mixce emo del)
seeds=(1 2 3)
steps=${STEPS:-200}
root=${ROOT:-runs/compare}
documents=8000
report=docs/results.md
plots=docs/results
if [ "${1:-}" = "--ci" ]; then
  kinds=(mle del)
  seeds=(1)
  steps=20
  root=${ROOT:-runs/compare-ci}
  documents=1500
  report=$root/results.md
  plots=$root/plots
fi
bin=.venv/bin
started=$(date +%s)

bash launch/setup_env.sh
bash launch/tiny_data.sh "$root/data" "$documents"
data=$root/data
for kind in "${kinds[@]}"; do
  for seed in "${seeds[@]}"; do
    run=$root/runs/$kind-$seed
    checkpoint=$run/checkpoints/step-$(printf %07d "$steps")
    if [ -f "$run/results.json" ]; then continue; fi
    if [ ! -f "$checkpoint/meta.json" ]; then
      rm -rf "$run" # a run of ours cut short: start it again
      mkdir -p "$run"
      echo "== $kind, seed $seed"
      # --standalone: a free port of its own, so runs on one machine never collide
      OMP_NUM_THREADS=1 $bin/torchrun --standalone --nproc_per_node=2 -m del_megatron.cli.train \
        --config configs/tiny_cpu.yaml "loss.kind=$kind" "train.seed=$seed" \
        "train.steps=$steps" "data.tokenizer=$data/tokenizer.model" \
        "data.sources=[{manifest: $data/shards/train/manifest.json}]" "eval.sources=[]" \
        "train.log_interval=$steps" logging.wandb=disabled logging.progress_bar=false \
        "output_dir=$run" >"$run/train.log" 2>&1 || { tail -20 "$run/train.log"; exit 1; }
    fi
    $bin/del-eval "$checkpoint" \
      --heldout "$data/shards/heldout/manifest.json" --seq-len 128 --batch-size 8 \
      --gsm8k "$data/corpus/heldout.jsonl" --shots 0 --template $'{question}\nAnswer:' \
      --limit 100 --max-new-tokens 12 --device cpu --quiet --out "$run" >/dev/null
  done
done

runs=()
for kind in "${kinds[@]}"; do
  for seed in "${seeds[@]}"; do runs+=("$root/runs/$kind-$seed"); done
done
$bin/del-eval compare "${runs[@]}" --group-by parent-name --out "$plots" >/dev/null
minutes=$((($(date +%s) - started + 59) / 60))
$bin/python -m experiments.results_page "$plots/comparison.md" "$report" \
  --plots "$plots" --minutes "$minutes" --steps "$steps" --seeds "${#seeds[@]}" \
  --notes launch/experiments/compare_losses.notes.md \
  --summary launch/experiments/results_summary.md \
  --command "bash launch/experiments/compare_losses.sh ${1:-}"
echo "written: $report (${minutes} min)"
