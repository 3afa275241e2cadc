#!/usr/bin/env bash
# The main job on a laptop: environment, synthetic math corpus, tokenizer, shards, then
# continued pretraining of a tiny Llama-style model with DEL at tensor parallel 2 on two
# processes, a checkpoint, and held-out loss / digit accuracy / digit entropy before and after.
#
#   bash launch/quickstart.sh [--gsm8k PATH/train.jsonl] [del-train overrides ...]
#
# --gsm8k adds GSM8K train (question/answer, questions masked) to the mix at 30%.
set -euo pipefail
cd "$(dirname "$0")/.."

gsm8k=""
if [ "${1:-}" = "--gsm8k" ]; then gsm8k=$2; shift 2; fi
RUN=${RUN:-runs/tiny}
DOCS=${DOCS:-8000}

bash launch/setup_env.sh
bin=.venv/bin
bash launch/tiny_data.sh "$RUN" "$DOCS"
extra=()
if [ -n "$gsm8k" ]; then
  $bin/data-tools build "$gsm8k" -o "$RUN/shards/gsm8k" --tokenizer "$RUN/tokenizer.model" \
    --prompt-field question --response-field answer --quiet
  extra=("data.sources=[{manifest: $RUN/shards/train/manifest.json, weight: 0.7}, {manifest: $RUN/shards/gsm8k/manifest.json, weight: 0.3}]")
fi
# The main job starts over each time (the corpus and tokenizer above are regenerated): the
# checkpoints and metrics of its previous run in $RUN go, nothing else.
rm -rf "$RUN/checkpoints" "$RUN/metrics.jsonl"
OMP_NUM_THREADS=1 $bin/torchrun --nproc_per_node=2 --master_addr=127.0.0.1 --master_port="${MASTER_PORT:-29541}" \
  -m del_megatron.cli.train --config configs/tiny_cpu.yaml \
  "data.tokenizer=$RUN/tokenizer.model" \
  "data.sources=[{manifest: $RUN/shards/train/manifest.json}]" \
  "eval.sources=[{manifest: $RUN/shards/heldout/manifest.json}]" \
  "output_dir=$RUN" "${extra[@]}" "$@"
