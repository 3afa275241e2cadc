"""torchrun worker: del-train's step on both engines (train.engine), 5 optimizer steps on
fixed global batches from one set of initial weights, for each variant in one process.

    megatron_engine.py TOKENIZER MANIFEST OUT_DIR INIT_DIR VARIANT...

A variant is `ENGINE:TP:PP[:VP]/KIND[+tied]`, e.g. `deepspeed:1:1/del`, `megatron:2:2/emo+tied`,
`megatron:1:2:2/del` (virtual stages). The run starts from INIT_DIR/untied or INIT_DIR/tied
(init.megatron: del-megatron weights, written here by the variant `init`, which must come
first at one process), the path of a run started from weights; a random start is the same
model at every layout too (the check `random-start`, `one_random_start`). Rank 0 writes each
variant's step losses and gradient norms (before clipping) to OUT_DIR/VARIANT.json and the
full parameters after the last step beside it (.pt): gathered over tensor-parallel ranks
and pipeline stages, the vocabulary's padding cut (800 tokens pad to 832 at TP 1 and 896 at
TP 2), and the tied embedding's two copies (first and last stage) checked equal.

4 layers: at PP 2 without virtual stages they split 1 + 3 (parallel.first_stage_layers=1);
token counts differ between micro-batches and ranks (rows keep 3% to 100% of their
targets), so a loss normalised per micro-batch, per rank or per stage shows.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from del_megatron.config import parse_run_config
from tests.distributed.workers.train_equivalence import GLOBAL, MICRO, SEQ, global_batches

VOCAB = 800  # the batches are train_equivalence's: SEQ 32, MICRO 2, GLOBAL 8
# The initial weights' seed. Not the default (1234): its random start has an embedding element
# whose step-2 gradient is 1.5e-8 (its row's others 7e-4 and 1.5e-2, its token absent after
# step 2), where Adam divides by |g| + eps (1e-8): the engines' float32 sums of it, apart in
# their last bits, became updates 6% apart, 5.8e-5 after 5 steps against the 2e-5 bound
# (megatron:1:2/mle; every other element within 1.3e-7). Not an engine's error: Adam's.
INIT_SEED = 1


def config(tokenizer: str, manifest: str, variant: str, init_dir: str | None):
    return parse_run_config(tree(tokenizer, manifest, variant, init_dir))


def tree(tokenizer: str, manifest: str, variant: str, init_dir: str | None) -> dict:
    """The variant's run config as a tree (`config` parses it)."""
    layout, _, kind = variant.partition("/")
    engine, tp, pp, *vp = layout.split(":")
    kind, *options = kind.split("+")
    tied = "tied" in options
    parallel = {"tensor_parallel": int(tp), "pipeline_parallel": int(pp), "zero_stage": 1}
    train, loss = {}, {}
    if "gpu" in options:  # the megatron engine's GPU configuration, on CPU
        parallel |= dict.fromkeys(
            ("distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather"), True
        )
        # several buckets (megatron's default holds this model in one): the output weight's
        # [832, 32] in one of its own, as a 7B's is at its default; each padded to DP ranks
        parallel["ddp_bucket_size"] = 10_000
        train["bf16"] = True
    if "fused" in options:
        loss["fused_output"] = True
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
        "loss": {"kind": kind, "normalize": "tokens", **loss},
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
            **train,
        },
        "init": {"megatron": init_dir} if init_dir else {},
        "data": {"tokenizer": tokenizer, "sources": [{"manifest": manifest}]},
        # held-out batches scored after the last step (`+gpu` variants): 3, so the last
        # schedule call is shorter than a step's micro-batches (and filled at virtual PP)
        "eval": {"sources": [{"manifest": manifest}], "max_batches": 3},
        "logging": {"wandb": "disabled", "progress_bar": False},
        "output_dir": "/tmp/del-megatron-engine",
    }


def write_init(tokenizer: str, manifest: str, init_dir: Path) -> None:
    """INIT_DIR/{untied,tied}: a random start (train.seed `INIT_SEED`) at TP 1 as
    del-megatron weights."""
    from del_megatron.models.sharding import gather_full
    from del_megatron.models.weight_files import write_weights
    from del_megatron.training.build import build_model
    from del_megatron.training.trainer import setup

    for tied in (False, True):
        layout = tree(tokenizer, manifest, "deepspeed:1:1/del" + ("+tied" if tied else ""), None)
        layout["train"]["seed"] = INIT_SEED
        cfg = parse_run_config(layout)
        run = setup(cfg)  # the parallel state and the tokenizer
        model = build_model(cfg, run.device, run.tokenizer)
        write_weights(
            init_dir / ("tied" if tied else "untied"), [gather_full(model)], cfg.model, None
        )
        run.engine.destroy()


def full_parameters(run) -> dict[str, torch.Tensor]:
    """Every parameter of the whole model (one stage, TP 1, the vocabulary unpadded), on
    rank 0 (None elsewhere). The megatron engine's as the trainer reads them outside a step
    (engines/megatron.synced_weights: with the overlapped gather, the last update's weights
    arrive at the next forward)."""
    import contextlib

    from del_megatron.models.sharding import gather_full, global_name
    from del_megatron.training.engines.megatron import synced_weights

    if run.cfg.train.engine == "megatron":
        modules, synced = run.engine.modules, synced_weights(run.engine)
    else:
        modules, synced = [run.engine.module], contextlib.nullcontext()
    mine = {}
    with synced:
        gathered = [gather_full(module) for module in modules]
    for module, full in zip(modules, gathered, strict=True):
        for name, value in full.items():
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


