"""Loader for Hugging Face model folders: ``config.json`` + safetensors + ``tokenizer.json``.

A folder as ``huggingface-cli download`` or ``save_pretrained`` leaves it::

    config.json                       architectures, sizes, rope_theta, rms_norm_eps, ...
    model.safetensors                 one file, or shards listed by
    model.safetensors.index.json      {"weight_map": {tensor name: shard file}}
    tokenizer.json                    a `tokenizers` tokenizer (or tokenizer.model, SentencePiece)
    tokenizer_config.json             optional: bos/eos tokens, add_bos_token, chat_template
    chat_template.jinja               optional: the chat template (newer transformers)
    generation_config.json            optional: eos_token_id

Supported architectures: those of :mod:`jaxkv.io.registry` (``config.json``
``architectures`` selects the family): ``LlamaForCausalLM`` (Llama, SmolLM2, TinyLlama),
``MistralForCausalLM`` and ``Qwen2ForCausalLM`` (see
:meth:`jaxkv.models.llama.LlamaConfig.from_hf`).

Conversion to the family's internal layout (for Llama: :mod:`jaxkv.models.llama`): the
family names each tensor; HF linear weights are ``(out, in)`` and are transposed to
``x @ W``; per-layer tensors are stacked on a leading L axis; bf16/fp16 tensors (read
through ``safetensors``' numpy API, bf16 as an ``ml_dtypes`` array) become float32. HF
stores Q/K in the rotate-half RoPE layout, which is jaxkv's internal convention, so Q/K
rows are *not* permuted (llama2.c and GGUF files, interleaved-pair, are permuted by their
loaders instead). A bias tensor the family does not read is refused.
"""

from __future__ import annotations

import json
import os
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import safe_open

from jaxkv.errors import JaxkvError, ModelFileError, check_finite
from jaxkv.io import registry
from jaxkv.io.tokenizer import Tokenizer

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

# safetensors dtype codes -> numpy dtypes, for files the installed safetensors cannot read as numpy
_RAW_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F64": np.float64,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}


def is_hf_folder(path: str | os.PathLike) -> bool:
    """True for a directory (what :func:`jaxkv.io.load_model_files` treats as a Hugging Face folder)."""
    return os.path.isdir(path)


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ModelFileError(f"cannot read {what} {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ModelFileError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelFileError(f"{path}: expected a JSON object")
    return data


class SafetensorsFile:
    """One safetensors file, opened once; tensors are read on demand as numpy arrays.

    Attributes:
      path: the file.
      names: the names of its tensors.

    Raises (constructor):
      ModelFileError: naming the file, if safetensors cannot open it.
    """

    def __init__(self, path: str):
        self.path = path
        try:
            self._file = safe_open(path, framework="np")
            self.names = set(self._file.keys())
        except Exception as e:  # safetensors raises its own SafetensorError (and OSError)
            raise ModelFileError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None

    def get(self, name: str) -> np.ndarray:
        """Tensor ``name`` in its stored shape and dtype (bfloat16 as ``ml_dtypes.bfloat16``),
        through safetensors, or through :meth:`read_raw` where this safetensors version
        has no numpy bfloat16.

        Raises:
          ModelFileError: naming the file and tensor, if it cannot be read.
        """
        try:
            return self._file.get_tensor(name)
        except (TypeError, ValueError):  # an older safetensors without numpy bf16: read the bytes ourselves
            return self.read_raw(name)
        except Exception as e:
            raise ModelFileError(f"{self.path}: cannot read tensor {name!r} ({type(e).__name__}: {e})") from None

    def read_raw(self, name: str) -> np.ndarray:
        """Tensor ``name`` read from the file's bytes without safetensors (the header's
        offsets; little-endian F32, F16, BF16, F64, F8_E4M3 or F8_E5M2), in its stored shape and dtype.

        Raises:
          ModelFileError: naming the file and tensor, for any other dtype.
        """
        with open(self.path, "rb") as f:
            n = int(np.frombuffer(f.read(8), "<u8")[0])
            header = json.loads(f.read(n))
        info = header[name]
        dtype = _RAW_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ModelFileError(f"{self.path}: tensor {name!r} has dtype {info['dtype']}, which is not supported")
        start, end = info["data_offsets"]
        data = np.memmap(self.path, dtype=np.uint8, mode="r", offset=8 + n + start, shape=(end - start,))
        return np.frombuffer(data.tobytes(), dtype=np.dtype(dtype).newbyteorder("<")).reshape(info["shape"])


def _shards(folder: str) -> dict[str, SafetensorsFile]:
    """Tensor name -> the shard holding it (from the index, or the single file)."""
    index_path, single_path = os.path.join(folder, INDEX), os.path.join(folder, SINGLE)
    if os.path.isfile(index_path):
        weight_map = _read_json(index_path, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelFileError(f"{index_path}: has no 'weight_map' of tensor name -> shard file")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(folder, f))]
        if missing:
            raise ModelFileError(f"{folder}: shard file(s) {', '.join(missing)} listed in {INDEX} are missing")
        opened = {f: SafetensorsFile(os.path.join(folder, f)) for f in files}
        return {name: opened[f] for name, f in weight_map.items()}
    if os.path.isfile(single_path):
        shard = SafetensorsFile(single_path)
        return {name: shard for name in shard.names}
    others = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if len(others) == 1:
        shard = SafetensorsFile(os.path.join(folder, others[0]))
        return {name: shard for name in shard.names}
    hint = ""
    if any(f.endswith((".bin", ".pt", ".pth")) for f in os.listdir(folder)):
        hint = " (PyTorch pickles are not read: convert them to safetensors)"
    raise ModelFileError(f"{folder}: no {SINGLE} and no {INDEX}{hint}")


