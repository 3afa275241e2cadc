"""Checkpoints: written behind training, resumed at any layout and by either engine.

Read in this order (each module one job; docs/checkpoints.md has the format and guarantees):

1. `directory.py`: where checkpoints live, which are complete, which one a resume means.
2. `files.py`: files.json (every file's size and SHA-256), headers, verification.
3. `optim_format.py`: the layout-free optimizer state on disk, no engine in it.
4. `engines/`: how each engine's optimizer holds that state (`Adapter`): DeepSpeed's ZeRO
   partitions, megatron-core's optimizers over a pipeline stage.
5. `optim_state.py`: a rank's part of the layout-free state, saved and loaded through the
   adapter.
6. `rng.py`: each rank's generators, and the seed of a resume at another layout.
7. `save.py`: the training thread's half of a save (collectives and host copies).
8. `writer.py`: the files written behind training (no collective).
9. `publish.py`: the agreement, files.json, the rename, old checkpoints out.
10. `load.py`: the layout rules, the checks before a load, the load.
11. `changes.py`: what may change on resume, one table.

Callers import the module they need (`from del_megatron.checkpoint import save`); nothing is
re-exported here.
"""
