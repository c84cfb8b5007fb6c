"""The model-file contract: what loads, and a clear ModelFileError for every way to break it."""

from pathlib import Path

import pytest
import torch

from memplan.errors import EXIT_BAD_INPUT, ModelFileError
from memplan.model.batch import move_batch
from memplan.model.loader import load_model_file
from memplan.model.reference import split_model_arg

GOOD = """
import torch
from torch import nn

def build_model():
    return nn.Linear(4, 1)

def other_factory():
    return nn.Sequential(nn.Linear(4, 2), nn.Linear(2, 1))

def make_batch(batch_size):
    return torch.randn(batch_size, 4)

def training_loss(model, batch):
    return model(batch).mean()
"""


def write(tmp_path: Path, text: str, name: str = "model.py") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def load_error(spec: str) -> ModelFileError:
    with pytest.raises(ModelFileError) as info:
        mf = load_model_file(spec)
        model = mf.build_model()
        batch = mf.make_batch(2)
        mf.loss(model, batch)
    assert info.value.exit_code == EXIT_BAD_INPUT
    return info.value


def test_good_file_loads_and_runs(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    mf = load_model_file(str(path))
    model = mf.build_model()
    loss = mf.loss(model, mf.make_batch(3))
    assert loss.dim() == 0
    assert len(mf.sha256) == 64
    assert isinstance(mf.make_optimizer(model), torch.optim.AdamW)
    other = load_model_file(f"{path}:other_factory")
    assert other.factory == "other_factory"
    assert isinstance(other.build_model(), torch.nn.Sequential)


def test_split_model_arg() -> None:
    assert split_model_arg("a/model.py:make") == ("a/model.py", "make")
    assert split_model_arg("a/model.py") == ("a/model.py", "build_model")


def test_move_batch_keeps_structure() -> None:
    batch = {"x": torch.zeros(2), "y": (torch.ones(1), torch.ones(1))}
    moved = move_batch(batch, "meta")
    assert moved["x"].device.type == "meta" and moved["y"][1].device.type == "meta"


def test_missing_file(tmp_path: Path) -> None:
    err = load_error(str(tmp_path / "nope.py"))
    assert "nope.py" in err.message and "does not exist" in err.message


def test_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "import torch\n\ndef build_model(:\n    pass\n")
    err = load_error(str(path))
    assert f"{path}:3" in err.message and "syntax error" in err.message


def test_exception_at_import_names_user_line(tmp_path: Path) -> None:
    path = write(tmp_path, "x = 1\nraise ValueError('broken config')\n")
    err = load_error(str(path))
    assert f"{path}:2" in err.message and "ValueError: broken config" in err.message
    assert "memplan" not in err.message.replace(str(tmp_path), "")


def test_exception_inside_build_model_names_user_line(tmp_path: Path) -> None:
    text = GOOD.replace("    return nn.Linear(4, 1)", "    return nn.Linear(4, undefined_name)")
    path = write(tmp_path, text)
    err = load_error(str(path))
    assert (
        f"{path}:6" in err.message and "NameError" in err.message and "build_model" in err.message
    )


@pytest.mark.parametrize("missing", ["build_model", "make_batch"])
def test_missing_required_function(tmp_path: Path, missing: str) -> None:
    path = write(tmp_path, GOOD.replace(f"def {missing}(", f"def renamed_{missing}("))
    err = load_error(str(path))
    assert f"`{missing}`" in err.message and str(path) in err.message


def test_missing_selected_factory(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    err = load_error(f"{path}:no_such_factory")
    assert "no_such_factory" in err.message


def test_make_batch_not_tensors(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.replace("return torch.randn(batch_size, 4)", "return [1, 2, 3]"))
    err = load_error(str(path))
    assert "make_batch(2)" in err.message and "tensor" in err.message


def test_output_not_a_scalar_loss_names_training_loss(tmp_path: Path) -> None:
    text = GOOD[: GOOD.index("def training_loss")]
    path = write(tmp_path, text)  # the model returns a (2, 1) tensor, no .loss
    err = load_error(str(path))
    assert "not a scalar loss" in err.message and "training_loss" in str(err)


def test_model_output_with_loss_attribute_is_accepted(tmp_path: Path) -> None:
    text = GOOD[: GOOD.index("def training_loss")].replace(
        "    return nn.Linear(4, 1)\n",
        "    class M(nn.Module):\n"
        "        def __init__(self):\n"
        "            super().__init__()\n"
        "            self.fc = nn.Linear(4, 1)\n"
        "        def forward(self, x):\n"
        "            return {'loss': self.fc(x).mean()}\n"
        "    return M()\n",
    )
    mf = load_model_file(str(write(tmp_path, text)))
    model = mf.build_model()
    assert mf.loss(model, mf.make_batch(2)).dim() == 0


def test_no_trainable_parameters(tmp_path: Path) -> None:
    text = GOOD.replace(
        "    return nn.Linear(4, 1)", "    return nn.Linear(4, 1).requires_grad_(False)"
    )
    err = load_error(str(write(tmp_path, text)))
    assert "no trainable parameters" in err.message and "build_model" in err.message


def test_build_model_not_a_module(tmp_path: Path) -> None:
    text = GOOD.replace("    return nn.Linear(4, 1)", "    return 42")
    err = load_error(str(write(tmp_path, text)))
    assert "not a torch.nn.Module" in err.message


@pytest.mark.parametrize(
    ("signature", "takes"),
    [
        ("batch_size", False),
        ("batch_size, seq_len", True),
        ("batch_size, seq_len=128", True),
        ("batch_size, /, seq_len", True),
        ("*args", True),
        ("batch_size, *, seq_len=128", False),
        ("batch_size, **kwargs", False),
    ],
)
def test_make_batch_takes_a_length_by_its_signature(tmp_path: Path, signature, takes) -> None:
    """Issue 13: a second positional parameter is the sequence length."""
    path = tmp_path / "m.py"
    path.write_text(
        "import torch\n"
        "def build_model():\n    return torch.nn.Linear(2, 1)\n"
        f"def make_batch({signature}):\n"
        "    given = dict(locals())\n"
        "    args = given.get('args') or (given.get('batch_size'), given.get('seq_len') or 3)\n"
        "    return torch.ones(args[0], args[1] if len(args) > 1 else 3, 2)\n"
    )
    mf = load_model_file(path)
    assert mf.takes_seq_len is takes
    if takes:
        assert tuple(mf.at_seq_len(7).make_batch(2).shape) == (2, 7, 2)
        assert mf.at_seq_len(None) is mf
    else:
        assert mf.make_batch(2).shape[0] == 2
        with pytest.raises(ModelFileError, match=r"make_batch\(batch_size, seq_len\)") as info:
            mf.at_seq_len(64)
        assert "m.py" in str(info.value)
