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


def test_a_kept_probe_stands_only_for_the_same_model_file_and_torch(tmp_path):
    # MEMPLAN_BENCH_PROBES: a kept probe of examples/llama31.py as it is, under this torch,
    # is read; the same probe of another version of the file (one byte changed: another
    # sha256), or of another torch, or a missing file, is probed again.
    import dataclasses
    import hashlib

    import torch
    from profiles_factory import uniform_chain

    from bench.published import MODEL, kept_probe_matches
    from memplan.model.reference import ModelRef
    from memplan.profile import profile_to_yaml

    today = hashlib.sha256(MODEL.read_bytes()).hexdigest()
    profile = uniform_chain(2).profile()
    env = dataclasses.replace(profile.environment, torch_version=torch.__version__)

    def kept(name, sha, environment=env):
        path = tmp_path / name
        model = ModelRef(path=str(MODEL), factory="build_8b", sha256=sha)
        changed = dataclasses.replace(profile, model=model, environment=environment)
        path.write_text(profile_to_yaml(changed))
        return path

    assert kept_probe_matches(kept("same.yaml", today))
    edited = hashlib.sha256(MODEL.read_bytes() + b" ").hexdigest()
    assert not kept_probe_matches(kept("edited.yaml", edited))
    other_torch = dataclasses.replace(env, torch_version="2.6.0")
    assert not kept_probe_matches(kept("torch.yaml", today, other_torch))
    assert not kept_probe_matches(tmp_path / "missing.yaml")
