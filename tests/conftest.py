"""Test-session setup: torchvision importable beside the CPU torch build, as memplan's own
loader makes it for model files (transformers, timm and peft import it); and the quick loop.

The quick loop (``make test-fast``, ``pytest -m fast``) is the pure core: memory, solver,
plan, profile, emit, schema, render and the command line's parsing, on hand-made profiles.
No probe of a real model, no training run, no spawned rank: it runs in under 2 minutes on 2
cores. A file below is in it whole, less its tests marked ``slow`` (which run a model or a
training script); every other file is in the full suite only (``make test``)."""

import pytest

from memplan.model.loader import settle_torchvision

settle_torchvision()

FAST_FILES = {
    "test_architecture.py",
    "test_check_config.py",
    "test_check_files.py",
    "test_check_report.py",
    "test_design_map.py",
    "test_emit.py",
    "test_emit_contract.py",
    "test_fast_paths.py",
    "test_fast_yaml.py",
    "test_files_io.py",
    "test_fsdp_mixed.py",
    "test_memory.py",
    "test_modes.py",
    "test_modes_bruteforce.py",
    "test_modes_keep_full.py",
    "test_parallel_memory.py",
    "test_parallel_solver.py",
    "test_pipeline_modes.py",
    "test_progress.py",
    "test_render.py",
    "test_reserve.py",
    "test_scale.py",
    "test_schema.py",
    "test_seqlen.py",
    "test_solver.py",
    "test_solver_bruteforce.py",
    "test_solve_compare.py",
    "test_strategy.py",
    "test_suggest.py",
    "test_suite_hygiene.py",
    "test_timing.py",
    "test_units.py",
    "test_validation.py",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in FAST_FILES and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.fast)
