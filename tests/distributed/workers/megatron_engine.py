"""torchrun worker: del-train's step on both engines (train.engine), 5 optimizer steps on
fixed global batches from one set of initial weights, for each variant in one process.

    megatron_engine.py TOKENIZER MANIFEST OUT_DIR INIT_DIR VARIANT...

A variant is `ENGINE:TP:PP[:VP]/KIND[+tied]`, e.g. `deepspeed:1:1/del`, `megatron:2:2/emo+tied`,
`megatron:1:2:2/del` (virtual stages). The run starts from INIT_DIR/untied or INIT_DIR/tied
(init.megatron: del-megatron weights, written here by the variant `init`, which must come
first at one process), so every layout starts from the same model (a random start draws
each stage's layers itself, as Megatron-LM's). Rank 0 writes each variant's step losses and
gradient norms (before clipping) to OUT_DIR/VARIANT.json and the full parameters after the
last step beside it (.pt): gathered over tensor-parallel ranks and pipeline stages, the
vocabulary's padding cut (800 tokens pad to 832 at TP 1 and 896 at TP 2), and the tied
embedding's two copies (first and last stage) checked equal.

4 layers: at PP 2 without virtual stages they split 1 + 3 (parallel.first_stage_layers=1);
token counts differ between micro-batches and ranks (rows keep 3% to 100% of their
targets), so a loss normalised per micro-batch, per rank or per stage shows.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from del_megatron.config import parse_run_config
from tests.distributed.workers.train_equivalence import GLOBAL, MICRO, SEQ, global_batches

VOCAB = 800  # the batches are train_equivalence's: SEQ 32, MICRO 2, GLOBAL 8


def config(tokenizer: str, manifest: str, variant: str, init_dir: str | None):
    return parse_run_config(tree(tokenizer, manifest, variant, init_dir))


def tree(tokenizer: str, manifest: str, variant: str, init_dir: str | None) -> dict:
    """The variant's run config as a tree (`config` parses it)."""
    layout, _, kind = variant.partition("/")
    engine, tp, pp, *vp = layout.split(":")
    tied = kind.endswith("+tied")
    kind = kind.removesuffix("+tied")
    parallel = {"tensor_parallel": int(tp), "pipeline_parallel": int(pp), "zero_stage": 1}
    if vp:
        parallel["virtual_pipeline_parallel"] = int(vp[0])
    elif int(pp) > 1:
        parallel["first_stage_layers"] = 1  # 1 + 3: an uneven split
    return {
        "model": {
            "vocab_size": VOCAB,
            "hidden_size": 32,
            "ffn_hidden_size": 64,
            "num_layers": 4,
            "num_attention_heads": 4,
            "num_query_groups": 2,
            "max_position_embeddings": 64,
            "qkv_bias": True,
            "tie_word_embeddings": tied,
            "make_vocab_size_divisible_by": 64,
        },
        "loss": {"kind": kind, "normalize": "tokens"},
        "parallel": parallel,
        "optim": {"lr": 1e-3, "warmup_fraction": 0.2, "clip_grad": 1.0},
        "train": {
            "steps": 5,
            "micro_batch_size": MICRO,
            "global_batch_size": GLOBAL,
            "seq_len": SEQ,
            "device": "cpu",
            "log_interval": 1,
            "engine": engine,
            "checkpoints": False,
        },
        "init": {"megatron": init_dir} if init_dir else {},
        "data": {"tokenizer": tokenizer, "sources": [{"manifest": manifest}]},
        "logging": {"wandb": "disabled", "progress_bar": False},
        "output_dir": "/tmp/del-megatron-engine",
    }


def write_init(tokenizer: str, manifest: str, init_dir: Path) -> None:
    """INIT_DIR/{untied,tied}: a seeded random model at TP 1 as del-megatron weights."""
    from del_megatron.models.sharding import gather_full
    from del_megatron.models.weight_files import write_weights
    from del_megatron.training.build import build_model
    from del_megatron.training.trainer import setup

    for tied in (False, True):
        cfg = config(tokenizer, manifest, "deepspeed:1:1/del" + ("+tied" if tied else ""), None)
        run = setup(cfg)  # the parallel state and the tokenizer
        model = build_model(cfg, run.device, run.tokenizer)
        write_weights(
            init_dir / ("tied" if tied else "untied"), [gather_full(model)], cfg.model, None
        )
        run.engine.destroy()


