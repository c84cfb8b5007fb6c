"""Layouts on real transformers models (issue 37): a pipeline split computes exactly the
model's forward (Granite's embedding multiplier and logit scaling, Gemma2's final logit
softcap) or is refused naming why; a model without a TP or pipeline plan (OPT) is refused
for that reason, in the probe and in solve."""

import copy
import json

import pytest
import torch
from plan_factory import hand_plan
from tiny_llama import TINY_LLAMA

from memplan.errors import BadInputError
from memplan.parallel import Parallel, stage_layers

COMMON = {k: v for k, v in TINY_LLAMA.items() if k not in ("model_type", "architectures")}
GRANITE = {
    **COMMON,
    "model_type": "granite",
    "architectures": ["GraniteForCausalLM"],
    "embedding_multiplier": 12.0,
    "logits_scaling": 8.0,
}
GEMMA2 = {
    **COMMON,
    "model_type": "gemma2",
    "architectures": ["Gemma2ForCausalLM"],
    "head_dim": 8,
    "sliding_window": 4,
}
OPT = {
    "model_type": "opt",
    "architectures": ["OPTForCausalLM"],
    "hidden_size": 32,
    "ffn_dim": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "word_embed_proj_dim": 32,
    "tie_word_embeddings": False,
}


def _ref(tmp_path, config):
    folder = tmp_path / config["model_type"]
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return f"hf:{folder}?task=causal-lm&seq-len=16"


def _old_stage_forward(net, parts, layers, *, first, last):
    """The split before issue 37: later stages call the base model with ``inputs_embeds``
    (what it does to its embeddings happens again) and the last stage calls the head
    itself (the causal-LM wrapper's logit transforms skipped)."""
    base = net.get_submodule(parts.base)

    def forward(x):
        key = "input_ids" if first else "inputs_embeds"
        hidden = base(**{key: x}, use_cache=False).last_hidden_state
        return net.get_submodule(parts.head)(hidden) if last else hidden

    return forward


@pytest.mark.parametrize("config", [GRANITE, GEMMA2], ids=["granite", "gemma2"])
def test_two_stages_compute_the_whole_forward(config, tmp_path, monkeypatch):
    from memplan.model.loader import load_model_file
    from memplan.run import pipeline

    mf = load_model_file(_ref(tmp_path, config))
    net = mf.build_model().eval()
    parts = pipeline.pipeline_parts(net)
    ids = mf.make_batch(2)["input_ids"]
    with torch.no_grad():
        whole = net(input_ids=ids).logits
        ranges = stage_layers(4, 2)
        first = pipeline.make_stage_module(
            copy.deepcopy(net), parts, ranges[0], first=True, last=False
        )
        last = pipeline.make_stage_module(
            copy.deepcopy(net), parts, ranges[1], first=False, last=True
        )
        assert torch.equal(last(first(ids)), whole)
    assert pipeline.pipeline_refusal(net) is None
    pipeline.check_pipeline_split(net, 2)
    # the split before: refused by the check, naming where it differs
    monkeypatch.setattr(pipeline, "stage_forward", _old_stage_forward)
    why = pipeline.pipeline_refusal(net)
    assert why is not None and "cannot split" in why
    name = type(net).__name__
    if config is GRANITE:  # the multiplier applied again on stage 1's input
        assert f"{name} into pipeline stages: the hidden states after layer 1" in why
    else:  # Gemma2's final logit softcap skipped (its embeddings' scale is in the embedding)
        assert "the last stage's logits differ" in why
    with pytest.raises(BadInputError, match="cannot split"):
        pipeline.check_pipeline_split(net, 2)


@pytest.mark.slow
@pytest.mark.parametrize("config", [GRANITE, GEMMA2], ids=["granite", "gemma2"])
def test_pipeline_verify_passes_on_two_gloo_ranks(config, tmp_path):
    from memplan.verify.distributed import verify_distributed

    model = _ref(tmp_path, config)
    plan = hand_plan(model, micro=2, k=2, peak=1 << 20, budget=1 << 40, parallel=Parallel(pp=2))
    assert (plan.target_batch, plan.world_size, plan.strategy) == (4, 2, "ddp")
    result = verify_distributed(model, plan, steps=1, timeout_s=600)
    check = result.gradient_check
    assert check.status == "pass", check
    assert check.relative_error is not None and check.relative_error < 1e-5


def test_opt_layouts_refused_for_their_real_reason(tmp_path):
    """OPT declares neither a TP plan nor a pipeline plan: the probe records both, solve
    refuses --tp 2 and --pp 2 naming them and never plans pipeline stages in auto."""
    from typer.testing import CliRunner

    from memplan.cli import app
    from memplan.profile import load_profile

    runner = CliRunner()
    out = tmp_path / "opt.yaml"
    model = _ref(tmp_path, OPT)
    args = ["--device", "cpu", "--micro-batches", "1,2", "--timing-rounds", "1"]
    probed = runner.invoke(app, ["probe", model, *args, "-o", str(out)])
    assert probed.exit_code == 0, probed.output
    assert "solve refuses --tp > 1: OPTForCausalLM declares no tensor-parallel plan" in (
        " ".join(probed.output.split())
    )
    profile = load_profile(out)
    assert profile.tp_refused.startswith("OPTForCausalLM declares no tensor-parallel plan")
    assert "OPTForCausalLM declares none" in profile.pipeline_refused
    common = ["solve", str(out), "--target-batch", "8", "--world-size", "4"]
    tp = runner.invoke(app, [*common, "--budget", "1GiB", "--tp", "2"])
    assert tp.exit_code == 2
    assert "tensor parallelism (tp 2): OPTForCausalLM declares no tensor-parallel plan" in (
        " ".join(tp.output.split())
    )
    pp = runner.invoke(app, [*common, "--budget", "1GiB", "--pp", "2"])
    assert pp.exit_code == 2 and "OPTForCausalLM declares none" in " ".join(pp.output.split())
    auto = runner.invoke(app, [*common, "--budget", "1GiB", "--layout", "auto", "--json"])
    assert auto.exit_code == 0, auto.output
    assert json.loads(auto.output)["plan"]["parallel"]["pp"] == 1
    # a layout that fits nowhere names the least peak any layout needs
    small = runner.invoke(app, [*common, "--budget", "64KiB", "--layout", "auto"])
    assert small.exit_code == 1
    text = " ".join(small.output.split())
    assert "fits 64.0 KiB per rank" in text and "The least peak any of them needs is" in text
