"""A sample of bench/hf_sweep.py (meta equals cpu across transformers' families): a few
families of each kind, built tiny from their config classes, probed on cpu and meta at
micro-batches 1 and 2, equal in every byte field. The whole sweep is
``python -m bench.run --device cpu --only hf_sweep``."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import hf_families, hf_sweep

SAMPLE = [
    ("causal-lm", "llama"),
    ("causal-lm", "gpt2"),
    ("causal-lm", "qwen2_moe"),
    ("encoder", "bert"),
    ("encoder", "deberta"),  # transformers' padding check reads a list index (PythonData)
]


@pytest.mark.parametrize(("kind", "family"), SAMPLE)
def test_meta_equals_cpu_for_a_sample_of_families(tmp_path: Path, kind: str, family: str) -> None:
    row = hf_sweep.probe_family(kind, family, str(tmp_path))
    assert row["status"] == "equal", row
    assert 0 < row["params"] < hf_families.MAX_PARAMS
    # the sweep's bytes-only shortcuts are undone: later probes in this process time and
    # run selective as usual
    from memplan.probe import runner, sizes

    assert runner.try_selective is sizes.try_selective
    assert runner.time_extra_size is sizes.time_extra_size


def test_the_sweep_names_the_first_differing_field() -> None:
    from memplan.probe import probe_model

    path = str(Path(__file__).parent.parent / "examples" / "mlp.py")
    profile = probe_model(path, device="meta", micro_batches=(1, 2))
    assert hf_sweep.byte_difference(profile, profile) is None
    totals = dataclasses.replace(profile.totals, cached_bytes=8)
    assert hf_sweep.byte_difference(profile, dataclasses.replace(profile, totals=totals)) == (
        "totals"
    )
    layer = dataclasses.replace(profile.layers[1], saved_bytes=profile.layers[0].output_bytes)
    moved = dataclasses.replace(profile, layers=(profile.layers[0], layer, *profile.layers[2:]))
    assert hf_sweep.byte_difference(profile, moved) == f"layers {layer.name}: saved_bytes"


def test_families_are_the_pinned_transformers_mappings() -> None:
    causal = hf_families.families("causal-lm")
    assert {"llama", "gpt2", "mixtral", "gemma2"} <= set(causal)
    config = hf_families.tiny_config("causal-lm", "llama")
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (32, 2, 128)
