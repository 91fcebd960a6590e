"""Tiny random Hugging Face models of every family jaxkv loads, built locally with
``transformers`` (no hub download), and their reference logits.

Each model is 2-7 layers, GQA, random weights of unit-scale logits (not transformers' 0.02
init, under which every model's logits are ~0 and any error hides), the stories260K
SentencePiece tokenizer (``tok512.model``, as ``tokenizer.model`` for llama.cpp's converter
and converted to ``tokenizer.json`` for jaxkv) and a chat template in the family's format.
Local layers get a sliding window of 16 tokens, shorter than the 64-token test text, and
Llama 3.x a ``llama3`` scaling whose ``original_max_position_embeddings`` (32) the text passes.

Needs torch and transformers (``scripts/test.sh`` installs them into ``.venv``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np

from tests.paths import TOK512_MODEL

TOKENIZER_MODEL = str(TOK512_MODEL)
COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
WINDOW = 16  # local layers' sliding window, tokens

TEMPLATES = {  # each family's turn format (the families' own templates, reduced to their structure)
    "llama3": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
        "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "gemma": (
        "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
        "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    ),
    "mistral": (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
        "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    ),
    "phi3": (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    ),
}


def family_configs():
    """name -> (transformers config class name, kwargs, chat template key)."""
    return {
        "llama3": (
            "LlamaConfig",
            dict(
                head_dim=32,
                rope_theta=500000.0,
                tie_word_embeddings=True,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                },
            ),
            "llama3",
        ),
        "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True), "chatml"),
        "qwen3": ("Qwen3Config", dict(head_dim=32), "chatml"),
        "mistral": ("MistralConfig", dict(sliding_window=WINDOW), "mistral"),
        "gemma2": ("Gemma2Config", dict(head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=32), "gemma"),
        "gemma3": (
            "Gemma3TextConfig",
            dict(
                num_hidden_layers=7,
                head_dim=32,
                sliding_window=WINDOW,
                query_pre_attn_scalar=32,
                rope_scaling={"rope_type": "linear", "factor": 4.0},
            ),
            "gemma",
        ),
        "phi3": ("Phi3Config", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2), "phi3"),
    }


FAMILIES = tuple(family_configs())


def _randomise(model, torch, seed: int) -> None:
    """Unit-scale random weights: matrices N(0, 1/fan_in), norms 1 + N(0, 0.1) (Gemma's ``w``
    of ``1 + w``: N(0, 0.1)), biases N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    gemma = "gemma" in type(model).__name__.lower()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.ndim == 2:
                p.copy_(noise / p.shape[1] ** 0.5)
            elif name.endswith("norm.weight"):
                p.copy_(0.1 * noise if gemma else 1.0 + 0.1 * noise)
            else:
                p.copy_(0.1 * noise)


def build(folder: str, family: str, seed: int = 0) -> str:
    """Write the tiny ``family`` model (config, safetensors, tokenizer, template) into ``folder``."""
    import torch
    import transformers

    cls_name, kwargs, template = family_configs()[family]
    config = getattr(transformers, cls_name)(**{**COMMON, **kwargs})
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    _randomise(model, torch, seed)
    model.save_pretrained(folder)
    spm = os.path.join(folder, "spm")
    os.makedirs(spm)
    shutil.copy(TOKENIZER_MODEL, os.path.join(spm, "tokenizer.model"))
    tok = transformers.LlamaTokenizer.from_pretrained(spm, add_bos_token=True)
    tok.chat_template = TEMPLATES[template]
    tok.save_pretrained(folder)
    tok.backend_tokenizer.save(os.path.join(folder, "tokenizer.json"))  # (save_pretrained's copy drops the vocabulary)
    shutil.move(
        os.path.join(spm, "tokenizer.model"), os.path.join(folder, "tokenizer.model")
    )  # for llama.cpp's converter
    os.rmdir(spm)
    return folder


def hf_logits(folder: str, ids) -> np.ndarray:
    """float32[T, V]: transformers' logits of ``ids`` (one sequence, no cache)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].float().numpy()


def llama_cpp_converter() -> str | None:
    """Path of llama.cpp's ``convert_hf_to_gguf.py`` ($JAXKV_LLAMA_CPP/…, else the copy
    ``scripts/test.sh`` unpacks into ~/.cache/jaxkv), or None."""
    roots = [os.environ.get("JAXKV_LLAMA_CPP"), os.path.expanduser("~/.cache/jaxkv/llama.cpp")]
    for root in roots:
        if root and os.path.isfile(os.path.join(root, "convert_hf_to_gguf.py")):
            return os.path.join(root, "convert_hf_to_gguf.py")
    return None


def convert(folder: str, out: str, converter: str) -> str:
    """Convert an HF folder to an F32 GGUF with llama.cpp's own converter (a subprocess)."""
    cmd = [sys.executable, converter, folder, "--outfile", out, "--outtype", "f32"]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return out


if __name__ == "__main__":  # build one: python -m tests.families FAMILY FOLDER
    print(build(sys.argv[2], sys.argv[1]))
    print(json.dumps(json.load(open(os.path.join(sys.argv[2], "config.json"))), indent=1))
