"""torchrun worker (1 rank): at which step the trainer publishes each checkpoint.

`train` runs 5 steps saving every 2 (gpu_path.py's tiny config, no evaluation), once with the
files written while the step waits (train.background_checkpoints=false) and once behind
training; before each step it notes which entries `checkpoints/` holds. Written to
OUT/seen.json: {"false"|"true": {step: [names]}}, and the names left at the end.

argv: tokenizer manifest out
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from gpu_path import config

from del_megatron.parallel import end_distributed
from del_megatron.training import trainer


def entries(directory: Path) -> list[str]:
    """The names in `directory`, a staging's without its job's token (`.tmp-step-N`)."""
    if not directory.is_dir():
        return []
    return sorted(re.sub(r"^(\.tmp-step-\d{7})-\w+$", r"\1", p.name) for p in directory.iterdir())


def main() -> None:
    tokenizer, manifest, out = sys.argv[1:4]
    real_step = trainer.train_step
    seen: dict[str, dict] = {}
    for background in (False, True):
        run_dir = Path(out) / f"background-{background}"
        notes = seen.setdefault(str(background).lower(), {})

        def noted(run, batches, step, *args, notes=notes, run_dir=run_dir):
            notes[step] = entries(run_dir / "checkpoints")
            return real_step(run, batches, step, *args)

        trainer.train_step = noted
        cfg = config(tokenizer, manifest, "del", str(run_dir), 5)
        train = cfg.train.model_copy(update={"background_checkpoints": background})
        trainer.train(cfg.model_copy(update={"train": train, "eval": cfg.eval.model_copy(
            update={"sources": ()})}))  # fmt: skip
        notes["end"] = entries(run_dir / "checkpoints")
    Path(out, "seen.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
    end_distributed()  # as del-train ends: a gloo group alive at exit can abort it
