"""Checkpoints that a crash cannot corrupt, and exact resume (layout: docs/checkpoints.md).

Everything of a checkpoint is written under `checkpoints/.tmp-step-NNNNNNN/` and the
directory is renamed to `step-NNNNNNN/` by rank 0 once every rank has finished: a directory
with a final name is always complete, and a killed save leaves only a `.tmp-` directory that
resume ignores (and removes).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch

from .. import collectives
from ..config import ConfigError, dump_run_config
from ..data import StreamingLoader
from ..errors import UserError, one_line

PREFIX = "step-"
TMP_PREFIX = ".tmp-"
DEEPSPEED_TAG = "state"


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be resumed from; the message names the directory."""


def root_of(output_dir: str) -> Path:
    return Path(output_dir) / "checkpoints"


def _versions() -> dict[str, str]:
    import deepspeed
    import megatron.core

    from .. import __version__

    return {
        "del_megatron": __version__,
        "torch": torch.__version__,
        "megatron_core": megatron.core.__version__,
        "deepspeed": deepspeed.__version__,
    }


def save(run: Any, step: int, loader: StreamingLoader | None, *, keep: int) -> Path:
    """Write a complete checkpoint of step `step` and keep the newest `keep`."""
    root = root_of(run.cfg.output_dir)
    name = f"{PREFIX}{step:07d}"
    tmp, final = root / (TMP_PREFIX + name), root / name
    if run.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    collectives.barrier()
    run.engine.save_checkpoint(
        str(tmp), tag=DEEPSPEED_TAG, client_state={"step": step}, save_latest=False
    )
    _save_weights(run, tmp)
    rng = tmp / "rng"
    rng.mkdir(exist_ok=True)
    torch.save(rng_state(run.device), rng / f"rank{run.rank:05d}.pt")
    states = collectives.all_gather_object(loader.state_dict() if loader is not None else None)
    if run.is_main:
        (tmp / "data_state.json").write_text(json.dumps(states))
        (tmp / "run_config.yaml").write_text(dump_run_config(run.cfg))
        meta = {
            "step": step,
            "world_size": run.world,
            "data_parallel": run.dp_size,
            "tensor_parallel": run.cfg.parallel.tensor_parallel,
            "tokens": step * run.cfg.train.global_batch_size * run.cfg.train.seq_len,
            "tokenizer": run.tokenizer.fingerprint,
            "versions": _versions(),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    collectives.barrier()
    if run.is_main:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in complete_checkpoints(root)[:-keep] if keep else []:
            # out of the final namespace first (atomic), then delete: a kill mid-delete
            # leaves a .tmp- directory, never a half-deleted step-N
            doomed = root / (TMP_PREFIX + "old-" + old.name)
            os.replace(old, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
    collectives.barrier()
    return final


def _save_weights(run: Any, directory: Path) -> None:
    """model/tpNN.safetensors from data-parallel rank 0 of each tensor-parallel rank (ZeRO-3
    parameters gathered first), in the training dtype with canonical (local-spec) names,
    arch.json and the tokenizer: what del-convert megatron-to-hf and init.megatron read,
    safe to load (safetensors, no pickle)."""
    import deepspeed
    from megatron.core import parallel_state

    from ..models.weight_files import WEIGHTS, write_rank_weights, write_weights_record

    module = run.engine.module
    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=run.cfg.parallel.zero_stage == 3):
        if run.dp_rank == 0:
            out = directory / WEIGHTS
            out.mkdir(exist_ok=True)
            tp_rank = parallel_state.get_tensor_model_parallel_rank()
            write_rank_weights(out, tp_rank, dict(module.named_parameters()))
            if run.is_main:
                write_weights_record(out, run.cfg.model, run.cfg.tokenizer_path())


def rng_state(device: torch.device) -> dict[str, Any]:
    """This rank's generators: torch's, and on GPU the device's and megatron-core's
    tensor-parallel tracker (dropout inside tensor-parallel regions, recomputation)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "cuda": None}
    if device.type == "cuda":
        from megatron.core import tensor_parallel

        state["cuda"] = torch.cuda.get_rng_state()
        state["cuda_tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state.get("cuda") is not None:
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(state["cuda"])
        if state.get("cuda_tracker"):
            tensor_parallel.get_cuda_rng_tracker().set_states(state["cuda_tracker"])


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    return sorted(
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(PREFIX) and (p / "meta.json").is_file()
    )


def resolve(resume: str, output_dir: str) -> Path | None:
    """'none' -> None; 'auto' -> the newest complete checkpoint (None if there is none);
    anything else is a checkpoint directory that must exist."""
    if resume == "none":
        return None
    if resume == "auto":
        found = complete_checkpoints(root_of(output_dir))
        return found[-1] if found else None
    path = Path(resume)
    if not (path / "meta.json").is_file():
        raise ConfigError(f"--resume {resume}: not a complete checkpoint directory (no meta.json)")
    return path


def check(path: Path, cfg: Any, fingerprint: str, world: int) -> dict[str, Any]:
    """A checkpoint this run can resume from, before anything is loaded (preflight runs it
    too): its metadata, tokenizer, tensor-parallel size and architecture, and the files
    DeepSpeed does not check. Returns meta.json; CheckpointError names the first problem."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        step = int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path}/meta.json: unreadable ({one_line(err)})") from None
    if meta.get("tokenizer") != fingerprint:
        raise CheckpointError(f"{path}: saved with another tokenizer than data.tokenizer")
    if meta.get("tensor_parallel") != cfg.parallel.tensor_parallel:
        raise CheckpointError(
            f"{path}: saved at tensor parallel {meta.get('tensor_parallel')}, this run uses "
            f"{cfg.parallel.tensor_parallel}"
        )
    arch_path = path / "model" / "arch.json"
    try:
        saved = json.loads(arch_path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{arch_path}: unreadable ({one_line(err)})") from None
    for name, value in cfg.model.model_dump(mode="json").items():
        if name in saved and saved[name] != value:
            raise CheckpointError(
                f"{path}: saved with model.{name}={saved[name]}, this run has {value} "
                "(another architecture)"
            )
    try:
        states = json.loads((path / "data_state.json").read_text())
        if not isinstance(states, list) or len(states) != meta.get("world_size"):
            raise ValueError(f"{len(states)} states for {meta.get('world_size')} ranks")
    except (OSError, ValueError, TypeError) as err:
        raise CheckpointError(f"{path}/data_state.json: unreadable ({one_line(err)})") from None
    if meta.get("world_size") == world:
        for rank in range(world):
            rng = path / "rng" / f"rank{rank:05d}.pt"
            if not rng.is_file():
                raise CheckpointError(f"{rng}: missing")
    meta["step"] = step
    return meta


def load(run: Any, path: Path, loader: StreamingLoader | None) -> int:
    """Restore model, optimizer, scheduler, RNG and this rank's loader; returns the step."""
    meta = check(path, run.cfg, run.tokenizer.fingerprint, run.world)
    same_layout = meta.get("data_parallel") == run.dp_size
    try:
        if same_layout:
            loaded, _ = run.engine.load_checkpoint(
                str(path),
                tag=DEEPSPEED_TAG,
                load_optimizer_states=True,
                load_lr_scheduler_states=True,
                load_module_strict=True,
            )
        else:
            # ZeRO's optimizer partitions are laid out for the saved data-parallel size and
            # DeepSpeed cannot re-partition them: take the weights, restart the moments.
            loaded, _ = run.engine.load_checkpoint(
                str(path), tag=DEEPSPEED_TAG, load_module_only=True
            )
            refresh = getattr(run.engine.optimizer, "refresh_fp32_params", None)
            if refresh is not None:
                refresh()  # ZeRO 1/2 keep their own fp32 copy of the weights
            for _ in range(int(meta["step"])):
                run.scheduler.step()
    except Exception as err:  # DeepSpeed raises whatever its torch.load or asserts raise
        raise CheckpointError(
            f"{path}: cannot load the model/optimizer state "
            f"({type(err).__name__}: {str(err).splitlines()[0][:200]})"
        ) from None
    if loaded is None:
        raise CheckpointError(f"{path}: no DeepSpeed state under tag '{DEEPSPEED_TAG}'")
    if not same_layout and run.is_main:
        print(
            f"resuming at data-parallel size {run.dp_size} (saved at {meta.get('data_parallel')}):"
            " weights and schedule restored, optimizer moments restarted, data continues at "
            "the next epoch",
            flush=True,
        )
    if meta.get("world_size") == run.world:
        rng_path = path / "rng" / f"rank{run.rank:05d}.pt"
        try:
            # RNG states are host byte tensors whatever the device (map_location: a state
            # file never lands on a GPU the loading rank may not have)
            rng = torch.load(rng_path, weights_only=True, map_location="cpu")
            set_rng_state(rng, run.device)
        except (OSError, RuntimeError, KeyError, TypeError, pickle.UnpicklingError) as err:
            raise CheckpointError(f"{rng_path}: unreadable ({one_line(err)[:200]})") from None
    if loader is not None:
        states = json.loads((path / "data_state.json").read_text())  # checked above
        message = loader.resume(states)  # any layout and data mix: what changed, in a line
        if message and run.is_main:
            print(message, flush=True)
    return int(meta["step"])


def remove_partial(output_dir: str) -> None:
    """Drop directories of saves that never completed (rank 0)."""
    root = root_of(output_dir)
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True)
