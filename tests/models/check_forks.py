"""A model file that leaves processes behind (#33 item 14): at import it forks a grandchild
that sleeps, and a daemon that leaves the process group (``setsid``) and sleeps; the model
itself is check_small's. `memplan check --json | cat` must end when the check ends: no
process of memplan's or the model's may hold memplan's stdout."""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from check_small import build_model, make_batch, training_loss  # noqa: F401

SLEEP_S = float(os.environ.get("MEMPLAN_TEST_FORK_SLEEP", "60"))

for daemon in (False, True):
    if os.fork() == 0:  # the grandchild: it never returns to the model's code
        if daemon:
            os.setsid()
        time.sleep(SLEEP_S)
        os._exit(0)
