#!/usr/bin/env bash
# The tiny runs' data, in one directory: a synthetic math corpus (train + held-out problems),
# a sentencepiece tokenizer that splits digits, and shards of both.
#
#   bash launch/tiny_data.sh DIR DOCUMENTS
#
# Writes DIR/corpus/, DIR/tokenizer.model, DIR/shards/{train,heldout}/. Needs .venv
# (launch/setup_env.sh), or DEL_PYTHON: an interpreter that imports the project (as on a
# machine where it runs from the checkout, bench/gpu_acceptance.sh). Used by the quick start,
# launch/experiments/compare_losses.sh and bench/gpu_acceptance.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$1
documents=$2
data_tools=(.venv/bin/data-tools)
if [ -n "${DEL_PYTHON:-}" ]; then data_tools=("$DEL_PYTHON" -m data_tools); fi
"${data_tools[@]}" synth -o "$dir/corpus" --documents "$documents" --heldout 400 --seed 0
"${data_tools[@]}" tokenizer "$dir/corpus/train.jsonl" -o "$dir/tokenizer.model" --vocab-size 1000
"${data_tools[@]}" build "$dir/corpus/train.jsonl" -o "$dir/shards/train" \
  --tokenizer "$dir/tokenizer.model" --shard-mb 1 --workers 2 --quiet
"${data_tools[@]}" build "$dir/corpus/heldout.jsonl" -o "$dir/shards/heldout" \
  --tokenizer "$dir/tokenizer.model" --quiet
