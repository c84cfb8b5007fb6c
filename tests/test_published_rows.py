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


def test_a_kept_probe_stands_only_for_the_same_model_file_torch_code_and_spec(tmp_path):
    # MEMPLAN_BENCH_PROBES: a kept probe of examples/llama31.py as it is, under this torch,
    # saved with today's probe key, is read; the same probe of another version of the file
    # (one byte changed: another sha256), or of another torch, or with another key (another
    # probe code or spec), or without its key, or a missing file, is probed again.
    import dataclasses
    import hashlib

    import torch
    from profiles_factory import uniform_chain

    from bench.published import MODEL, ROWS, keep_probe, kept_probe_matches, probe_key, run_spec
    from memplan.model.reference import ModelRef
    from memplan.profile import profile_to_yaml

    today = hashlib.sha256(MODEL.read_bytes()).hexdigest()
    profile = uniform_chain(2).profile()
    env = dataclasses.replace(profile.environment, torch_version=torch.__version__)
    spec = run_spec(ROWS[0])
    key = probe_key(spec, "bf16", 8192)

    def kept(name, sha, environment=env, with_key=key):
        made = tmp_path / "made" / name
        made.parent.mkdir(exist_ok=True)
        model = ModelRef(path=str(MODEL), factory="build_8b", sha256=sha)
        changed = dataclasses.replace(profile, model=model, environment=environment)
        made.write_text(profile_to_yaml(changed))
        keep_probe(made, tmp_path / "kept" / name, with_key)
        return tmp_path / "kept" / name

    assert kept_probe_matches(kept("same.yaml", today), key)
    assert (tmp_path / "kept" / "same.key").read_text() == key
    edited = hashlib.sha256(MODEL.read_bytes() + b" ").hexdigest()
    assert not kept_probe_matches(kept("edited.yaml", edited), key)
    other_torch = dataclasses.replace(env, torch_version="2.6.0")
    assert not kept_probe_matches(kept("torch.yaml", today, other_torch), key)
    # another spec (its efficiencies time the meta clock), precision, sequence or clock
    # (compiled): another key
    faster = dataclasses.replace(spec, efficiency=dataclasses.replace(spec.efficiency, matmul=1.0))
    for other in (
        probe_key(faster, "bf16", 8192),
        probe_key(spec, "float8", 8192),
        probe_key(spec, "bf16", 32768),
        probe_key(spec, "bf16", 8192, compiled=True),
    ):
        assert other != key
        assert not kept_probe_matches(kept("other.yaml", today, with_key=other), key)
    keyless = kept("keyless.yaml", today)
    keyless.with_suffix(".key").unlink()
    assert not kept_probe_matches(keyless, key)
    assert not kept_probe_matches(tmp_path / "missing.yaml", key)
    assert sorted(p.name for p in (tmp_path / "kept").iterdir() if p.name.startswith(".")) == []


def test_the_probe_key_moves_with_memplans_probe_code_only(tmp_path, monkeypatch):
    # A copy of the package's probing sources: one byte more in probe/ (or in devices.py)
    # gives another key; a change to the solver (not probing code) keeps it.
    import shutil

    import memplan
    from bench.published import PROBE_CODE, ROWS, probe_key, run_spec

    root = Path(memplan.__file__).resolve().parent
    copy = tmp_path / "memplan"
    for entry in (*PROBE_CODE, "solver"):
        source = root / entry
        if source.is_dir():
            shutil.copytree(source, copy / entry)
        else:
            shutil.copy(source, copy / entry)
    monkeypatch.setattr(memplan, "__file__", str(copy / "__init__.py"))
    spec = run_spec(ROWS[0])
    key = probe_key(spec, "bf16", 8192)
    solver = next((copy / "solver").glob("*.py"))
    solver.write_bytes(solver.read_bytes() + b"\n")
    assert probe_key(spec, "bf16", 8192) == key
    for changed in (next((copy / "probe").glob("*.py")), copy / "devices.py"):
        changed.write_bytes(changed.read_bytes() + b"\n")
        assert probe_key(spec, "bf16", 8192) != key
        key = probe_key(spec, "bf16", 8192)


