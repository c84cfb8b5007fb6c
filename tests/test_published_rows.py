"""The published context-parallel rows (bench/published.py, Tables 2 and 6 of torchtitan's
benchmarks/llama3_h100_202412_torchtitan.md): their data-parallel degree and the step time
read from the published tokens per second per GPU, as torchtitan 9dec370's train.py counts
them (the local batch's labels before CP splits them, over cp·tp·pp GPUs)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.published import CP_ROWS


def test_context_parallel_rows_step_from_published_tps():
    rows = {(r.model, r.cp): r for r in CP_ROWS}
    assert len(rows) == 8
    # Table 2, FSDP 4 × CP 2 at 65,536 tokens, local batch 1: 65,536 tokens a data-parallel
    # rank over 2 GPUs, 32,768 a GPU at 2,540 TPS: 12.90 s
    t2 = rows[("8B", 2)]
    assert (t2.dp, t2.seq) == (4, 65536)
    assert abs(t2.step_seconds - 32768 / 2540) < 1e-9
    # Table 6, FSDP 1 × TP 8 × PP 8 × CP 8 at 262,144, local batch 8: 8 × 262,144 tokens
    # over 512 GPUs, 4,096 a GPU at 16 TPS: 256 s
    t6 = rows[("405B", 8)]
    assert (t6.dp, t6.micro, t6.local_batch) == (1, 1, 8)
    assert t6.step_seconds == 4096 / 16
    # every rank runs 32,768 tokens a sample: S / cp is the same in each table
    assert {r.seq // r.cp for r in CP_ROWS} == {32768}
