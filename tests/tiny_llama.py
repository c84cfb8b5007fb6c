"""The tiny Llama the layout tests build from its config (import as ``from tiny_llama import
TINY_LLAMA, llama_reference``): 4 blocks of hidden 32, vocabulary 128, no tied head; never
any weights downloaded."""

import json
from pathlib import Path

TINY_LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def llama_reference(folder: Path, seq_len: int = 16, **overrides) -> str:
    """Writes the config (``overrides`` on top) to ``folder`` and returns the ``hf:``
    reference a causal-LM probe of it takes (an override of ``None`` leaves the key out)."""
    config = {k: v for k, v in {**TINY_LLAMA, **overrides}.items() if v is not None}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return f"hf:{folder}?task=causal-lm&seq-len={seq_len}"