def test_the_probe_key_moves_with_the_model_code_llama31_loads(tmp_path, monkeypatch):
    # examples/llama31.py builds its blocks from examples/llama70b.py, and
    # bench/fused_norm_model.py loads llama31.py: one byte more in either gives another key
    # (before, the kept probes' model check hashed the probed model file alone)
    from bench import published

    names = [path.name for path in published.MODEL_CODE]
    assert names == ["llama31.py", "llama70b.py"]
    copies = []
    for path in published.MODEL_CODE:
        copies.append(tmp_path / path.name)
        copies[-1].write_bytes(path.read_bytes())
    monkeypatch.setattr(published, "MODEL_CODE", tuple(copies))
    spec = published.run_spec(published.ROWS[0])
    key = published.probe_key(spec, "bf16", 8192)
    for code in copies:
        code.write_bytes(code.read_bytes() + b"\n")
        assert published.probe_key(spec, "bf16", 8192) != key
        key = published.probe_key(spec, "bf16", 8192)


def test_a_probes_folder_that_cannot_be_kept_fails_before_the_first_probe(tmp_path, monkeypatch):
    # MEMPLAN_BENCH_PROBES under a regular file: no folder can be made there, for root too
    # (CI runs as root, to whom a chmod'ed folder stays writable). The section stops before
    # its first probe with the variable, the path and what to do; before, it probed (minutes)
    # and keep_probe's mkdir then ended it with a bare NotADirectoryError traceback.
    import pytest

    from bench import published

    def too_late(*args, **kwargs):
        raise AssertionError("probed before the folder was checked")

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    bad = blocker / "probes"
    monkeypatch.setenv(published.PROBES_ENV, str(bad))
    monkeypatch.setattr(published, "probe", too_late)
    with pytest.raises(SystemExit) as stopped:
        published.run("cpu")
    message = " ".join(str(stopped.value).split())
    assert message.startswith(f"bench published: MEMPLAN_BENCH_PROBES={bad} names a folder")
    assert "Not a directory" in message
    assert "or unset it to probe every model again and keep nothing." in message
    # a folder that can be written is made, left empty and returned; unset or empty: none
    good = tmp_path / "made" / "probes"
    monkeypatch.setenv(published.PROBES_ENV, str(good))
    assert published.kept_probes_folder() == good
    assert list(good.iterdir()) == []
    monkeypatch.setenv(published.PROBES_ENV, "")
    assert published.kept_probes_folder() is None
    monkeypatch.delenv(published.PROBES_ENV)
    assert published.kept_probes_folder() is None


def test_the_same_recipe_on_both_parts_is_read_from_the_published_rows():
    """Table 1's compile+float8 run (8 H100s at 500 W) and the H200 table's 4 hosts are one
    recipe: the published steps from their TPS, 16,384 tokens a GPU (local batch 2 ×
    8,192) at 8,532 and 10,938, so the H100 step is 10,938 / 8,532 = 1.282× the H200's.
    Given memplan steps of 1.78 and 1.43 s (1.245×), what memplan leaves out costs the H100
    run +3.0%, under half the least shortfall of the bf16 rows (here 16%)."""
    from bench.published import H200_ROWS, ROWS, SAME_RECIPE, same_recipe_line

    rows = {(r.model, r.table, r.techniques): r for r in ROWS + H200_ROWS}
    h100, h200 = (rows[k] for k in SAME_RECIPE)
    assert (h100.local_batch, h100.ac, h100.gpus) == (h200.local_batch, h200.ac, 8)
    assert abs(h100.step_seconds / h200.step_seconds - 10938 / 8532) < 1e-12
    steps = {
        SAME_RECIPE[0]: (1.78, h100.step_seconds),
        SAME_RECIPE[1]: (1.43, h200.step_seconds),
        ("8B", "Table 1", "eager"): (2.39, 2.84),  # 16% short
        ("8B", "Table 1", "compile"): (1.93, 2.46),  # 22% short
    }
    line = same_recipe_line(steps)
    assert "is 1.28× the H200's, memplan's 1.24×" in line, line
    assert "costs the H100 run +3.0%" in line and "16% to 22%" in line, line
    assert "does not explain those rows" in line
    steps[SAME_RECIPE[0]] = (1.60, h100.step_seconds)  # memplan 1.12×: 14% left out
    assert "the cap may explain them" in same_recipe_line(steps)
