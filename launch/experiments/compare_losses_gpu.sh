#!/usr/bin/env bash
# The loss comparison at real scale, for a GPU node: Qwen2.5-1.5B (the paper's headline
# model, configs/qwen2.5_1.5b.yaml) continued with each loss kind from the same checkpoint on
# the same shards, then evaluated on GSM8K test (greedy, 4 shots, math-verify), on the
# held-out shards, and on the numeric task suite of launch/experiments/numeric_tasks.sh
# (data_tools/tasks.py: per task digit accuracy, exact match, digit entropy against the true
# entropy, ECE), whose report (each kind against MLE, paired by seed) is written as on CPU.
# Not run by CI; no GPU was lent when it was written, so it is untried.
#
#   KINDS="mle del dist2" SEEDS="1 2 3" STEPS=500 GSM8K=data/gsm8k/test.jsonl \
#     bash launch/experiments/compare_losses_gpu.sh
#
# Needs models/qwen2.5-1.5b (hf download Qwen/Qwen2.5-1.5B --local-dir ...), the
# shards the config names (README, Multi-node: the same data-tools commands with
# --tokenizer models/qwen2.5-1.5b), GSM8K-format jsonl, and the extra `experiments` (pip
# install -e '.[experiments]': scipy, for the task report). Results: runs/compare-gpu/
# (the task report in runs/compare-gpu/tasks-report/).
set -euo pipefail
cd "$(dirname "$0")/../.."

read -r -a kinds <<<"${KINDS:-mle ntl_was dist2 mixce emo del}"
read -r -a seeds <<<"${SEEDS:-${SEED:-1}}"
steps=${STEPS:-500}
gsm8k=${GSM8K:?set GSM8K to a GSM8K-format jsonl (question, answer ending in '#### N')}
root=${ROOT:-runs/compare-gpu}
backend=transformers
# the task report at the end (experiments/, from this checkout) needs scipy: said before the runs
if ! python3 -c 'import scipy' 2>/dev/null; then
  echo "compare_losses_gpu.sh: pip install -e '.[experiments]' first (scipy, for the report)" >&2
  exit 2
fi
if python3 -c 'import vllm' 2>/dev/null; then backend=vllm; fi

# the task suite's held-out problems: the same as the CPU protocol's (seed 0), whatever the
# number of training documents
tasks=$root/tasks
[ -f "$tasks/tasks.json" ] || data-tools tasks -o "$tasks" --documents 1 --heldout 200 --seed 0

runs=()
for kind in "${kinds[@]}"; do
  for seed in "${seeds[@]}"; do
    run=$root/$kind-$seed
    runs+=("$run")
    if [ -f "$run/results.json" ]; then continue; fi
    bash launch/torchrun.sh configs/qwen2.5_1.5b.yaml "loss.kind=$kind" "train.seed=$seed" \
      "train.steps=$steps" "train.save_interval=0" "output_dir=$run" loss.fused_output=true
    del-eval "$run/checkpoints/step-$(printf %07d "$steps")" \
      --heldout data/shards/heldout/manifest.json --max-batches 200 \
      --gsm8k "$gsm8k" --shots 4 --backend "$backend" \
      --tasks "$tasks" --task-shots 3 --task-limit 100 --out "$run"
  done
done
del-eval compare "${runs[@]}" --group-by parent-name --out "$root/plots"
python3 -m experiments.numeric_tasks.report --evaluated "${runs[@]}" \
  --command "KINDS=\"${kinds[*]}\" SEEDS=\"${seeds[*]}\" STEPS=$steps bash $0" \
  --out "$root/tasks-report"
