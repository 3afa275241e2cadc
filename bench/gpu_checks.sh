#!/usr/bin/env bash
# The GPU checks, as one script for a lent H200 (run from the repository root there).
# Its image has torch, transformers, sentencepiece; megatron-core and pydantic travel as
# wheels in .whl/ (fetch them here first with bench/fetch_gpu_wheels.sh) and install into
# /tmp/site. Prints one table per check; copy the figures into docs/benchmarks.md.
set -euo pipefail
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore::UserWarning
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'

echo "== hook vs megatron fused CE: TP 1, bf16, V=152064, 16384 tokens"
python3 bench/loss_tp.py --device cuda --dtype bf16 --vocab 152064 --tokens 16384 --repeats 10
echo "== the same in float32"
python3 bench/loss_tp.py --device cuda --dtype fp32 --vocab 152064 --tokens 16384 --repeats 10
echo "== training step, 4-layer Llama-2-7B widths, seq 4096, bf16, TP 1: DEL vs MLE"
python3 bench/train_step.py --gpu-7b --steps 6
echo "== fused output layer + DEL vs megatron output layer + CE: TP 1, bf16, V=152064, 16384 tokens"
python3 bench/loss_fused.py --device cuda --dtype bf16 --tp 1 --tokens 16384 --chunk 1024 \
  --repeats 5 --chunks 512,2048,4096
