"""Issue 10, "nothing silent, nothing lost": each hole an adversarial pass found, reproduced.
Wrong answers (NaN passing a check, impossible profiles, another model's plan), data loss
(device nodes, races, clobbers, permissions, stale temporaries), signals, and crashes that
looked like verdicts."""

import json
import math
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from memplan.cli import app
from memplan.errors import OutputExistsError
from memplan.files.io import write_text_atomic
from memplan.plan import Breakdown, Plan, Prediction, plan_to_yaml

ROOT = Path(__file__).resolve().parent.parent
MODELS = Path(__file__).parent / "models"
MISBEHAVE = str(MODELS / "trust_misbehave.py")
TINY = str(MODELS / "cli_tiny_gpt.py")
GPT_PROFILE = ROOT / "examples" / "ci" / "baselines" / "gpt.profile.yaml"
MEMPLAN = [sys.executable, "-m", "memplan.cli"]
runner = CliRunner()


def invoke(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env=env)


def hand_plan(model: str, *, micro: int = 1, k: int = 4, peak: int = 10**6, **extra) -> Plan:
    return Plan(
        target_batch=micro * k,
        micro_batch_size=micro,
        accumulation_steps=k,
        budget_bytes=10**9,
        predicted=Prediction(
            peak_bytes=peak,
            step_seconds=0.01,
            breakdown=Breakdown(
                params=peak, grads=0, optimizer=0, activations=0, transient=0, reserve=0
            ),
        ),
        model=model,
        **extra,
    )


@pytest.fixture(scope="module")
def small_profile(tmp_path_factory) -> Path:
    """A profile of trust_misbehave.py (two Linear blocks: probes fast)."""
    path = tmp_path_factory.mktemp("trust") / "small.yaml"
    result = invoke("probe", MISBEHAVE, "--device", "cpu", "--micro-batches", "1,2", "-o", path)
    assert result.exit_code == 0, result.output
    return path


# ------------------------------------------------------------------ 2: NaN never passes
@pytest.mark.parametrize(("mode", "needle"), [("nan_loss_at_1", "NaN"), ("nan_grad_at_1", "NaN")])
def test_nan_in_losses_or_gradients_fails_the_gradient_check(monkeypatch, mode, needle):
    from memplan.verify import verify_plan

    monkeypatch.setenv("MEMPLAN_TEST_MISBEHAVE", mode)
    result = verify_plan(MISBEHAVE, hand_plan(MISBEHAVE), steps=1, device="cpu")
    check = result.gradient_check
    assert check.status == "fail", check
    assert "nan" in check.reason.lower()
    assert check.relative_error is None  # not a number that reads as "0.00e+00"
    assert not result.passed
    # The comparison itself, on fresh weights: accumulated micro-batch-1 gradients are NaN
    # while the full batch's are not; max() used to drop the NaN and report 0.00e+00.
    import torch

    from memplan.model.loader import load_model_file
    from memplan.verify.plan_check import check_gradients

    plan = hand_plan(MISBEHAVE)
    direct = check_gradients(load_model_file(MISBEHAVE), plan, torch.device("cpu"), 0)[0]
    assert direct.status == "fail" and needle in direct.reason, direct


def test_nan_loss_during_probe_is_a_warning_naming_the_step(monkeypatch):
    from memplan.probe import probe_model

    monkeypatch.setenv("MEMPLAN_TEST_MISBEHAVE", "nan_loss_at_1")
    profile = probe_model(MISBEHAVE, device="cpu", micro_batches=(1, 2))
    first = [w for w in profile.warnings if "loss was nan at micro-batch 1" in w]
    assert len(first) == 1, profile.warnings
    # the model's layers were finite: the NaN came from the loss's statistics over one sample
    assert "every module's output was finite: it arose in the loss computation" in first[0]


