"""The training loop and what it runs: the engines (engines/), the model build, checkpoints
from a run, metrics, schedule, the start-up checks and the memory plan."""
