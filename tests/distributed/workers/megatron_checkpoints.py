"""torchrun worker: checkpoints across engines and layouts. The variants and batches are
workers/megatron_engine.py's (`ENGINE:TP:PP[:VP]/KIND[+tied]`, 5 steps of fixed global
batches from INIT_DIR's weights); each command runs in one process after the other:

    save:VARIANT:DIR       steps 1-2 of VARIANT, then a checkpoint in DIR (checkpoint/save.py
                           and publish.py, as the loop calls them)
    resume:VARIANT:DIR     VARIANT loads DIR's newest checkpoint (checkpoint/load.py, as the
                           loop does), checks that every range of the optimizer state this
                           rank holds (fp32 master, both moments, tied copies included) and
                           its Adam step equal the saved state bit for bit, and that the
                           schedule is at the saved position; then steps 3-5, and rank 0
                           writes OUT_DIR/resume_VARIANT_from_<DIR name>.json (+ .pt): the
                           losses of steps 3-5 and the full parameters after step 5

    megatron_checkpoints.py TOKENIZER MANIFEST OUT_DIR INIT_DIR COMMAND...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.distributed.workers.megatron_engine import batch_source, config, full_parameters

SAVED_AT = 2


def start(tokenizer: str, manifest: str, init_dir: Path, variant: str, out: Path):
    from del_megatron.training.trainer import setup

    tied = "+tied" in variant
    cfg = config(tokenizer, manifest, variant, str(init_dir / ("tied" if tied else "untied")))
    cfg = cfg.model_copy(
        update={
            "output_dir": str(out),
            "train": cfg.train.model_copy(update={"checkpoints": True}),
        }
    )
    run = setup(cfg)
    return run, batch_source(run)


def steps(run, batches, first: int, last: int) -> list[float]:
    from del_megatron.training.trainer import next_micro_batches, train_step

    losses = []
    for step in range(first, last + 1):
        values = train_step(run, next_micro_batches(run, batches, step - 1), step).metrics.values()
        losses.append(values["loss"])
    return losses


def save(tokenizer, manifest, init_dir: Path, variant: str, directory: Path) -> None:
    from del_megatron.training import checkpointing

    run, batches = start(tokenizer, manifest, init_dir, variant, directory)
    steps(run, batches, 1, SAVED_AT)
    pending = checkpointing.save(run, SAVED_AT, None, keep=1)
    saved = checkpointing.publish(run, pending, run_ends=True)
    if dist.get_rank() == 0:
        print(f"OK saved {variant} at {saved}", flush=True)
    if run.cfg.train.engine == "deepspeed":
        run.engine.destroy()


def assert_state_is_the_saved_one(run, path: Path) -> int:
    """Every range of the fp32 masters and Adam moments this rank's optimizer holds equals
    the saved tensor's (merged to TP 1 from the files) at that range, bit for bit; so do the
    Adam step and the schedule's position. Returns the elements compared on this rank."""
    from megatron.core import parallel_state

    from del_megatron.checkpoint import optim_format
    from del_megatron.models.hf_tensors import canonical
    from del_megatron.models.sharding import split

    adapter = run.engine_kind.checkpoint_adapter(run)
    index = optim_format.read_index(path)
    saved = {e["canonical"]: e for e in index["params"]}
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp = run.cfg.parallel.tensor_parallel
    compared = 0
    steps_held = set(adapter.adam_steps().values())
    assert steps_held == {saved[next(iter(saved))]["step"]}, steps_held
    for name, param in [*adapter.parameters(), *adapter.copies()]:
        entry = saved[canonical(name)]
        span = adapter.owned(param)
        if span is None:
            continue
        shape = adapter.shard_shape(param)
        for key in optim_format.KEYS:
            full = optim_format.saved_full(path, index, entry, key)  # TP 1, tokenizer rows
            if optim_format.has_vocab_rows(name):
                padded = torch.zeros((shape[0] * tp, *shape[1:]))
                padded[: full.shape[0]] = full
                full = padded
            partition = entry["partition"] and tuple(entry["partition"])
            mine = split(full, partition, tp_rank, tp).reshape(-1)[span[0] : span[1]]
            held = adapter.get(param, key).detach().float()
            assert torch.equal(held, mine), (name, key, (held - mine).abs().max().item())
            compared += held.numel()
    assert run.scheduler.last_epoch == index["scheduler_last_epoch"]
    return compared


def resume(tokenizer, manifest, out_dir: Path, init_dir: Path, variant: str, directory: Path):
    from del_megatron.checkpoint import directory as directories
    from del_megatron.training import checkpointing

    run, batches = start(tokenizer, manifest, init_dir, variant, out_dir / "unused")
    path = directories.complete_checkpoints(directories.root_of(str(directory)))[-1]
    step = checkpointing.load(run, path, None)
    assert step == SAVED_AT, step
    compared = assert_state_is_the_saved_one(run, path)
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, compared)
    losses = steps(run, batches, SAVED_AT + 1, run.cfg.train.steps)
    params = full_parameters(run)
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        name = f"resume_{variant.replace('/', '_')}_from_{directory.name}_np{world}.json"
        out = out_dir / name
        out.write_text(json.dumps({"losses": losses, "compared": sum(counts)}))
        torch.save(params, str(out) + ".pt")
        print(f"OK resumed {variant} from {directory.name}: {sum(counts)} elements", flush=True)
    if run.cfg.train.engine == "deepspeed":
        run.engine.destroy()


def main() -> None:
    tokenizer, manifest, out_dir, init_dir, *commands = sys.argv[1:]
    for command in commands:
        what, rest = command.split(":", 1)
        variant, directory = rest.rsplit(":", 1)
        if what == "save":
            save(tokenizer, manifest, Path(init_dir), variant, Path(directory))
        else:
            resume(tokenizer, manifest, Path(out_dir), Path(init_dir), variant, Path(directory))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
