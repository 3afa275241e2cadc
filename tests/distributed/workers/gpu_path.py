"""torchrun worker: the trainer's whole path read as a GPU run would execute it, on CPU.

`train` (the real loop: the streaming loader, train_step, periodic evaluation, checkpoints,
the final evaluation) runs 4 steps, then a second `train` resumes from the step-4 checkpoint
to step 6 with the loss of `resume_kind` (`del+fused`: the fused output layer, whose
backward the trainer promises to be its loss' own, scaled), all under
`tests/distributed/residency.Residency`, which tells the tensors a GPU run would hold in
host memory from those on the device. Each rank writes what it saw to
OUT.rank<r>.json: violations (a host tensor at a collective, host and device tensors mixed
in an op) and the host synchronisations our code made in each phase (each train_step call,
evaluation, checkpoint, reporter flush), and megatron-core's own in each train_step.

`engine`: deepspeed (ZeRO 1, data parallel 2), or megatron in its GPU configuration on two
pipeline stages (megatron's distributed optimizer, overlapped gradient reduction and weight
gathering, bf16 weights with fp32 masters: what engines/megatron.engine_choices picks on a
GPU).

argv: tokenizer manifest kind out [resume_kind (default: kind) [engine (default: deepspeed)]]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from residency import Residency

from del_megatron.config import parse_run_config


def config(
    tokenizer: str, manifest: str, kind: str, out: str, steps: int, engine: str = "deepspeed"
):
    parallel = {"tensor_parallel": 1, "zero_stage": 1}
    train = {}
    if engine == "megatron":
        parallel |= {
            "pipeline_parallel": 2,
            "distributed_optimizer": True,
            "overlap_grad_reduce": True,
            "overlap_param_gather": True,
        }
        train = {"engine": "megatron", "bf16": True}
    return parse_run_config(
        {
            "model": {
                "vocab_size": 800,
                "hidden_size": 64,
                "ffn_hidden_size": 160,
                "num_layers": 2,
                "num_attention_heads": 4,
                "num_query_groups": 2,
                "max_position_embeddings": 64,
                "make_vocab_size_divisible_by": 16,
            },
            "loss": {"kind": kind.removesuffix("+fused"), "fused_output": kind.endswith("+fused")},
            "parallel": parallel,
            "optim": {"lr": 1e-3, "warmup_fraction": 0.2},
            "train": {
                "steps": steps,
                "micro_batch_size": 2,
                "global_batch_size": 8,  # 2 micro-batches a step on each of 2 ranks (PP 2: 4)
                "seq_len": 32,
                "device": "cpu",
                "log_interval": 3,
                "eval_interval": 2,
                "save_interval": 2,
                **train,
            },
            "data": {
                "tokenizer": tokenizer,
                "sources": [{"manifest": manifest}],
                "num_workers": 0,  # tensors made in this process, where the mode sees them
            },
            "eval": {"sources": [{"manifest": manifest}], "max_batches": 2},
            "logging": {"wandb": "disabled", "progress_bar": False},
            "output_dir": out,
        }
    )


def main() -> None:
    tokenizer, manifest, kind, out = sys.argv[1:5]
    resume_kind = sys.argv[5] if len(sys.argv) > 5 else kind
    engine = sys.argv[6] if len(sys.argv) > 6 else "deepspeed"
    from del_megatron import runtime
    from del_megatron.checkpoint import host, load, save
    from del_megatron.data import StreamingLoader
    from del_megatron.training import trainer
    from del_megatron.training.metrics import Reporter

    residency = Residency(library_phases=("train_step",))  # megatron-core's reads too
    residency.watch_collectives()
    host.host_buffer = residency.pinned(host.host_buffer)  # page-locked on a GPU
    runtime.synchronize = residency.waits(runtime.synchronize)
    from del_megatron.losses import fused, vocab_parallel

    for function in (vocab_parallel._VocabParallelParts, fused._FusedParts):
        function.backward = residency.in_backward(function)  # where our gradients are formed
    StreamingLoader.__iter__ = residency.host_batches(StreamingLoader.__iter__)
    trainer.train_step = residency.phased("train_step", trainer.train_step)
    trainer.evaluate = residency.phased("evaluate", trainer.evaluate)
    save.save = residency.phased("checkpoint.save", save.save)
    load.load = residency.phased("checkpoint.load", load.load)
    if hasattr(Reporter, "flush"):
        Reporter.flush = residency.phased("flush", Reporter.flush)
    run_dir = str(Path(out).parent / f"{Path(out).name}.run")
    with residency:
        first = trainer.train(config(tokenizer, manifest, kind, run_dir, 4, engine))
        second = trainer.train(
            config(tokenizer, manifest, resume_kind, run_dir, 6, engine), resume="auto"
        )
    rank = dist.get_rank()
    report = {
        "violations": residency.violations,
        "syncs": dict(residency.syncs),
        "sync_places": dict(residency.sync_places),
        "losses": first.losses + second.losses,
    }
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(report, indent=1))
    print("OK", rank, len(residency.violations), "violations")


if __name__ == "__main__":
    main()
    from del_megatron.parallel import end_distributed  # here: after the collectives' watch

    end_distributed()  # as del-train ends: a gloo group alive at exit can abort it
