"""torchrun worker: del-train's loop (`trainer.train`, the streaming loader) on fixed data,
`pp3` (3 processes: pipeline parallel 3 on the megatron engine, 4 layers split 2 + 1 + 1) or
`one` (1 process: the deepspeed engine; first, as it writes the initial weights both start
from, OUT/init: workers/megatron_engine.py's). Every rank counts the training batches its loaders
yield; rank 0 writes OUT/NAME.json: the counts per rank and the run's losses.

    pipeline_data.py TOKENIZER MANIFEST OUT NAME
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from del_megatron.config import parse_run_config
from tests.distributed.workers.megatron_engine import tree


def config(tokenizer: str, manifest: str, out: Path, engine: str, pp: int, init: Path):
    """workers/megatron_engine.py's model and optimizer; PP 3 splits its 4 layers 2 + 1 + 1;
    4 steps of 12 sequences (6 micro-batches), no held-out evaluation."""
    base = tree(tokenizer, manifest, f"{engine}:1:1/del", str(init))
    base["parallel"] = {"tensor_parallel": 1, "pipeline_parallel": pp, "zero_stage": 1}
    if pp > 1:
        base["parallel"]["first_stage_layers"] = 2
    base["train"] = {**base["train"], "steps": 4, "global_batch_size": 12}
    base["eval"] = {"sources": []}
    base["output_dir"] = str(out)
    return parse_run_config(base)


def main() -> None:
    tokenizer, manifest, out, name = sys.argv[1:]
    from del_megatron.data import StreamingLoader
    from del_megatron.training import trainer

    yielded = [0]
    real_iter = StreamingLoader.__iter__

    def counted(self):
        for batch in real_iter(self):
            yielded[0] += 1
            yield batch

    StreamingLoader.__iter__ = counted
    engine, pp = {"pp3": ("megatron", 3), "one": ("deepspeed", 1)}[name]
    init = Path(out) / "init"
    if name == "one":
        from tests.distributed.workers.megatron_engine import write_init

        write_init(tokenizer, manifest, init)
    cfg = config(tokenizer, manifest, Path(out) / name, engine, pp, init / "untied")
    result = trainer.train(cfg)
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, yielded[0])
    if dist.get_rank() == 0:
        found = {"losses": result.losses, "batches": counts}
        (Path(out) / f"{name}.json").write_text(json.dumps(found))
        print("OK", name, found, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
