"""How a test's spawned gloo rank leaves once its figures are out.

torch 2.13's gloo can abort a rank's interpreter teardown after a clean
``destroy_process_group`` ("terminate called without an active exception", SIGABRT; CI's
stop 48 lost a run to it in ``test_reserve``). ``mp.spawn`` then reports the rank as
crashed though every figure was written. The emitted training script leaves the same way
(``memplan/emit/script.py``): every rank past a barrier, the group destroyed, then
``os._exit`` without the interpreter's teardown.
"""

from __future__ import annotations

import os
import sys


def leave_gloo(queue=None) -> None:
    """Barrier, destroy the process group, flush, and end the process with exit 0. A
    multiprocessing ``queue`` the rank wrote to is drained to its pipe first (its feeder
    thread would die with ``os._exit``)."""
    import torch.distributed as dist

    dist.barrier()  # no rank tears gloo down while a peer still talks to it
    dist.destroy_process_group()
    if queue is not None:
        queue.close()
        queue.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
