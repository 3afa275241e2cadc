"""A warm fork server for test ranks: imports once, forks a fresh rank per request.

A rank of a test launch spends about 5 s of CPU importing torch, megatron-core, DeepSpeed and
the package before a second of work (docs/benchmarks.md, "Test suite"). This process imports
them once (`PRELOAD`), checks that it is still one thread, and then, for each request from
tests/distributed/launcher.py, forks a child that becomes the rank a fresh interpreter under
torchrun would be: its own session, stdin from /dev/null, stdout and stderr into the files
the client named, the exact environment (RANK, WORLD_SIZE, MASTER_PORT, ... as torchrun sets
them), the working directory, `sys.argv`, `sys.path[0]` as `python script.py` or `python -m`
sets it, the signal dispositions Python starts with, fresh random seeds where a fresh
interpreter would draw them; then runs the worker as `__main__` and ends as an interpreter
ends (non-daemon threads joined, atexit handlers run, output flushed).

The server itself never runs test code, so nothing a rank does (megatron's parallel_state,
RNG trackers, DeepSpeed's state, the environment) can reach the next one: each is a fork of
the same just-imported state.

One difference the fork cannot carry is interpreter finalization: a gloo process group alive
as a real interpreter finalizes can abort the process (pytorch/pytorch#190489; CI saw it).
A rank that ends with a process group still initialized is therefore failed here
(`GROUP_LEFT_EXIT`, saying why), so a worker that would abort at exit in a real process
fails in this one too.

Protocol (one Unix stream connection per rank): the client sends one JSON line {"target",
"args", "env", "cwd", "stdout", "stderr"}; the server answers "pid N" once forked and
"exit S" when the rank has ended (S the exit status, or -SIG when a signal ended it). The
server ends, killing its ranks, when its standard input closes (the test session ended).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys
import time

# Everything a worker under tests/distributed/workers imports that costs start-up time.
PRELOAD = (
    "torch",
    "torch.distributed",
    "numpy",
    "megatron.core",
    "megatron.core.models.gpt",
    "megatron.core.pipeline_parallel",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "deepspeed",
    "safetensors.torch",
    "sentencepiece",
    "webdataset",
    "transformers",
    "del_megatron",
    "del_megatron.cli.train",
    "del_megatron.cli.eval",
    "del_megatron.cli.convert",
    "del_megatron.training.trainer",
    "del_megatron.training.engines.deepspeed",
    "del_megatron.training.engines.megatron",
    "del_megatron.models",
    "del_megatron.evaluation",
)
# Variables read when those modules are imported (or by the interpreter at start): a request
# whose value differs from the server's cannot be served warm; the launcher runs it cold.
IMPORT_TIME_PREFIXES = ("PYTHON", "OMP_", "MKL_", "DS_", "CUDA_", "NVTE_", "TORCH_", "LD_")
GROUP_LEFT_EXIT = 70  # EX_SOFTWARE: the worker is at fault


def import_time_environment(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)}


def preload() -> dict[str, tuple[str | None, str]]:
    """Import PRELOAD; return what the imports changed in the environment (name -> (before,
    after)): megatron-core places TorchInductor's cache, DeepSpeed sets
    PYTORCH_NVML_BASED_CUDA_CHECK, and a fresh rank has them set the same way."""
    import importlib

    before = dict(os.environ)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # not in this environment (DeepSpeed in .venv312), or fails to import:
            continue  # a rank that imports it meets the same error as a fresh interpreter
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:  # fork copies only the calling thread: locks held by others stay held
        raise RuntimeError(f"the fork server has {threads} threads after its imports; it must "
                           "have one to fork safely")
    return {k: (before.get(k), v) for k, v in os.environ.items() if before.get(k) != v}


def become_rank(request: dict, conn: socket.socket, set_by_imports: dict) -> None:
    """In the forked child: turn into the rank a fresh interpreter would be, run it, exit."""
    conn.close()
    os.setsid()  # as torchrun starts its workers: a signal to the test's group misses them
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # what Python starts with
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.close(stdin)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for name, (before, after) in set_by_imports.items():
        if request["env"].get(name) == before:  # what the imports would set in this rank too
            os.environ[name] = after
    target, args = request["target"], request["args"]
    module = target[3:] if target.startswith("-m ") else None
    sys.argv = [target if module is None else module, *args]
    # python script.py puts the script's folder first; python -m the working directory
    sys.path[0] = os.getcwd() if module else os.path.dirname(os.path.abspath(target))

    import random

    import numpy
    import torch

    # a fresh interpreter seeds each global generator from the system's entropy: so does the
    # rank (random reseeds itself at fork; numpy's and torch's do not)
    random.seed()
    numpy.random.seed()
    torch.seed()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    status = run(module, target)
    os._exit(status)


def run(module: str | None, target: str) -> int:
    import atexit
    import runpy
    import threading
    import traceback

    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
        status = 0
    except SystemExit as stop:
        status = exit_status(stop.code)
    except BaseException:
        traceback.print_exc()
        status = 1
    # as Py_FinalizeEx: wait for non-daemon threads (a checkpoint writer), then atexit
    threading._shutdown()
    atexit._run_exitfuncs()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        print(
            f"warm rank (tests/distributed/fork_server.py): {target} ended with its process "
            "group alive; a real interpreter can abort at exit then (pytorch/pytorch#190489): "
            "end it (del_megatron.parallel.end_distributed)",
            file=sys.stderr,
        )
        status = status or GROUP_LEFT_EXIT
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    return status


def exit_status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)  # sys.exit("message"): printed, status 1
    return 1


def serve(path: str, set_by_imports: dict) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(sys.stdin, selectors.EVENT_READ, "parent")
    ranks: dict[int, socket.socket] = {}  # pid -> its client's connection
    pending: dict[socket.socket, bytes] = {}
    print("ready", flush=True)
    try:
        while True:
            for key, _ in selector.select(timeout=0.05):
                if key.data == "parent":
                    if not os.read(sys.stdin.fileno(), 4096):
                        return  # the test session ended
                elif key.data == "accept":
                    conn, _ = listener.accept()
                    pending[conn] = b""
                    selector.register(conn, selectors.EVENT_READ, "request")
                else:
                    conn = key.fileobj
                    chunk = conn.recv(65536)
                    pending[conn] += chunk
                    if not chunk or pending[conn].endswith(b"\n"):
                        selector.unregister(conn)
                        data = pending.pop(conn)
                        if not chunk and not data.endswith(b"\n"):
                            conn.close()
                            continue
                        pid = os.fork()
                        if pid == 0:  # the rank keeps no descriptor of the server's
                            for other in [listener, *ranks.values(), *pending]:
                                other.close()
                            selector.close()
                            become_rank(json.loads(data), conn, set_by_imports)
                        ranks[pid] = conn
                        conn.sendall(f"pid {pid}\n".encode())
            reap(ranks)
    finally:
        for pid in ranks:  # the session is over: no rank outlives it
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.unlink(path)


def reap(ranks: dict[int, socket.socket]) -> None:
    while ranks:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = ranks.pop(pid, None)
        if conn is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        try:
            conn.sendall(f"exit {code}\n".encode())
        except OSError:
            pass  # the client gave up on it
        conn.close()


def main() -> None:
    started = time.monotonic()
    set_by_imports = preload()
    print(f"preloaded in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    serve(sys.argv[1], set_by_imports)


if __name__ == "__main__":
    main()
