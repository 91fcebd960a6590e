"""Every model family against transformers and llama.cpp: writes docs/FAMILIES.md's table.

For each family's tiny random model (:mod:`tests.families`): jaxkv's logits from the HF
folder and from the GGUF that llama.cpp's own converter writes, against transformers' (HF
folder) and llama.cpp's (the same GGUF, through llama-cpp-python), 64 tokens, fp32.

llama-cpp-python is built from source (the ``llama-cpp-python`` sdist on PyPI; ~20 min on 2
cores), best into a venv of its own; pass its python with ``--llama-cpp-python``:

    python3 -m venv ~/.cache/jaxkv/llvenv && ~/.cache/jaxkv/llvenv/bin/pip install llama-cpp-python==0.3.36 numpy
    .venv/bin/python scripts/compare_families.py --llama-cpp-python ~/.cache/jaxkv/llvenv/bin/python

Without it the llama.cpp column reads "not run".
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from tests import families  # noqa: E402
from tests.test_families import IDS, logits  # noqa: E402

LLAMA_CPP_LOGITS = """
import json, sys, numpy as np, llama_cpp
path, out, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = llama_cpp.Llama(model_path=path, n_ctx=len(ids) + 8, logits_all=True, verbose=True, n_threads=2,
                      type_k=0, type_v=0)  # GGML_TYPE_F32 KV cache (llama.cpp defaults to f16)
llm.eval(ids)
np.save(out, np.asarray(llm.scores[: len(ids)], np.float32))
print(json.dumps({"version": llama_cpp.__version__, "tokens": llm.tokenize(sys.argv[4].encode())}))
"""
TEXT = "Once upon a time, there was a little girl named Lily. She loved to play outside!"


def llama_cpp_logits(python: str, gguf: str, ids: list[int]) -> tuple[np.ndarray, dict]:
    """llama.cpp's logits of ``ids`` and its tokens of :data:`TEXT` (BOS as the file says)."""
    out = gguf + ".npy"
    done = subprocess.run(
        [python, "-c", LLAMA_CPP_LOGITS, gguf, out, json.dumps(ids), TEXT], capture_output=True, text=True
    )
    if done.returncode:
        errors = [line for line in done.stderr.splitlines() if "error" in line.lower() or "failed" in line.lower()]
        raise RuntimeError(errors[0] if errors else done.stderr.strip().splitlines()[-1])
    return np.load(out), json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp-python", help="a python with llama-cpp-python installed")
    parser.add_argument("--out", default="docs/FAMILIES.md")
    args = parser.parse_args(argv)
    import jax
    import transformers

    from jaxkv.io import load_model

    converter = families.llama_cpp_converter()
    if converter is None:
        raise SystemExit("llama.cpp's converter not found: run scripts/test.sh once, or set JAXKV_LLAMA_CPP")
    rows, llama_version = [], "not run"
    with tempfile.TemporaryDirectory() as tmp:
        for family in families.FAMILIES:
            folder = families.build(os.path.join(tmp, family), family)
            gguf = families.convert(folder, os.path.join(tmp, f"{family}.gguf"), converter)
            reference = families.hf_logits(folder, IDS)
            gguf_model = load_model(gguf)
            hf, from_gguf = logits(load_model(folder), IDS), logits(gguf_model, IDS)
            row = {
                "family": family,
                "hf": float(np.abs(hf - reference).max()),
                "gguf_vs_hf": float(np.abs(from_gguf - hf).max()),
                "scale": float(np.abs(reference).max()),
            }
            if args.llama_cpp_python:
                try:
                    theirs, info = llama_cpp_logits(args.llama_cpp_python, gguf, IDS)
                    llama_version = info["version"]
                    row["tokens_equal"] = gguf_model.tokenizer.encode(TEXT) == info["tokens"]
                    row["gguf_vs_llama_cpp"] = float(np.abs(from_gguf - theirs).max())
                    row["llama_cpp_vs_hf"] = float(np.abs(theirs - reference).max())
                except RuntimeError as e:
                    row["llama_cpp_error"] = str(e)[:200]
            rows.append(row)
            print(json.dumps(row), flush=True)
    text = render(rows, llama_version, jax.__version__, transformers.__version__)
    pathlib.Path(args.out).write_text(text)
    print(f"wrote {args.out}")
    return 0


def render(rows, llama_version, jax_version, transformers_version) -> str:
    def cell(row, key):
        if "llama_cpp_error" in row and "llama_cpp" in key:
            return "llama.cpp refused the file (below)"
        return f"{row[key]:.1e}" if key in row else "not run"

    lines = [
        "# Model families: logits against transformers and llama.cpp",
        "",
        "How each family maps onto the shared decoder, and what its local layers keep in the cache:",
        "`docs/ARCHITECTURE.md` (Model families). The tests (`tests/test_families.py`, in CI) check the",
        "first two columns to 1e-4 on every run.",
        "",
        "Written by `scripts/compare_families.py` (tiny random models of each family, 64 tokens, fp32,",
        "unit-scale logits: the largest absolute logit of each model is given). Columns are the largest absolute difference of",
        "logits: jaxkv on the Hugging Face folder vs transformers; jaxkv on the GGUF written by llama.cpp's",
        "own `convert_hf_to_gguf.py` vs jaxkv on the folder; the same GGUF in jaxkv vs llama.cpp",
        "(llama-cpp-python); llama.cpp vs transformers; and whether jaxkv's tokenizer of the GGUF gives",
        "llama.cpp's tokens for a sentence (BOS and the space prefix as the file says).",
        "",
        f"Machine: {platform.machine()} CPU, Python {platform.python_version()}, jax {jax_version}, transformers "
        f"{transformers_version}, llama-cpp-python {llama_version} (llama.cpp's converter from its sdist).",
        "",
        "| family | largest logit (abs) | jaxkv HF vs transformers | jaxkv GGUF vs jaxkv HF | jaxkv GGUF vs llama.cpp | llama.cpp vs transformers | GGUF tokens = llama.cpp's |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['family']} | {r['scale']:.2f} | {cell(r, 'hf')} | {cell(r, 'gguf_vs_hf')} | "
            f"{cell(r, 'gguf_vs_llama_cpp')} | {cell(r, 'llama_cpp_vs_hf')} | "
            f"{ {True: 'yes', False: 'NO'}.get(r.get('tokens_equal'), 'not run') } |"
        )
    lines += [f"\n{r['family']}: llama.cpp: `{r['llama_cpp_error']}`" for r in rows if "llama_cpp_error" in r]
    lines += [
        "",
        "Mistral: llama.cpp's converter writes Mistral as `llama` without its sliding window (llama.cpp",
        "ignores it), so past the window (16 tokens here) its GGUF is another model than the HF folder;",
        "jaxkv computes what the GGUF says, as llama.cpp does.",
        "",
        "Gemma: llama.cpp's CPU backend computes GELU from a float16 table (`GGML_GELU_FP16` in",
        "`ggml-cpu/vec.h`); jaxkv and transformers compute it in float32, and agree to 1e-5.",
        "",
        "Phi-3: llama.cpp refuses the tiny model's vocabulary (the stories260K SentencePiece model lacks",
        "the special tokens its Phi-3 vocabulary loader looks up), not its tensors.",
        "",
        "The llama.cpp runs use an F32 KV cache (`type_k=type_v=F32`; llama.cpp's default F16 cache",
        "alone moves its logits by ~3e-3 on these models).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
