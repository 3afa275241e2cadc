"""Checkpoints: written behind training, resumed at any layout and by either engine. The
package takes data, not a trainer: a save or a load is handed the layout, this rank's place
in it, the engine's adapter and the scheduler (`parts.Parts`), and imports nothing of
training/ and no global parallel state (tests/checkpoint/test_package_alone.py saves and
loads from tensors and a layout alone).

Read in this order (each module one job; docs/checkpoints.md has the format and guarantees):

1. `directory.py`: where checkpoints live, which are complete, which one a resume means.
2. `files.py`: files.json (every file's size and SHA-256), headers, verification.
3. `optim_format.py`: the layout-free optimizer state on disk, no engine in it.
4. `layout.py`: the run's parallel layout (`Layout`) and this rank's place (`Place`).
5. `adapter.py`: what a checkpoint needs of an engine (`Adapter`, `NativeState`); the
   adapters live beside their engines (training/engines/).
6. `native.py`: an engine's own state's files (DeepSpeed's), for the checks.
7. `parts.py`: what a save or a load is handed (`Parts`, rank 0's `Record`).
8. `optim_state.py`: a rank's part of the layout-free state, saved and loaded through the
   adapter.
9. `rng.py`: each rank's generators, and the seed of a resume at another layout.
10. `host.py`: a save's host copies, queued into page-locked memory, waited for once.
11. `save.py`: the training thread's half of a save (collectives and host copies).
12. `writer.py`: the files written behind training (no collective).
13. `publish.py`: the agreement, files.json, the rename, old checkpoints out.
14. `load.py`: the layout rules, the checks before a load, the load.

What may change when a run continues is training's (training/resume_changes.py). Callers
import the module they need (`from del_megatron.checkpoint import save`); nothing is
re-exported here.
"""