def test_nan_loss_during_probe_names_the_first_layer_that_output_nan(monkeypatch):
    from memplan.probe import probe_model

    monkeypatch.setenv("MEMPLAN_TEST_MISBEHAVE", "nan_in_block_1_at_1")
    profile = probe_model(MISBEHAVE, device="cpu", micro_batches=(1, 2))
    first = [w for w in profile.warnings if "loss was nan at micro-batch 1" in w]
    assert len(first) == 1, profile.warnings
    # block 0 and block 1's Linear were finite; block 1's own forward made the NaN (named,
    # not the Sequential around it, and not 0.lin, whose weights the NaN step spoils later)
    assert "the first layer to output NaN or inf was 1 (Block)" in first[0]


# ------------------------------------------------------------------ 3: data is validated
def _mutated(tmp_path, edit) -> Path:
    data = yaml.safe_load(GPT_PROFILE.read_text())
    edit(data)
    path = tmp_path / "mutated.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d["totals"].update(params_trainable_bytes=-5), "totals.params_trainable_bytes"),
        (lambda d: d["totals"].update(grad_bytes=10**400), "totals.grad_bytes"),
        (lambda d: d["layers"][0]["fwd_seconds"].update(slope=10**400), "fwd_seconds.slope"),
        (lambda d: d["layers"][0]["fwd_seconds"].update(slope=-1.0), "layers[0].fwd_seconds"),
        (lambda d: d["layers"][1]["input_bytes"].update(slope=math.nan), "input_bytes.slope"),
        (lambda d: d["optimizer_step_seconds"].update(intercept=math.inf), "optimizer_step"),
        (lambda d: d["timeline"].update(no_grads=[]), "timeline.no_grads"),
    ],
)
def test_impossible_profiles_exit_2_naming_the_field(tmp_path, edit, field):
    path = _mutated(tmp_path, edit)
    for args in (("show", path), ("solve", path, "--target-batch", 8, "--budget", "24GiB")):
        result = invoke(*args)
        assert result.exit_code == 2, result.output
        assert field in " ".join(result.output.split()), result.output
        assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d["predicted"].update(step_seconds=math.nan), "step_seconds"),
        (lambda d: d.update(device="tpu"), "plan.device"),
        (lambda d: d["predicted"].update(peak_bytes=-1), "peak_bytes"),
    ],
)
def test_impossible_plans_exit_2(tmp_path, edit, field):
    data = yaml.safe_load(plan_to_yaml(hand_plan(TINY)))
    edit(data)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    for args in (("show", path), ("verify", TINY, path)):
        result = invoke(*args)
        assert result.exit_code == 2, result.output
        assert field in " ".join(result.output.split())


def test_a_plan_for_another_model_is_refused_and_old_plans_say_nothing_is_checked(
    small_profile, tmp_path
):
    plan_path = tmp_path / "plan.yaml"
    result = invoke(
        "solve", small_profile, "--target-batch", 4, "--budget", "1GiB", "-o", plan_path
    )
    assert result.exit_code == 0, result.output
    plan = yaml.safe_load(plan_path.read_text())
    # two Linear(8, 8) blocks: 2 × (64 + 8) fp32 parameters
    assert plan["model_fingerprint"] == {
        "parameter_bytes": 2 * (8 * 8 + 8) * 4,
        "candidate_layers": ["0", "1"],
        "hf_blocks": [],  # not a transformers model: HF checkpoints none of its blocks
    }

    result = invoke("verify", TINY, plan_path, "--steps", 1)
    assert result.exit_code == 2, result.output
    assert "made for another model" in " ".join(result.output.split())

    del plan["model_fingerprint"]  # as an older memplan wrote it
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(plan))
    result = invoke("verify", MISBEHAVE, old, "--steps", 1, "--json", "--no-grad-check")
    assert result.exit_code in (0, 1), result.output
    assert "nothing checks" in json.loads(result.stdout)["note"]


