"""The space check before a save: rank 0 alone walks the newest checkpoint's files (a 7B
checkpoint holds thousands), the others take its figure. Failed on the code before: every
rank walked them at every save."""

from __future__ import annotations

from del_megatron.checkpoint import save
from del_megatron.checkpoint.layout import Layout, Place
from del_megatron.checkpoint.parts import Parts


def test_only_rank_0_walks_the_last_checkpoint(tmp_path, monkeypatch):
    walked = []
    monkeypatch.setattr(save, "complete_checkpoints", lambda root: walked.append(root) or [])
    monkeypatch.setattr(save.collectives, "all_gather_object", lambda obj: [(123, None), obj])

    def parts(rank: int) -> Parts:
        return Parts(
            layout=Layout("deepspeed", tensor_parallel=1, data_parallel=2),
            place=Place(rank=rank, world=2),
            adapter=None,
            scheduler=None,
            device=None,
            vocab_size=0,
        )

    assert save.check_space(parts(1), tmp_path, True) == 123  # rank 0's figure
    assert walked == []
