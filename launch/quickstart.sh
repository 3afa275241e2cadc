#!/usr/bin/env bash
# The main job on a laptop: environment, synthetic math corpus, tokenizer, shards, then
# continued pretraining of a tiny Llama-style model with DEL at tensor parallel 2 on two
# processes, a checkpoint, and held-out loss / digit accuracy / digit entropy before and after.
#
#   bash launch/quickstart.sh [--gsm8k PATH/train.jsonl] [del-train overrides ...]
#
# --gsm8k adds GSM8K train (question/answer, questions masked) to the mix at 30%; a few
# problems ship in examples/gsm8k/train.jsonl. The run starts over each time: the previous
# run's checkpoints and metrics in $RUN are moved aside to $RUN/previous-<time>/, never
# deleted. Ranks start through launch/torchrun.sh (its own free port, the start-up checks
# before the ranks, a mistake as one line and status 2).
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "quickstart: $*"; }
gsm8k=""
if [ "${1:-}" = "--gsm8k" ]; then
  if [ $# -lt 2 ]; then
    echo "quickstart: --gsm8k needs a file, e.g. --gsm8k examples/gsm8k/train.jsonl" >&2
    exit 2
  fi
  gsm8k=$2
  shift 2
fi
if [ -n "$gsm8k" ] && [ ! -f "$gsm8k" ]; then # before minutes of set-up and data
  echo "quickstart: --gsm8k $gsm8k: no such file (a few problems ship in" \
    "examples/gsm8k/train.jsonl; examples/gsm8k/README.md says where the full set is)" >&2
  exit 2
fi
RUN=${RUN:-runs/tiny}
DOCS=${DOCS:-8000}

say "setting up .venv (the first time: a few minutes)"
bash launch/setup_env.sh
bin=.venv/bin
sources="data.sources=[{manifest: $RUN/shards/train/manifest.json}]"
if [ -n "$gsm8k" ]; then
  sources="data.sources=[{manifest: $RUN/shards/train/manifest.json, weight: 0.7}, {manifest: $RUN/shards/gsm8k/manifest.json, weight: 0.3}]"
fi
# each field once (del-train refuses a field set twice; the arguments must not repeat these)
overrides=(
  "data.tokenizer=$RUN/tokenizer.model"
  "$sources"
  "eval.sources=[{manifest: $RUN/shards/heldout/manifest.json}]"
  "output_dir=$RUN"
  "$@"
)
# The config and the overrides alone (no data needed yet): a typo is one line and status 2
# now, not after the data. --deepspeed-json is the del-train path that reads nothing else.
$bin/del-train --config configs/tiny_cpu.yaml --deepspeed-json 2 "${overrides[@]}" >/dev/null

say "generating the synthetic corpus, tokenizer and shards in $RUN (about a minute)"
bash launch/tiny_data.sh "$RUN" "$DOCS"
if [ -n "$gsm8k" ]; then
  say "tokenizing $gsm8k into $RUN/shards/gsm8k"
  $bin/data-tools build "$gsm8k" -o "$RUN/shards/gsm8k" --tokenizer "$RUN/tokenizer.model" \
    --prompt-field question --response-field answer --quiet
fi
# The main job starts over each time; the previous run's results are the user's: moved aside
if [ -e "$RUN/checkpoints" ] || [ -e "$RUN/metrics.jsonl" ]; then
  previous=$(mktemp -d "$RUN/previous-$(date -u +%Y%m%dT%H%M%SZ)-XXXX")
  chmod "$(printf '%o' $((0777 & ~$(umask))))" "$previous" # the user's umask, not mktemp's 700
  for part in checkpoints metrics.jsonl; do
    if [ -e "$RUN/$part" ]; then mv "$RUN/$part" "$previous/"; fi
  done
  say "the previous run's checkpoints and metrics moved to $previous"
fi
OMP_NUM_THREADS=1 bash launch/torchrun.sh --nproc-per-node 2 configs/tiny_cpu.yaml "${overrides[@]}"

# del-train has printed how to evaluate and export its checkpoint; training further is the
# launcher's part here (this script would start over)
checkpoint=$(find "$RUN/checkpoints" -mindepth 1 -maxdepth 1 -name 'step-*' | sort | tail -n 1)
say "to train this run further: bash launch/torchrun.sh --nproc-per-node 2 --resume auto" \
  "$checkpoint/run_config.yaml train.steps=600"
