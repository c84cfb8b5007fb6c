"""docs/contract.md's exit codes where a model file or a number could decide them (#10): a
model file cannot exit memplan with its own code, crashes are not verdicts (meta tensors
from make_batch, sizes past the machine, huge batches), bad numbers are exit 2, and --json
stays JSON. Signals, file safety, validation and NaN have their own files
(test_signals.py, test_files_io.py, test_validation.py, test_nonfinite.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from plan_factory import hand_plan
from typer.testing import CliRunner

from memplan.cli import app
from memplan.plan import plan_to_yaml

ROOT = Path(__file__).resolve().parent.parent
MODELS = Path(__file__).parent / "models"
MISBEHAVE = str(MODELS / "trust_misbehave.py")
TINY = str(MODELS / "cli_tiny_gpt.py")
GPT_PROFILE = ROOT / "examples" / "ci" / "baselines" / "gpt.profile.yaml"
MEMPLAN = [sys.executable, "-m", "memplan.cli"]
runner = CliRunner()


def invoke(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env=env)


# ------------------------------------------------------------------ model files that exit
# In a real process (the console script); tests/test_fuzz.py runs every mode in-process.
@pytest.mark.parametrize("mode", ["import_sys_exit_3", "build_os_exit_0", "loss_posix_exit_0"])
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
    how = "sys.exit" if "sys_exit" in mode else "os._exit"  # posix._exit is os._exit
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


# ------------------------------------------------------------------ a loss with nothing to train
_NO_GRAD_LOSS = """
import torch
from torch import nn

def build_model():
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))

def make_batch(batch_size):
    return torch.randn(batch_size, 4)

def training_loss(model, batch):
    {body}
"""


@pytest.mark.parametrize(
    "body",
    [
        "return model(batch).sum().detach()",
        "return torch.tensor(1.0)",
        "with torch.no_grad():\n        return model(batch).sum()",
    ],
)
@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_a_loss_no_parameter_reaches_is_a_model_file_error(tmp_path, body, device):
    # before: autograd's RuntimeError ("element 0 of tensors does not require grad") as a
    # traceback, exit 1 (the "does not fit" code)
    path = tmp_path / "nograd.py"
    path.write_text(_NO_GRAD_LOSS.format(body=body))
    result = invoke("probe", path, "--device", device, "-o", tmp_path / "p.yaml")
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "training_loss(model, batch) is a loss that no trainable parameter reaches" in text
    assert "Traceback" not in result.output and not (tmp_path / "p.yaml").exists()


def test_plan_model_refuses_a_loss_no_parameter_reaches():
    import torch

    import memplan
    from memplan.errors import ModelFileError

    model = torch.nn.Linear(4, 1)
    with pytest.raises(ModelFileError, match=r"constant\(model, batch\) is a loss that no"):

        def constant(model, batch):
            return torch.tensor(1.0)

        memplan.plan_model(
            model, torch.randn(4, 4), loss_fn=constant, budget="1GiB", target_batch=4
        )