def full_parameters(run) -> dict[str, torch.Tensor]:
    """Every parameter of the whole model (one stage, TP 1, the vocabulary unpadded), on
    rank 0 (None elsewhere)."""
    from del_megatron.models.sharding import gather_full, global_name

    if run.cfg.train.engine == "megatron":
        modules = run.engine.modules
    else:
        modules = [run.engine.module]
    mine = {}
    for module in modules:
        for name, value in gather_full(module).items():
            key = global_name(module, name)
            if "word_embeddings" in key or key.startswith("output_layer"):
                value = value[:VOCAB]
            if key in mine:  # a tied embedding's second copy on this rank
                assert torch.equal(mine[key], value), key
            mine[key] = value
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in every:
        for key, value in part.items():
            if key in merged:  # another TP or DP rank, or the tied embedding's other stage
                assert torch.equal(merged[key], value), (
                    f"two copies of {key} differ",
                    (merged[key] - value).abs().max(),
                    merged[key].shape,
                    value.shape,
                )
            merged[key] = value
    return merged


def batch_source(run):
    """(step, micro-batch) -> this data-parallel rank's rows of train_equivalence's global
    batches."""
    from megatron.core import parallel_state

    steps = global_batches([ids[0] for ids in run.tokenizer.digit_vocab.digit_ids])

    def batches(step: int, index: int):
        dp = parallel_state.get_data_parallel_world_size()
        block = index * dp + parallel_state.get_data_parallel_rank()
        window, mask = steps[step]
        rows = slice(block * MICRO, (block + 1) * MICRO)
        return {"tokens": window[rows, :-1], "labels": window[rows, 1:], "loss_mask": mask[rows]}

    return batches


def run_variant(tokenizer: str, manifest: str, out_dir: Path, init_dir: Path, variant: str):

    from del_megatron.training.trainer import next_micro_batches, setup, train_step

    tied = variant.endswith("+tied")
    cfg = config(tokenizer, manifest, variant, str(init_dir / ("tied" if tied else "untied")))
    run = setup(cfg)
    batches = batch_source(run)
    trajectory = {"losses": [], "grad_norms": []}
    for step in range(1, cfg.train.steps + 1):
        values = train_step(run, next_micro_batches(run, batches, step - 1), step).metrics.values()
        trajectory["losses"].append(values["loss"])
        trajectory["grad_norms"].append(values["grad_norm"])
    params = full_parameters(run)
    if dist.get_rank() == 0:
        out = out_dir / f"{variant.replace('/', '_')}.json"
        out.write_text(json.dumps(trajectory))
        torch.save(params, str(out) + ".pt")
        print("OK", variant, trajectory, flush=True)
    if cfg.train.engine == "deepspeed":
        run.engine.destroy()


def distinct_random_layers(tokenizer: str, manifest: str) -> None:
    """A random start at PP x virtual stages (`distinct:TP:PP:VP`-less: PP = the process
    count, 2 chunks each): no two model chunks hold the same first-layer weights (each chunk
    its own seed), and the first chunk of the first stage is what a one-stage build draws."""
    from del_megatron.training.build import build_model
    from del_megatron.training.trainer import setup

    pp = int(os.environ["WORLD_SIZE"])
    cfg = config(tokenizer, manifest, f"megatron:1:{pp}:2/del", None)
    run = setup(cfg)
    mine = [m.decoder.layers[0].mlp.linear_fc2.weight.detach().clone() for m in run.engine.modules]
    every = [None] * pp
    dist.all_gather_object(every, mine)
    tensors = [t for part in every for t in part]
    for i, a in enumerate(tensors):
        for b in tensors[i + 1 :]:
            assert not torch.equal(a, b), "two model chunks drew the same weights"
    from del_megatron.parallel import init_model_parallel

    init_model_parallel(1, 10)  # every rank: one stage (data parallel over the ranks)
    one = config(tokenizer, manifest, "deepspeed:1:1/del", None)
    whole = build_model(one, run.device, run.tokenizer)
    assert torch.equal(whole.decoder.layers[0].mlp.linear_fc2.weight, tensors[0])
    if dist.get_rank() == 0:
        print(f"OK distinct: {len(tensors)} chunks, the first as one stage draws it", flush=True)


def main() -> None:
    tokenizer, manifest, out_dir, init_dir, *variants = sys.argv[1:]
    for variant in variants:
        if variant == "distinct":
            distinct_random_layers(tokenizer, manifest)
        elif variant == "init":
            write_init(tokenizer, manifest, Path(init_dir))
        else:
            run_variant(tokenizer, manifest, Path(out_dir), Path(init_dir), variant)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
