"""torchrun worker: del-train with one rank's checkpoint writer held at one step.

DEL_TEST_HOLD="<rank>:<step>:<marker file>": that rank's writer of the checkpoint of that
step touches the marker and sleeps instead of writing (the other ranks' writers and every
other save run as they do), so a test can kill the run while a background write is, for
certain, unfinished. Arguments: del-train's.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from del_megatron.checkpoint import directory, writer
from del_megatron.cli.train import main

RANK, STEP, MARKER = os.environ["DEL_TEST_HOLD"].split(":", 2)
real_run = writer._run


def held_run(jobs, writing, directories) -> None:
    held_dir = directory.TMP_PREFIX + f"{directory.PREFIX}{int(STEP):07d}"
    # the staging is the job's own, `.tmp-step-N-TOKEN` (checkpoint/directory.staging_of)
    if os.environ["RANK"] == RANK and directories[0].name.startswith(held_dir + "-"):
        Path(MARKER).touch()
        time.sleep(3600)
    real_run(jobs, writing, directories)


writer._run = held_run

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
