"""del-train (its `main`, argv as given), then what the process kept of its groups as the
interpreter is about to exit: prints "groups after del-train: <what is left>" ("none", or
"torch.distributed", "megatron parallel state") and exits with del-train's status.

Kept groups are what a gloo process may abort on as the interpreter ends (SIGABRT for a run
that finished: `parallel.end_distributed`); the abort itself is a race, what is left is not.
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from del_megatron.cli.train import main

if __name__ == "__main__":
    code = main(sys.argv[1:])
    from megatron.core import parallel_state

    left = [
        name
        for name, alive in [
            ("torch.distributed", dist.is_initialized()),
            ("megatron parallel state", parallel_state.model_parallel_is_initialized()),
        ]
        if alive
    ]
    print(f"groups after del-train: {', '.join(left) or 'none'}", flush=True)
    sys.exit(code)
