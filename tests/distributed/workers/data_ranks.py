"""torchrun worker (4 ranks): 2 data-parallel x 2 tensor-parallel, 2 loader workers each.

Each rank builds the loader from megatron's data-parallel coordinates, reads one epoch and
sends its batches to rank 0, which checks that tensor-parallel peers got identical batches
and that each document was read exactly once per data-parallel group.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from del_megatron.data import DataConfig, DataSource, StreamingLoader
from tests.data.streams import documents_of, stream_of
from tests.data.test_loader import _all_documents


def main() -> None:
    manifest = sys.argv[1]
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    cfg = DataConfig(
        sources=[DataSource(manifest=manifest)],
        seq_len=64,
        micro_batch_size=2,
        num_workers=2,
        epochs=1,
    )
    loader = StreamingLoader(cfg, dp_rank, dp_size)
    batches = [{k: v for k, v in b.items()} for b in loader]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dp_rank, tp_rank, batches))
    if dist.get_rank() == 0:
        by_dp: dict[int, list] = {}
        for dp, tp, got in gathered:
            if dp in by_dp:  # a tensor-parallel peer: identical batches
                assert len(got) == len(by_dp[dp])
                for a, b in zip(got, by_dp[dp], strict=True):
                    assert all(torch.equal(a[k], b[k]) for k in a), (dp, tp)
            by_dp[dp] = got
        assert len(by_dp) == 2 and len({len(v) for v in by_dp.values()}) == 1  # equal steps
        eos = loader.manifests[0][1].tokenizer.eos_id
        seen = []
        for got in by_dp.values():
            for worker in range(2):
                seen += documents_of(*stream_of(got[worker::2]), eos)
        expected = _all_documents(__import__("pathlib").Path(manifest))
        assert sorted(seen) == sorted(expected), (len(seen), len(expected))
        print(f"OK {len(seen)} documents, {len(by_dp[0])} batches per rank")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