# ------------------------------------------------------------------ 4 and 7: file safety
def test_only_regular_files_are_ever_replaced(tmp_path):
    before = os.stat("/dev/null")
    result = invoke("solve", GPT_PROFILE, "--target-batch", 8, "--budget", "24GiB")
    assert result.exit_code == 0
    for target in ("/dev/null", "/dev/full", tmp_path):
        if not os.path.exists(target):
            continue
        result = invoke(
            "solve", GPT_PROFILE, "--target-batch", 8, "--budget", "24GiB", "-o", target, "--force"
        )
        assert result.exit_code == 2, result.output
        assert "not a regular file" in " ".join(result.output.split())
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == before.st_rdev


def test_no_clobber_is_atomic_under_a_race(tmp_path):
    target = tmp_path / "plan.yaml"
    outcomes: list[str] = []
    barrier = threading.Barrier(8)

    def write(i: int) -> None:
        barrier.wait()
        try:
            write_text_atomic(target, f"writer {i}\n")
            outcomes.append("wrote")
        except OutputExistsError:
            outcomes.append("refused")

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["refused"] * 7 + ["wrote"]
    assert target.read_text().startswith("writer ")
    assert [p.name for p in tmp_path.iterdir()] == ["plan.yaml"]  # no temporaries left


def test_replacing_keeps_permission_bits_and_removes_stale_temporaries(tmp_path):
    target = tmp_path / "plan.yaml"
    target.write_text("old\n")
    target.chmod(0o600)
    stale = tmp_path / ".plan.yaml.memplan-999999999-dead.tmp"  # no such pid
    stale.write_text("half")
    live = tmp_path / f".plan.yaml.memplan-{os.getpid()}-alive.tmp"  # a writer still running
    live.write_text("busy")
    write_text_atomic(target, "new\n", force=True)
    assert target.read_text() == "new\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert not stale.exists() and live.exists()


@pytest.mark.parametrize(
    "extra",
    [("--format", "hf,hf"), ("-o", "{dir}/hf_training_args.yaml", "--format", "hf,plan")],
)
def test_duplicate_targets_are_refused_before_anything_is_written(tmp_path, extra):
    args = [a.format(dir=tmp_path) for a in extra]
    result = invoke(
        "solve",
        GPT_PROFILE,
        "--target-batch",
        8,
        "--budget",
        "24GiB",
        "--out-dir",
        tmp_path,
        "--force",
        *args,
    )
    assert result.exit_code == 2, result.output
    assert "same file" in result.output
    assert list(tmp_path.iterdir()) == []


