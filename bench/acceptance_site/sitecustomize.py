"""For bench/gpu_acceptance.py's one-rank-collectives check: counts, in every Python process of
a command run with this directory first on PYTHONPATH and DEL_COUNT_COLLECTIVES set to a
directory, the torch.distributed collectives that del_megatron/collectives.py calls on
one-process groups, and writes them there at the process's exit as <pid>.json ({name: count}).
Without the variable it does nothing but hand over to the interpreter's own sitecustomize,
if there is one (which this module would otherwise hide)."""

import importlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RULE = os.path.join("del_megatron", "collectives.py")
NAMES = ("all_reduce", "all_gather", "all_gather_object", "gather_object", "barrier")


def _count_into(directory: str) -> None:
    import atexit
    import json

    import torch.distributed as dist

    counts: dict[str, int] = {}

    def counting(name, call):
        def counted(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.endswith(RULE) and dist.get_world_size(kwargs.get("group")) == 1:
                counts[name] = counts.get(name, 0) + 1
            return call(*args, **kwargs)

        return counted

    for name in NAMES:
        setattr(dist, name, counting(name, getattr(dist, name)))

    def write() -> None:
        if counts:
            with open(os.path.join(directory, f"{os.getpid()}.json"), "w") as f:
                json.dump(counts, f)

    atexit.register(write)


def _the_next_sitecustomize() -> None:
    # this module is being imported as "sitecustomize": the import machinery reads it back from
    # sys.modules when it finishes, so it goes back there unless another one took the name
    ours = sys.modules.pop("sitecustomize", None)
    path, sys.path[:] = list(sys.path), [p for p in sys.path if os.path.abspath(p or ".") != HERE]
    try:
        importlib.import_module("sitecustomize")
    except ImportError:
        pass
    finally:
        sys.path[:] = path
        sys.modules.setdefault("sitecustomize", ours)


if os.environ.get("DEL_COUNT_COLLECTIVES"):
    _count_into(os.environ["DEL_COUNT_COLLECTIVES"])
_the_next_sitecustomize()
