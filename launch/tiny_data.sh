#!/usr/bin/env bash
# The tiny runs' data, in one directory: a synthetic math corpus (train + held-out problems),
# a sentencepiece tokenizer that splits digits, and shards of both.
#
#   bash launch/tiny_data.sh DIR DOCUMENTS
#
# Writes DIR/corpus/, DIR/tokenizer.model, DIR/shards/{train,heldout}/. Needs .venv
# (launch/setup_env.sh). Used by the quick start and launch/experiments/compare_losses.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$1
documents=$2
bin=.venv/bin
$bin/data-tools synth -o "$dir/corpus" --documents "$documents" --heldout 400 --seed 0
$bin/data-tools tokenizer "$dir/corpus/train.jsonl" -o "$dir/tokenizer.model" --vocab-size 1000
$bin/data-tools build "$dir/corpus/train.jsonl" -o "$dir/shards/train" \
  --tokenizer "$dir/tokenizer.model" --shard-mb 1 --workers 2 --quiet
$bin/data-tools build "$dir/corpus/heldout.jsonl" -o "$dir/shards/heldout" \
  --tokenizer "$dir/tokenizer.model" --quiet
