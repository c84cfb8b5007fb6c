"""bench/run.py: ``make gpu-check`` (``--device cuda``) runs only the sections that measure
on the device; the others would repeat their CPU figures on the GPU machine's time (the
published section probes on meta for minutes). Each section left out must be one whose
``run`` ignores the device or returns at once off the CPU, read from its source."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import inspect

import pytest

from bench import run as bench_run
from bench.run import GPU_SECTIONS, SECTIONS, sections_for


def test_a_gpu_run_takes_the_device_sections_only_and_a_cpu_run_all():
    assert sections_for("cpu", None) == SECTIONS
    gpu = sections_for("cuda", None)
    assert gpu == ["accuracy", "zoo_accuracy", "zoo_plans", "distributed", "probe_overhead",
                   "modes", "calibrate", "kinds"]  # fmt: skip
    assert set(gpu) == set(GPU_SECTIONS) <= set(SECTIONS)
    # --only wins on either device, in SECTIONS order, once each
    assert sections_for("cuda", ["published", "accuracy", "published"]) == [
        "accuracy",
        "published",
    ]


@pytest.mark.parametrize("name", [n for n in SECTIONS if n not in GPU_SECTIONS])
def test_a_section_left_out_on_the_gpu_measures_nothing_there(name):
    """Its run() throws the device away (``del device``) or returns on any device but
    the CPU before measuring."""
    import importlib

    source = inspect.getsource(importlib.import_module(f"bench.{name}").run)
    body = source.split(":", 1)[1]
    first = [line.strip() for line in body.splitlines() if line.strip()][:3]
    ignores = any(line.startswith("del device") for line in first)
    cpu_only = any(line.startswith('if device != "cpu":') for line in first)
    assert ignores or cpu_only, (name, first)


@pytest.mark.parametrize("name", GPU_SECTIONS)
def test_a_gpu_section_measures_on_the_device_it_is_given(name):
    import importlib

    source = inspect.getsource(importlib.import_module(f"bench.{name}").run)
    assert "del device" not in source and 'if device != "cpu":' not in source.split("\n")[1]


def test_the_gpu_run_says_what_it_leaves_out(monkeypatch, capsys):
    """With a CUDA device stubbed in and every section's run replaced, ``--device cuda``
    calls the GPU sections alone and says how many it kept to their CPU results."""
    import importlib
    import types

    called = []
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True))
    monkeypatch.setitem(__import__("sys").modules, "torch", fake)
    monkeypatch.setattr(bench_run, "_machine", lambda device: "stub")
    monkeypatch.setattr(bench_run, "RESULTS", bench_run.ROOT / "nonexistent-results")
    monkeypatch.setattr(bench_run, "compose", lambda: "")
    written = []
    monkeypatch.setattr(
        bench_run.Path, "write_text", lambda self, text, encoding=None: written.append(self)
    )
    monkeypatch.setattr(bench_run.Path, "mkdir", lambda self, **kwargs: None)

    def fake_import(name):
        section = name.rsplit(".", 1)[1]
        return types.SimpleNamespace(run=lambda device: called.append((section, device)) or "x")

    monkeypatch.setattr(importlib, "import_module", fake_import)
    assert bench_run.main(["--device", "cuda"]) == 0
    assert called == [(name, "cuda") for name in GPU_SECTIONS]
    out = capsys.readouterr().out
    assert f"{len(SECTIONS) - len(GPU_SECTIONS)} sections measure nothing on the GPU" in out
