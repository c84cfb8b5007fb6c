"""The progress display: on a terminal it names the phase and what it is doing; under --json
or when stderr is not a terminal nothing is printed."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from memplan import render
from memplan.cli import app

runner = CliRunner()
BASELINE = str(Path(__file__).parent.parent / "examples/ci/baselines/gpt.profile.yaml")


def _console(monkeypatch, terminal: bool) -> io.StringIO:
    buffer = io.StringIO()
    fake = Console(file=buffer, force_terminal=terminal, width=120)
    monkeypatch.setattr(render, "console", fake)
    return buffer


def test_progress_on_a_terminal_shows_the_phase_and_what(monkeypatch):
    buffer = _console(monkeypatch, terminal=True)
    with render.progress("memplan check") as on_progress:
        on_progress(1, 3, "entry-two: probing")
    text = buffer.getvalue()
    assert "memplan check" in text
    assert "entry-two: probing" in text
    assert "1/3" in text
    assert "0:00:0" in text  # the elapsed time


@pytest.mark.parametrize(("terminal", "quiet"), [(False, False), (True, True)])
def test_progress_is_silent_off_a_terminal_and_when_quiet(monkeypatch, terminal, quiet):
    buffer = _console(monkeypatch, terminal=terminal)
    with render.progress("memplan check", quiet=quiet) as on_progress:
        on_progress(1, 3, "entry-two: probing")
    assert buffer.getvalue() == ""


@pytest.mark.parametrize(("json_flag", "shown"), [((), True), (("--json",), False)])
def test_solve_shows_its_phase_on_a_terminal_but_not_under_json(monkeypatch, json_flag, shown):
    buffer = _console(monkeypatch, terminal=True)
    args = ["solve", BASELINE, "--budget", "80GiB", "--target-batch", "64", *json_flag]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert ("memplan solve" in buffer.getvalue()) is shown


def test_solve_prints_no_progress_when_stderr_is_not_a_terminal(monkeypatch):
    buffer = _console(monkeypatch, terminal=False)
    result = runner.invoke(app, ["solve", BASELINE, "--budget", "80GiB", "--target-batch", "64"])
    assert result.exit_code == 0, result.output
    assert "memplan solve" not in buffer.getvalue()


def test_a_signal_while_the_display_starts_still_shows_the_cursor_again(monkeypatch):
    """Ctrl-C can land inside the display's first render (rich hides the cursor, then draws):
    the display is stopped all the same and the cursor shown again."""
    from rich.live import Live

    from memplan.errors import Interrupted

    buffer = _console(monkeypatch, terminal=True)
    drawn = Live.refresh

    def interrupted_once(self):
        monkeypatch.setattr(Live, "refresh", drawn)
        raise Interrupted(2)

    monkeypatch.setattr(Live, "refresh", interrupted_once)
    with pytest.raises(Interrupted), render.progress("memplan probe"):
        pass
    text = buffer.getvalue()
    assert "\x1b[?25l" in text and text.rindex("\x1b[?25h") > text.rindex("\x1b[?25l")


def test_off_a_terminal_plain_lines_say_where_the_time_goes(monkeypatch):
    # issue 37: a probe of 10-16 minutes piped to a log printed nothing until the end
    import time

    buffer = _console(monkeypatch, terminal=False)
    monkeypatch.setenv("MEMPLAN_PROGRESS_SECONDS", "0.2")
    with render.progress("probing") as on_progress:
        on_progress(1, 3, "b=1: traced")
        time.sleep(1.1)
        on_progress(2, 3, "b=2: traced")
        time.sleep(0.5)
    lines = buffer.getvalue().splitlines()
    assert len(lines) >= 4
    assert lines[0].startswith("probing: ") and "now b=1: traced (1/3) for" in lines[0]
    assert "longest steps: b=1: traced 1." in lines[-2] or "b=2: traced" in lines[-2]
    assert (
        lines[-1].startswith("probing: ") and ", done; longest steps: b=1: traced 1." in (lines[-1])
    )
    assert "\x1b[" not in buffer.getvalue()  # plain text for a log


def test_off_a_terminal_a_short_run_prints_nothing(monkeypatch):
    buffer = _console(monkeypatch, terminal=False)
    with render.progress("probing") as on_progress:
        on_progress(1, 3, "b=1: traced")
    assert buffer.getvalue() == ""
