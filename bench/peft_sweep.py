"""Meta equals cpu across PEFT's methods: the differential sweep for adapters.

Each of the pinned peft's tuning methods that trains from a config alone (``METHODS``: LoRA
and its variants, AdaLoRA, IA³, LoHa, LoKr, OFT, BOFT, VeRA, FourierFT, prompt, prefix and
P-tuning, …), wrapped around a tiny transformers Llama (2 layers of width 64, 4 heads over
2 K/V heads, vocabulary 128) built from its config with no weights, its targets the
attention's query and value projections, is probed on ``cpu`` and on ``meta`` at
micro-batches 1 and 2 (16 tokens a sample) through a model file as a user writes one:
``get_peft_model(LlamaForCausalLM(config), XConfig(...))``, the causal-LM loss
transformers computes from ``labels``. The bar: the meta profile equals the cpu profile in
every byte field, or meta fails with exit 3 naming the op. Left out, with the reason in
``SKIPPED``: methods that need data or another package to initialise. Raw rows:
``bench/results/<device>-peft-sweep.csv``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import vision_sweep

MICRO_BATCHES = (1, 2)
TARGETS = "target_modules=['q_proj', 'v_proj']"
METHODS: dict[str, str] = {
    "lora": f"LoraConfig(r=8, {TARGETS})",
    "lora-dora": f"LoraConfig(r=8, use_dora=True, {TARGETS})",
    "lora-rslora": f"LoraConfig(r=8, use_rslora=True, lora_dropout=0.1, {TARGETS})",
    "lora-all-linear": "LoraConfig(r=4, target_modules='all-linear')",
    "lora-embedding": "LoraConfig(r=4, target_modules=['embed_tokens', 'q_proj'])",
    "lora-modules-to-save": f"LoraConfig(r=4, modules_to_save=['lm_head'], {TARGETS})",
    "adalora": f"AdaLoraConfig(total_step=10, {TARGETS})",
    "ia3": "IA3Config(target_modules=['k_proj', 'v_proj', 'down_proj'], "
    "feedforward_modules=['down_proj'])",
    "loha": f"LoHaConfig(r=4, {TARGETS})",
    "lokr": f"LoKrConfig(r=4, {TARGETS})",
    "oft": f"OFTConfig(r=0, oft_block_size=16, {TARGETS})",
    "boft": f"BOFTConfig(boft_block_size=4, {TARGETS})",
    "vera": f"VeraConfig(r=8, {TARGETS})",
    "fourierft": f"FourierFTConfig(n_frequency=100, {TARGETS})",
    "hra": f"HRAConfig(r=8, {TARGETS})",
    "randlora": f"RandLoraConfig(r=8, {TARGETS})",
    "c3a": f"C3AConfig(block_size=16, {TARGETS})",
    "shira": f"ShiraConfig(r=4, {TARGETS})",
    "vblora": f"VBLoRAConfig(vector_length=16, num_vectors=32, {TARGETS})",
    "waveft": f"WaveFTConfig(n_frequency=100, {TARGETS})",
    "road": f"RoadConfig(group_size=16, {TARGETS})",
    "delora": f"DeloraConfig({TARGETS})",
    "miss": f"MissConfig({TARGETS})",
    "ln-tuning": "LNTuningConfig()",
    "trainable-tokens": "TrainableTokensConfig(target_modules=['embed_tokens'], "
    "token_indices=[1, 2, 3])",
    "prompt-tuning": "PromptTuningConfig(num_virtual_tokens=4)",
    "prefix-tuning": "PrefixTuningConfig(num_virtual_tokens=4)",
    "p-tuning": "PromptEncoderConfig(num_virtual_tokens=4, encoder_hidden_size=32)",
    "adaption-prompt": "AdaptionPromptConfig(adapter_len=4, adapter_layers=1)",
    "cpt": "CPTConfig(task_type='CAUSAL_LM')",
}
STOPS = {
    "shira": "adds a sparse COO tensor to its weight; meta has no kernels for sparse "
    "tensors' ops (aten::_coalesce)",
    "vblora": "asks whether its own logits are infinite",
    "waveft": "takes the positions of its random frequency indices",
    "cpt": "takes the norms of its delta embedding",
}
"""Why a method stops on meta where it does (the table names the op): all but shira read
values of their own weights, which a meta tensor does not have; a cpu probe measures them."""
SKIPPED = {
    "adamss": "needs scikit-learn to initialise",
    "loraga, eva, loftq, arrow": "initialised from data, gradients or a quantiser",
    "xlora": "needs trained LoRA adapters to mix",
    "poly, multitask prompt tuning": "need task ids in every batch",
}

MODEL_FILE = '''"""peft {name} around a tiny transformers Llama (no weights): {config}."""

import torch
import transformers
from peft import *  # noqa: F403


def build_model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config)
    method = {config}
    method.task_type = "CAUSAL_LM"
    return get_peft_model(model, method)  # noqa: F405


def make_batch(b):
    g = torch.Generator().manual_seed(b)
    return torch.randint(0, 128, (b, 16), generator=g)


def training_loss(model, batch):
    return model(input_ids=batch, labels=batch).loss
'''


def probe_one(name: str, folder: str) -> dict[str, Any]:
    path = Path(folder) / f"peft_{name.replace('-', '_')}.py"
    path.write_text(MODEL_FILE.format(name=name, config=METHODS[name]))
    return vision_sweep.probe_file(name, str(path), MICRO_BATCHES)


def run(device: str) -> str:
    if device != "cpu":
        return "### Meta equals cpu across peft's methods\n\nA CPU-only section.\n"
    rows, table = vision_sweep.swept(
        list(METHODS),
        device,
        probe_one,
        library="peft",
        doc=__doc__,
        csv_name="peft-sweep",
        noun="methods",
    )
    skipped = "; ".join(f"{k} ({why})" for k, why in SKIPPED.items())
    stopped = [r["model"] for r in rows if r["status"] == "meta-fails" and r["model"] in STOPS]
    why = "".join(f"- {name} {STOPS[name]}.\n" for name in stopped)
    return f"{table}\n{why}\nNot in the sweep: {skipped}.\n"
