"""torchrun worker (`-m tests.evaluation.pipeline_ranks OUT`): the teacher-forced loop on 2
ranks, each scoring every other batch of one seeded set, reduced over the world group; rank 0
also runs the same batches alone (group None) and writes both metrics to OUT."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from del_megatron import DigitVocab
from del_megatron.evaluation import batch_statistics, numeric_metrics, teacher_forced

V = 30
VOCAB = DigitVocab(digit_ids=list(range(10, 20)), point_ids=[20], vocab_size=V)


def batches() -> list[dict[str, torch.Tensor]]:
    """6 batches [2, 24] mostly of digits and points, random logits, some positions masked."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(6):
        labels = torch.randint(8, 22, (2, 24), generator=gen)
        out.append(
            {
                "logits": 3 * torch.randn(2, 24, V, generator=gen),
                "labels": labels,
                "loss_mask": (torch.rand(2, 24, generator=gen) > 0.2).float(),
            }
        )
    return out


def score(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    stats = batch_statistics(batch["logits"], batch["labels"], batch["loss_mask"], VOCAB)
    return {**stats, "pair": torch.stack([stats["nll"], stats["tokens"]])}  # [sum, count]


def metrics(sums: dict) -> dict:
    return {**numeric_metrics(sums), "pair": sums["pair"]}


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cpu = torch.device("cpu")
    mine = batches()[rank::world]
    ranks = teacher_forced(mine, score, metrics, device=cpu, group=dist.group.WORLD)
    if rank == 0:
        alone = teacher_forced(batches(), score, metrics, device=cpu)
        result = {"ranks": ranks.metrics, "alone": alone.metrics, "batches": ranks.batches}
        out.write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