def load_hf_weights(folder: str, config) -> dict[str, np.ndarray]:
    """Read every weight of ``config``'s family into its internal layout (float32, ``x @ W``,
    per-layer weights stacked on L).

    Raises:
      ModelFileError: a missing shard or tensor, a tensor of the wrong shape or holding a
        NaN or an infinity, or a bias tensor the family does not read (named).
    """
    family = registry.family_of(config)
    fmt = family.hf
    where = _shards(folder)

    def read(hf_name: str, matrix: bool, shape: tuple[int, ...]) -> np.ndarray:
        shard = where.get(hf_name)
        if shard is None or (hf_name not in shard.names):
            raise ModelFileError(f"{folder}: tensor {hf_name!r} is missing from the safetensors files")
        a = shard.get(hf_name)
        expected = shape[::-1] if matrix else shape
        if tuple(a.shape) != tuple(expected):
            raise ModelFileError(
                f"{shard.path}: tensor {hf_name!r} has shape {tuple(a.shape)}, expected {tuple(expected)} for {config.name}"
            )
        a = a.astype(np.float32)
        check_finite(f"{shard.path}: tensor {hf_name!r}", a, ModelFileError)
        return a.T if matrix else a

    shapes = family.weight_shapes(config)
    weights, read_names = {}, set()
    for template, names in fmt.plan(shapes):
        per_layer = "{i}" in template
        parts = [shapes[n][1:] if per_layer else shapes[n] for n in names]
        whole = parts[0][:-1] + (sum(p[-1] for p in parts),)  # fused parts: concatenated on the output axis
        stacks = [np.empty(shapes[n], np.float32) for n in names]
        for i in range(shapes[names[0]][0] if per_layer else 1):
            tensor_name = template.format(i=i)
            a = read(tensor_name, names[0] in fmt.linear, whole)
            read_names.add(tensor_name)
            for stack, piece in zip(stacks, np.split(a, np.cumsum([p[-1] for p in parts])[:-1], axis=-1)):
                if per_layer:
                    stack[i] = piece
                else:
                    stack[...] = piece
        weights.update(zip(names, stacks))
    if fmt.transform is not None:
        weights = fmt.transform(config, weights)
    extra = sorted(n for n in where if n.endswith(".bias") and n not in read_names)
    if extra:
        raise ModelFileError(f"{folder}: tensor {extra[0]!r} is a bias {config.name}'s config does not declare")
    return weights


def _token_id(tok, value) -> int | None:
    """Id of a special token given as a string or an AddedToken dict (``{"content": ...}``)."""
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        return None
    return tok.token_to_id(value)


def _first_id(value) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _chat_template(folder: str, tok_config: dict) -> str | None:
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if isinstance(template, str):
        return template
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    json_path = os.path.join(folder, "chat_template.json")
    if os.path.isfile(json_path):
        template = _read_json(json_path, "chat template").get("chat_template")
        return template if isinstance(template, str) else None
    return None


