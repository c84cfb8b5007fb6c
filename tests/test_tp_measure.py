"""What tensor parallelism divides, measured by the probe (memplan.probe.tp_measure) on a
Hugging Face Llama built from its config: the TP-split parameter bytes are the attention and
MLP projections' weights, to the byte; the share of saved bytes inside the TP region is
solved from a second run under TP 2 on a fake process group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from memplan.model.loader import load_model_file
from memplan.probe.backends import make_backend
from memplan.probe.session import open_session
from memplan.probe.tp_measure import declared_plan, measure_tp, saved_activation_bytes
from memplan.profile import load_profile

H, FFN, HEADS, KV, VOCAB = 32, 64, 4, 2, 64


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    config = {
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": FFN,
        "num_hidden_layers": 2,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "vocab_size": VOCAB,
        "max_position_embeddings": 64,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return f"hf:{folder}?task=causal-lm&seq-len=16"


def _measured(reference: str, tmp_path, device: str = "cpu"):
    from typer.testing import CliRunner

    from memplan.cli import app

    out = tmp_path / f"p-{device}.yaml"
    argv = ["probe", reference, "--micro-batches", "1,2", "--device", device, "-o", str(out)]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    return load_profile(out)


def test_probe_measures_the_tp_split_of_a_llama(llama, tmp_path):
    profile = _measured(llama, tmp_path)
    head_dim = H // HEADS
    # q, k, v colwise, o rowwise (bias-free), gate/up colwise, down rowwise: every weight.
    weights = (H * H + 2 * H * KV * head_dim + H * H + 3 * H * FFN) * 4
    for layer in profile.layers:
        assert layer.tp_sharded_bytes == weights
        assert 0.3 < layer.tp_saved_fraction < 1.0  # q/k/v, attention, MLP inside; norms out
    fixed = {part.name: part.tp_sharded_bytes for part in profile.fixed}
    assert fixed["model.embed_tokens"] == VOCAB * H * 4  # embedding_rowwise
    assert fixed["lm_head"] == VOCAB * H * 4  # colwise_gather_output
    assert fixed["model.norm"] == 0
    # gcd of 4 heads, 2 KV heads and the split dims 32, 16, 64: tp 2 at most, not 4
    assert profile.tp_degree_divides == 2


def test_probe_records_the_split_linears_gemm_shapes(llama, tmp_path):
    """Each projection's GEMMs per sample (16 tokens), by hand: a colwise one reads its whole
    input (16 × k) and writes its output shard (16 × n); a rowwise one the other way round;
    2·16·n·k FLOPs. Forward order q, k, v, o, gate, up, down; the selective mode re-runs the
    2nd, 4th and 6th counted matmuls (k, o, up: memplan.modes)."""
    profile = _measured(llama, tmp_path)
    tokens, kv = 16, KV * (H // HEADS)
    shapes = [
        ("colwise", H, H),  # q: n, k
        ("colwise", kv, H),
        ("colwise", kv, H),
        ("rowwise", H, H),  # o
        ("colwise", FFN, H),  # gate
        ("colwise", FFN, H),  # up
        ("rowwise", H, FFN),  # down
    ]
    for layer in profile.layers:
        got = [(g.style, g.flops, g.whole, g.split, g.recomputed) for g in layer.tp_gemms]
        want = [
            (
                style,
                2.0 * tokens * n * k,
                tokens * (k if style == "colwise" else n),
                tokens * (n if style == "colwise" else k),
                i in (1, 3, 5),
            )
            for i, (style, n, k) in enumerate(shapes)
        ]
        assert got == want
        assert {(g.input_size, g.output_size, g.float8) for g in layer.tp_gemms} == {(4, 4, False)}
    # the same shapes, and the same matmuls counted, when the probe runs on meta
    meta = _measured(llama, tmp_path, "meta")
    assert [x.tp_gemms for x in meta.layers] == [x.tp_gemms for x in profile.layers]


def test_saved_bytes_leave_parameters_out():
    # A linear layer saves its input (4 × 8 floats) and its weight (a parameter: left out).
    layer = torch.nn.Linear(8, 8, bias=False)
    x = torch.randn(4, 8, requires_grad=True)
    assert saved_activation_bytes(layer, (x,), {}) == 4 * 8 * 4


def test_a_model_without_a_tp_plan_keeps_its_profile(tmp_path):
    source = tmp_path / "mlp.py"
    source.write_text(
        "import torch\n"
        "def build_model():\n"
        "    return torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(8, 8), "
        "torch.nn.ReLU()) for _ in range(2)), torch.nn.Linear(8, 1))\n"
        "def make_batch(b):\n"
        "    return torch.randn(b, 8), torch.randn(b, 1)\n"
        "def loss_fn(out, y):\n"
        "    return torch.nn.functional.mse_loss(out, y)\n"
    )
    model_file = load_model_file(str(source))
    session = open_session(model_file, make_backend("cpu", "fp32", None), None)
    session.recorder.remove()
    assert declared_plan(model_file.module, session.model) is None
    sentinel = object()
    assert measure_tp(session, sentinel, 1) is sentinel  # type: ignore[arg-type]


def test_a_model_files_head_counts_limit_the_tp_degree():
    """A model file states its heads in its own attributes, not an HF config: Llama 3.1
    8B's (examples/llama31.py, a Shape dataclass held by each attention module) has 32
    heads and 8 key/value heads, and split dimensions 4096, 1024, 14336 and the vocabulary
    128,256, so gcd(32, 8, 4096, 1024, 14336, 128256) = 8. Before, the heads were read from
    an HF config alone and the 8B model file was offered TP up to 256 (gcd of its linears),
    though TP 16 leaves a rank half a key/value head."""
    import importlib.util

    from memplan.run.tp_plan import tp_degree_divides, tp_modules

    path = Path(__file__).resolve().parents[1] / "examples" / "llama31.py"
    spec = importlib.util.spec_from_file_location("llama31_heads", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with torch.device("meta"):
        model = module.build_8b()
    modules = tp_modules(model, module.TP_PLAN)
    assert tp_degree_divides(model, modules) == 8
    # its linears alone (no head counts anywhere): 256
    for sub in model.modules():
        if hasattr(sub, "s"):
            sub.s = None
    assert tp_degree_divides(model, modules) == 256
    # nn.MultiheadAttention's own num_heads
    assert tp_degree_divides(torch.nn.MultiheadAttention(64, 4), {}) == 4


def test_a_running_process_group_of_one_is_said_not_blamed_on_the_blocks(llama, tmp_path):
    """Planned inside a script whose framework started a group of one rank (a Trainer under
    DeepSpeed), the fake group of 2 the TP probe starts could not: the probe warned "its
    blocks failed under its TP plan (… Mesh should not be bigger than default world size 1
    …)", a TP failure the user never asked about. It records why TP was not measured, and
    warns of nothing."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        profile = _measured(llama, tmp_path)
    finally:
        dist.destroy_process_group()
    assert not any("Tensor parallelism" in w for w in profile.warnings), profile.warnings
    assert profile.tp_refused.startswith("not measured: a process group of 1 rank(s) was already")
    assert all(layer.tp_saved_fraction is None for layer in profile.layers)