def test_bad_output_paths_fail_before_the_probe(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for output, force in ((a_file / "p.yaml", False), (tmp_path, True)):
        start = time.perf_counter()
        result = invoke("probe", TINY, "--device", "cpu", "-o", output, *(["--force"] * force))
        assert result.exit_code == 2, result.output
        assert "probing" not in result.output
        assert time.perf_counter() - start < 5  # refused, not probed (a probe takes longer)


# ------------------------------------------------------------------ 8: signals
def _wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_ranks_die_with_the_parent_and_leave_no_temporary_folder(tmp_path, small_profile, sig):
    plan_path = tmp_path / "plan2.yaml"
    solved = invoke(
        "solve",
        small_profile,
        "--target-batch",
        8,
        "--budget",
        "1GiB",
        "--world-size",
        2,
        "-o",
        plan_path,
    )
    assert solved.exit_code == 0, solved.output
    tmp = tmp_path / "tmp"
    marks = tmp_path / "marks"
    tmp.mkdir()
    marks.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "MEMPLAN_TEST_STEP_MARKS": str(marks)}
    proc = subprocess.Popen(
        [*MEMPLAN, "verify", MISBEHAVE, str(plan_path), "--steps", "1000000"],
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        # Both ranks are training: from now on they spend their time in gloo's collectives
        # (C++), where the SIGTERM handler of the old death signal never ran.
        assert _wait_for(lambda: len(list(marks.iterdir())) == 2, 120), "the ranks never trained"
        ranks = [int(p.name) for p in marks.iterdir()]
        assert all(_running(pid) for pid in ranks)
        time.sleep(0.5)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    if sig == signal.SIGTERM:
        assert proc.returncode == 143
        assert err.strip().splitlines()[-1] == "interrupted"
        assert "Traceback" not in err
    else:
        assert proc.returncode == -signal.SIGKILL
    assert _wait_for(lambda: not any(_running(pid) for pid in ranks), timeout=10), ranks
    assert _wait_for(lambda: not list(tmp.glob("memplan-dist-*")), timeout=15)
    # and the reaper that removed the folder is gone too
    assert _wait_for(lambda: not _processes_naming(str(tmp)), timeout=10)


def test_run_folders_of_dead_owners_are_swept_and_others_kept(tmp_path):
    from memplan.verify.rank_lifetime import OWNER_FILE, sweep_orphaned_folders

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs
    folders = {}
    for name, owner in (("dead", dead.pid), ("alive", os.getppid()), ("me", os.getpid())):
        folders[name] = tmp_path / f"memplan-dist-{name}"
        folders[name].mkdir()
        (folders[name] / OWNER_FILE).write_text(f"{owner}\n")
        (folders[name] / "rank0.json").write_text("{}")
    starting = tmp_path / "memplan-dist-starting"  # no owner file yet: a run being set up
    starting.mkdir()
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / OWNER_FILE).write_text(f"{dead.pid}\n")
    assert sweep_orphaned_folders(tmp_path) == [folders["dead"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "elsewhere",
        "memplan-dist-alive",
        "memplan-dist-me",
        "memplan-dist-starting",
    ]


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphaned rank is reaped by whoever adopts it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return False
    return stat.rsplit(b")", 1)[1].split()[0] != b"Z"


def _processes_naming(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes() and _running(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_sigint_prints_one_line_and_exits_130(tmp_path):
    proc = subprocess.Popen(
        [*MEMPLAN, "probe", TINY, "--device", "cpu", "--micro-batches", "1,2,4,8,16,32,64"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    time.sleep(2)  # the handler is set within 0.3 s; the probe runs for several seconds
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "interrupted"
    assert "Traceback" not in err


SIZES = "1,2,4,8,16,32,64"


def test_sigint_during_the_progress_display_exits_130_and_restores_the_terminal(tmp_path):
    """The same with the progress display on (FORCE_COLOR makes rich treat stderr as a
    terminal): the display unwinds, the cursor it hid is shown again, one line says so,
    and no profile is left half-written."""
    out = tmp_path / "p.yaml"
    proc = subprocess.Popen(
        [*MEMPLAN, "probe", TINY, "--device", "cpu", "--micro-batches", SIZES, "-o", str(out)],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "FORCE_COLOR": "1"},
    )
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    text = err.decode("utf-8", "replace")
    assert proc.returncode == 130, text
    assert "probing" in text  # the display was on
    assert "\x1b[?25l" in text and text.rindex("\x1b[?25h") > text.rindex("\x1b[?25l")
    assert "interrupted" in text.strip().splitlines()[-1] and "Traceback" not in text
    assert not out.exists()


# ------------------------------------------------------------------ model files that exit
# In a real process (the console script); tests/test_fuzz.py runs every mode in-process.
@pytest.mark.parametrize("mode", ["import_sys_exit_3", "build_os_exit_0"])
def test_a_model_file_cannot_exit_memplan_with_its_own_code(mode):
    env = {**os.environ, "MEMPLAN_TEST_MISBEHAVE": mode}
    done = subprocess.run(
        [*MEMPLAN, "probe", MISBEHAVE, "--device", "cpu", "--micro-batches", "1,2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    how = "os._exit" if "os_exit" in mode else "sys.exit"
    err = " ".join(done.stderr.split())
    assert f"called {how}(" in err and "trust_misbehave.py" in err
    assert "Traceback" not in done.stderr


# ------------------------------------------------------------------ crashes that were verdicts
def test_meta_tensors_from_make_batch_are_a_model_file_error():
    result = invoke(
        "probe", MISBEHAVE, "--device", "cpu", env={"MEMPLAN_TEST_MISBEHAVE": "meta_batch"}
    )
    assert result.exit_code == 2, result.output
    assert "meta tensors" in result.output


def test_rich_markup_in_paths_and_names_is_shown_verbatim(tmp_path):
    folder = tmp_path / "d[" / "]x"
    folder.mkdir(parents=True)
    model = folder / "model[red].py"
    model.write_text(Path(MISBEHAVE).read_text())
    result = invoke("probe", model, "--device", "cpu", "--micro-batches", "1,2")
    assert result.exit_code == 0, result.output
    assert "model[red].py" in result.output.replace("\n", "")


def test_micro_batches_that_cannot_fit_the_machine_are_refused_before_allocating():
    start = time.perf_counter()
    result = invoke("probe", MISBEHAVE, "--device", "cpu", "--micro-batches", "1,100000000000")
    assert result.exit_code == 2, result.output
    assert "is available" in " ".join(result.output.split())
    assert time.perf_counter() - start < 30


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_huge_first_micro_batch_is_estimated_and_refused_before_running_it(device):
    # nothing is measured at the first size yet: a step at micro-batch 2 is scaled instead
    start = time.perf_counter()
    sizes = "100000000000,100000000001"
    result = invoke("probe", MISBEHAVE, "--device", device, "--micro-batches", sizes)
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "size 100000000000 would need about" in text
    assert "scaled from a step at micro-batch 2" in text and "is available" in text
    assert time.perf_counter() - start < 30


def test_a_huge_target_batch_is_factorised_not_trial_divided():
    start = time.perf_counter()
    for target in (10**18, 897612484786617600):  # the second has 103,680 divisors
        result = invoke(
            "solve", GPT_PROFILE, "--target-batch", target, "--budget", "24GiB", "--json"
        )
        assert result.exit_code in (0, 1), result.output
    assert time.perf_counter() - start < 20


@pytest.mark.parametrize(
    "args",
    [
        ("--world-size", "0"),
        ("--tolerance", "-1"),
        ("--tolerance", "nan"),
        ("--timeout", "-5"),
        ("--steps", "0"),
        ("--device", "cuda:7"),
    ],
)
def test_verify_rejects_bad_numbers_and_devices(tmp_path, args):
    plan = tmp_path / "plan.yaml"
    plan.write_text(plan_to_yaml(hand_plan(TINY)))
    result = invoke("verify", TINY, plan, *args)
    assert result.exit_code == 2, result.output
    assert "meta" not in result.output


def test_json_stdout_stays_json_when_user_code_prints():
    result = invoke(
        "probe",
        MISBEHAVE,
        "--device",
        "cpu",
        "--micro-batches",
        "1,2",
        "--json",
        env={"MEMPLAN_TEST_MISBEHAVE": "print_everywhere"},
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["micro_batches"] == [1, 2]
    assert "forward says hi" in result.stderr


def test_json_output_never_holds_nan():
    from memplan import render

    assert render.json_safe({"a": [math.nan, math.inf, 1.5], "b": -math.inf}) == {
        "a": [None, None, 1.5],
        "b": None,
    }


def test_a_plan_too_big_for_the_machine_cannot_be_measured_not_a_model_error(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text(plan_to_yaml(hand_plan(TINY, peak=2**50)))  # 1 PiB
    result = invoke("verify", TINY, plan)
    assert result.exit_code == 3, result.output
    assert "cannot be run here" in " ".join(result.output.split())
    assert "make_batch" not in result.output
