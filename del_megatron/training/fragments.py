"""This data-parallel rank's own piece of a parameter's fp32 master and Adam moments, read
and written without a collective: which flattened range [start, stop) of the parameter's
tensor-parallel shard the rank's ZeRO partition holds, and that range's tensors.

* **ZeRO 1 and 2** (and DeepSpeed's BF16_Optimizer): the flat fp32 partition of a rank
  covers a contiguous range of the parameters of its group laid end to end; DeepSpeed maps
  each parameter that overlaps it to a `tensor_fragment` (`param._hp_mapping`, None where
  the rank holds none of it) whose `lp_fragment_address` (start, numel) is the range in the
  flattened parameter and whose `get_hp_fragment(key)` is the 1-D view of the master (key
  None) or a moment, linked by `layout_free.ensure_adam_state`.
* **ZeRO 3**: every parameter is cut on its own into `partition_numel()` elements per rank
  (the last rank's piece padded past `ds_numel`); rank r (`ds_zero_partition_rank`) holds
  [r * partition_numel, ...), read and written through DeepSpeed's local API
  (`safe_get_local_fp32_param` / `safe_get_local_optimizer_state` and their setters), which
  take and give the padded piece.

DeepSpeed 0.19.8's local API covers ZeRO 3 only; the ZeRO 1/2 fragment mapping is the one
its `safe_get_full_*` reads before it all-reduces (deepspeed/utils/tensor_fragment.py).
"""

from __future__ import annotations

import torch

FP32 = "fp32"  # the master weight's key; the moments are Adam's state keys


def _zero3(param: torch.nn.Parameter) -> bool:
    return hasattr(param, "ds_id")


def owned(param: torch.nn.Parameter) -> tuple[int, int] | None:
    """[start, stop) of the flattened tensor-parallel shard whose master and moments this
    rank's ZeRO partition holds; None where it holds none of the parameter."""
    if _zero3(param):
        size = param.partition_numel()
        start = min(param.ds_zero_partition_rank * size, param.ds_numel)
        stop = min(start + size, param.ds_numel)
    else:
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:
            return None
        start = mapping.lp_fragment_address.start
        stop = start + mapping.lp_fragment_address.numel
    return (start, stop) if stop > start else None


def get(param: torch.nn.Parameter, key: str) -> torch.Tensor:
    """The 1-D [stop - start] master (key "fp32") or moment of this rank's range (`owned`),
    where the optimizer keeps it (a view, not a copy)."""
    start, stop = owned(param)
    if _zero3(param):
        return _local_piece(param, key).narrow(0, 0, stop - start)
    return param._hp_mapping.get_hp_fragment(None if key == FP32 else key)


def put(param: torch.nn.Parameter, key: str, value: torch.Tensor) -> None:
    """Set this rank's range (`owned`) of the master or a moment to the 1-D `value`."""
    start, stop = owned(param)
    if value.shape != (stop - start,):
        raise ValueError(f"a fragment of {stop - start} elements set from {tuple(value.shape)}")
    if _zero3(param):
        from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

        # DeepSpeed's piece is padded to partition_numel: keep what the padding holds
        padded = _local_piece(param, key).clone()
        padded[: stop - start] = value.to(padded.device)
        if key == FP32:
            safe_set_local_fp32_param(param, padded)
        else:
            safe_set_local_optimizer_state(param, padded, key)
        return
    fragment = param._hp_mapping.get_hp_fragment(None if key == FP32 else key)
    fragment.data.copy_(value.to(fragment.device))


def _local_piece(param: torch.nn.Parameter, key: str) -> torch.Tensor:
    """ZeRO 3's whole local piece (partition_numel elements, the padding included)."""
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

    if key == FP32:
        return safe_get_local_fp32_param(param)
    return safe_get_local_optimizer_state(param, key)