def load_hf_tokenizer(folder: str, hf_config: dict | None = None) -> Tokenizer:
    """The folder's tokenizer: ``tokenizer.json`` (else a SentencePiece ``tokenizer.model``).

    BOS/EOS come from ``tokenizer_config.json`` (``bos_token``/``eos_token``, null = none)
    when it names them, else ``generation_config.json``/``config.json`` (``*_token_id``, the
    first of a list).
    BOS is prepended by default when ``add_bos_token`` says so or, absent that, when the
    tokenizer's own post-processor adds it (as ``transformers`` would). The chat template
    comes from ``tokenizer_config.json`` or ``chat_template.jinja``.

    Raises:
      ModelFileError: no tokenizer file in the folder, or an unreadable one (named).
    """
    from tokenizers import Tokenizer as HFTokenizer

    hf_config = hf_config or {}
    tok_config_path = os.path.join(folder, "tokenizer_config.json")
    tok_config = _read_json(tok_config_path, "tokenizer config") if os.path.isfile(tok_config_path) else {}
    gen_path = os.path.join(folder, "generation_config.json")
    gen_config = _read_json(gen_path, "generation config") if os.path.isfile(gen_path) else {}
    name = os.path.basename(os.path.abspath(folder))
    template = _chat_template(folder, tok_config)
    tok_json, sp_model = os.path.join(folder, "tokenizer.json"), os.path.join(folder, "tokenizer.model")
    if not os.path.isfile(tok_json):
        if os.path.isfile(sp_model):
            tokenizer = Tokenizer.from_sentencepiece(sp_model)
            tokenizer.chat_template = template
            if "add_bos_token" in tok_config:
                tokenizer.add_bos = bool(tok_config["add_bos_token"])
            return tokenizer
        raise ModelFileError(f"{folder}: no tokenizer.json (nor tokenizer.model): pass a tokenizer file")
    try:
        hf = HFTokenizer.from_file(tok_json)
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        raise ModelFileError(f"{tok_json}: not a `tokenizers` tokenizer ({e})") from None

    def special(role: str) -> int | None:
        if f"{role}_token" in tok_config:  # the tokenizer's own word, even null (Qwen2 has no BOS)
            return _token_id(hf, tok_config[f"{role}_token"])
        found = _first_id(gen_config.get(f"{role}_token_id"))
        if found is None:
            found = _first_id(hf_config.get(f"{role}_token_id"))
        return found

    bos_id, eos_id = special("bos"), special("eos")
    if "add_bos_token" in tok_config:
        add_bos = bool(tok_config["add_bos_token"]) and bos_id is not None
    else:
        probe = hf.encode("a", add_special_tokens=True).ids
        add_bos = bos_id is not None and bool(probe) and probe[0] == bos_id
    return Tokenizer.from_hf(hf, bos_id=bos_id, eos_id=eos_id, add_bos=add_bos, chat_template=template, name=name)


def load_hf(
    folder: str | os.PathLike, *, tokenizer: bool = True
) -> tuple[Any, dict[str, np.ndarray], Tokenizer | None]:
    """Load a Hugging Face model folder.

    Args:
      folder: the directory holding ``config.json``, the safetensors and the tokenizer.
      tokenizer: also load the folder's tokenizer (False when the caller brings its own).
    Returns:
      ``(config, weights, tokenizer)``: the family's config (e.g. a
      :class:`~jaxkv.models.llama.LlamaConfig`) named after the folder, float32 numpy
      weights in the family's internal layout, and the :class:`Tokenizer` (None when
      ``tokenizer=False``).
    Raises:
      ModelFileError: a missing ``config.json``, safetensors file, shard, tensor or
        tokenizer, an unregistered architecture (the message lists the supported ones),
        a configuration attribute the family does not implement, a bad shape (named).
    """
    folder = os.fspath(folder)
    config_path = os.path.join(folder, CONFIG)
    if not os.path.isfile(config_path):
        raise ModelFileError(
            f"{folder}: no {CONFIG}; a Hugging Face model folder needs config.json, model safetensors and tokenizer.json"
        )
    hf_config = _read_json(config_path, "model config")
    try:
        family = registry.family_for_hf(hf_config)
        config = family.hf.config(hf_config, name=os.path.basename(os.path.abspath(folder)))
    except ModelFileError:
        raise
    except JaxkvError as e:
        raise ModelFileError(f"{config_path}: {e}") from None
    weights = load_hf_weights(folder, config)
    tok = load_hf_tokenizer(folder, hf_config) if tokenizer else None
    return config, weights, tok
