"""What several commands share: option declarations (one ``Annotated`` alias per option,
so that its flag and help are written once), the parsing of list and number options, and
the guard around a call that runs the user's model file."""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

from memplan.emit import FORMATS
from memplan.errors import BadInputError

FORMATS_HELP = f"Comma-separated: {', '.join(FORMATS)}."

ModelArgument = Annotated[
    str,
    typer.Argument(
        help="Model file (model.py or model.py:factory), or hf:PATH_OR_ID (a Hugging "
        "Face config; with --task and --seq-len)."
    ),
]
TaskOption = Annotated[
    str | None,
    typer.Option(help="hf: references: causal-lm, seq2seq-lm, seq-cls or masked-lm."),
]
SeqLenOption = Annotated[
    int | None, typer.Option("--seq-len", help="hf: references: tokens per sample.")
]
LoraOption = Annotated[
    str | None,
    typer.Option(help="hf: references: peft LoRA, e.g. r=16,alpha=32,targets=q_proj,v_proj."),
]
JsonOption = Annotated[
    bool, typer.Option("--json", help="Print the result as one JSON object on stdout.")
]
ForceOption = Annotated[bool, typer.Option("--force", help="Overwrite existing output files.")]
DeviceProfileOption = Annotated[
    str | None,
    typer.Option(
        "--device-profile",
        help="GPU spec (see `memplan devices`): to plan for, or to time a meta probe against.",
    ),
]
OutputOption = Annotated[
    Path | None,
    typer.Option(
        "-o", "--output", help="The file to write: the profile, plan, report or memplan.yaml."
    ),
]
BudgetOption = Annotated[
    str | None,
    typer.Option(
        "--budget", help="Memory per rank: 24GiB, 512MiB, bytes, 80% (of device memory) or auto."
    ),
]
TargetBatchOption = Annotated[
    int | None, typer.Option("--target-batch", help="Effective batch size (samples).")
]
WorldSizeOption = Annotated[
    int | None,
    typer.Option(
        "--world-size",
        help="Ranks (all of them, with a layout); verify: default the plan's, and more than 1 "
        "starts real processes.",
    ),
]


def finite(value: float, flag: str, *, positive: bool) -> float:
    """``value`` if finite and > 0 (``positive``) or >= 0, else exit 2 naming ``flag``."""
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        need = "a positive" if positive else "a non-negative"
        raise BadInputError(f"{flag} {value} must be {need} finite number.")
    return value


def parse_micro_batches(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        sizes = ()
    if len(sizes) < 2 or sizes[0] < 1:
        raise BadInputError(
            f"--micro-batches {text!r} must list at least two distinct positive sizes.",
            hint="For example --micro-batches 1,2,4 (affine fits need two points; three "
            "also give a residual).",
        )
    return sizes


def split_names(values: list[str] | None) -> tuple[str, ...]:
    """Repeated and comma-separated names (``--always-checkpoint a,b --always-checkpoint c``)."""
    return tuple(n.strip() for v in values or [] for n in v.split(",") if n.strip())


@contextlib.contextmanager
def running_user_code(model: str, *, as_json: bool) -> Iterator[None]:
    """Around a call that runs the model file: its exits become a clean error
    (``loader.contain_exits``), and with ``--json`` whatever it prints goes to stderr —
    Python's ``print`` and writes to file descriptor 1 by native code or child processes —
    so stdout stays one JSON object."""
    from memplan.model.loader import contain_exits

    with contextlib.ExitStack() as stack:
        stack.enter_context(contain_exits(model))
        if as_json:
            stack.enter_context(contextlib.redirect_stdout(sys.stderr))
            stack.enter_context(_fd1_to_stderr())
        yield


@contextlib.contextmanager
def _fd1_to_stderr() -> Iterator[None]:
    try:
        sys.__stdout__.flush()  # type: ignore[union-attr]
        saved = os.dup(1)
        os.dup2(2, 1)
    except (OSError, AttributeError, ValueError):
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError, AttributeError):  # None: 2>&-
            sys.__stderr__.flush()  # type: ignore[union-attr]
        os.dup2(saved, 1)
        os.close(saved)