def assert_gpu_configuration(run) -> None:
    """The engine runs what it runs on a GPU: bf16 weights, megatron's distributed optimizer
    (each rank's fp32 masters a range of the buffer), overlapped reduce and gather."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    engine = run.engine
    optimizers = getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
    assert all(isinstance(o, DistributedOptimizer) for o in optimizers), optimizers
    for chunk in engine.chunks:
        assert chunk.ddp_config.overlap_grad_reduce and chunk.ddp_config.overlap_param_gather
        dtypes = {n: p.dtype for n, p in chunk.module.named_parameters()}
        assert set(dtypes.values()) == {torch.bfloat16}, dtypes


def run_variant(tokenizer: str, manifest: str, out_dir: Path, init_dir: Path, variant: str):

    from del_megatron.training.trainer import next_micro_batches, setup, train_step

    tied = "+tied" in variant
    cfg = config(tokenizer, manifest, variant, str(init_dir / ("tied" if tied else "untied")))
    run = setup(cfg)
    if "+gpu" in variant:
        assert_gpu_configuration(run)
    batches = batch_source(run)
    trajectory = {"losses": [], "grad_norms": []}
    for step in range(1, cfg.train.steps + 1):
        values = train_step(run, next_micro_batches(run, batches, step - 1), step).metrics.values()
        trajectory["losses"].append(values["loss"])
        trajectory["grad_norms"].append(values["grad_norm"])
    if "+gpu" in variant:
        from del_megatron.training.trainer import evaluate

        trajectory["evaluated"] = evaluate(run, cfg.eval.max_batches)["loss"]
    params = full_parameters(run)
    if dist.get_rank() == 0:
        out = out_dir / f"{variant.replace('/', '_')}.json"
        out.write_text(json.dumps(trajectory))
        torch.save(params, str(out) + ".pt")
        print("OK", variant, trajectory, flush=True)
    if cfg.train.engine == "deepspeed":
        run.engine.destroy()


def one_random_start(tokenizer: str, manifest: str) -> None:
    """A random start is one model at every layout (2 processes): megatron's engine at PP 2 x
    2 virtual stages with tied embeddings and the deepspeed engine at TP 2 (vocabulary padded
    to 896 rows, against 832 at TP 1), gathered (`full_parameters`: the tied embedding's two
    copies equal), equal bit for bit to the one-process build of the same model; its four
    layers all differ (one seed for every chunk once made them copies); another train.seed
    draws every random tensor anew."""
    from del_megatron.parallel import init_model_parallel
    from del_megatron.training.build import build_model
    from del_megatron.training.trainer import setup

    # the layout -> the same model in one process
    layouts = {
        "megatron:1:2:2/del+tied": "deepspeed:1:1/del+tied",
        "deepspeed:2:1/del": "deepspeed:1:1/del",
    }
    gathered = {}
    for variant in layouts:
        run = setup(config(tokenizer, manifest, variant, None))
        gathered[variant] = full_parameters(run)
        if run.cfg.train.engine == "deepspeed":
            run.engine.destroy()

    def one_process(variant: str, seed: int) -> dict[str, torch.Tensor]:
        """The whole model of `variant` with train.seed `seed`, built at TP 1 as the deepspeed
        engine builds it, the vocabulary's padding cut."""
        layout = tree(tokenizer, manifest, variant, None)
        layout["train"]["seed"] = seed
        model = build_model(parse_run_config(layout), run.device, run.tokenizer)
        padded = ("embedding.word_embeddings.weight", "output_layer.weight")
        return {
            name: (value[:VOCAB] if name in padded else value).detach()
            for name, value in model.named_parameters()
        }

    seed = run.cfg.train.seed
    init_model_parallel(1, 10)  # every rank: one stage, TP 1 (data parallel over the ranks)
    if dist.get_rank() == 0:
        for variant, whole in layouts.items():
            want = one_process(whole, seed)
            assert gathered[variant].keys() == want.keys(), variant
            for name, value in want.items():
                assert torch.equal(gathered[variant][name], value), (variant, name)
        fc2 = [want[f"decoder.layers.{i}.mlp.linear_fc2.weight"] for i in range(4)]
        assert all(not torch.equal(a, b) for i, a in enumerate(fc2) for b in fc2[i + 1 :])
        other = one_process("deepspeed:1:1/del", seed + 1)
        for name, value in want.items():
            # the normal draws differ; norms (ones) and biases (zeros) are the same constants
            constant = bool((value == value.flatten()[0]).all())
            assert torch.equal(value, other[name]) == constant, name
        print("OK one random start: PP 2 x VP 2 and TP 2 as one process; seeds differ", flush=True)


def main() -> None:
    tokenizer, manifest, out_dir, init_dir, *variants = sys.argv[1:]
    for variant in variants:
        if variant == "random-start":
            one_random_start(tokenizer, manifest)
        elif variant == "init":
            write_init(tokenizer, manifest, Path(init_dir))
        else:
            run_variant(tokenizer, manifest, Path(out_dir), Path(init_dir), variant)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
