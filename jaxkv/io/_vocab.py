"""Build Hugging Face ``tokenizers`` BPE tokenizers from raw vocabularies.

Two kinds of vocabulary reach us without a ``tokenizer.json``:

- SentencePiece BPE vocabularies (pieces with "▁" for space, scores, byte-fallback pieces
  ``<0x00>``..``<0xFF>``), from a llama2.c ``tokenizer.bin`` or a GGUF with
  ``tokenizer.ggml.model == "llama"``. Merges are generated from the scores the way
  transformers' ``SpmConverter`` does, which reproduces SentencePiece's own encoding.
- GPT-2 byte-level BPE vocabularies (tokens plus merges), from a GGUF with
  ``tokenizer.ggml.model == "gpt2"``.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Sequence

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from jaxkv.errors import JaxkvError, ModelFileError

# GGUF ``tokenizer.ggml.token_type`` values (SentencePiece's piece types).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# GGUF ``tokenizer.ggml.pre`` values whose pre-tokenizer we reproduce, and how.
_BYTE_LEVEL_PRE = {
    "gpt2": [],
    "smollm": [pre_tokenizers.Digits(individual_digits=True)],
}

_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _add_special(tokenizer: HFTokenizer, tokens: Sequence[str], types: Sequence[int]) -> None:
    """Register control/unknown tokens as special and user-defined ones as added tokens."""
    special = [t for t, k in zip(tokens, types) if k in (CONTROL, UNKNOWN)]
    added = [t for t, k in zip(tokens, types) if k == USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])


def _score_merges(pieces: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> list[tuple[str, str]]:
    """Every split of a normal piece into two vocabulary pieces, best merged-piece score first."""
    ids = {p: i for i, p in enumerate(pieces)}
    mergeable = {p for p, k in zip(pieces, types) if k == NORMAL}
    ranked = []
    for piece, score, kind in zip(pieces, scores, types):
        if kind != NORMAL:
            continue
        local = [
            (piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in mergeable and piece[i:] in mergeable
        ]
        local.sort(key=lambda lr: (ids[lr[0]], ids[lr[1]]))
        ranked += [(score, left, right) for left, right in local]
    ranked.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)  # stable: ties keep piece order
    return [(left, right) for _, left, right in ranked]


def sentencepiece_bpe(
    pieces: Sequence[str],
    scores: Sequence[float],
    types: Sequence[int],
    *,
    add_dummy_prefix: bool = True,
    remove_extra_whitespaces: bool = False,
) -> HFTokenizer:
    """A ``tokenizers`` BPE that encodes and decodes like a SentencePiece BPE model.

    Args:
      pieces: the V pieces, spaces written as "▁", byte pieces as ``<0x0A>``.
      scores: V floats; a higher score merges earlier.
      types: V token types (``NORMAL``, ``CONTROL``, ``BYTE``, ... as in GGUF).
      add_dummy_prefix: prepend "▁" to the text (and strip one leading space on decode).
      remove_extra_whitespaces: drop leading/trailing spaces and collapse runs of spaces, as
        SentencePiece's normalizer does when its spec says so.
    """
    unk = next((p for p, k in zip(pieces, types) if k == UNKNOWN), None)
    bpe = models.BPE(
        {p: i for i, p in enumerate(pieces)},
        _score_merges(pieces, scores, types),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = HFTokenizer(bpe)
    steps, decode_steps = [], [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if remove_extra_whitespaces:
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if add_dummy_prefix:
        steps.append(normalizers.Prepend("▁"))
        decode_steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(decode_steps)
    _add_special(tokenizer, pieces, types)
    return tokenizer


def byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], types: Sequence[int], *, pre: str) -> HFTokenizer:
    """A GPT-2 byte-level BPE tokenizer from GGUF ``tokens``, ``merges`` ("a b") and ``token_type``.

    Args:
      pre: the GGUF ``tokenizer.ggml.pre`` name, which fixes the pre-tokenizer.
    Raises:
      JaxkvError: for a pre-tokenizer we do not reproduce.
    """
    if pre not in _BYTE_LEVEL_PRE:
        raise JaxkvError(
            f"GGUF tokenizer pre-tokenizer {pre!r} is not supported: expected one of {sorted(_BYTE_LEVEL_PRE)}"
        )
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ", 1)) for m in merges])
    tokenizer = HFTokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [*_BYTE_LEVEL_PRE[pre], pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    _add_special(tokenizer, tokens, types)
    return tokenizer


def read_llama2c_vocab(path: str | os.PathLike) -> tuple[list[str], list[float], list[int]]:
    """Read a llama2.c ``tokenizer.bin`` as SentencePiece ``(pieces, scores, types)``.

    The file is an int32 max_token_length, then per token a float32 score, an int32 byte
    length and the UTF-8 bytes. llama2.c's exporter wrote "▁" as a space and BOS/EOS as
    ``"\\n<s>\\n"``/``"\\n</s>\\n"``; both are undone here. Types follow llama2.c's fixed ids:
    0 unknown, 1 and 2 control, ``<0xXX>`` pieces byte, the rest normal.

    Raises:
      ModelFileError: naming the file, if it is truncated or a piece is not UTF-8.
    """
    name = os.path.basename(os.fspath(path))
    with open(path, "rb") as f:
        data = f.read()
    pieces, scores, pos = [], [], 4
    if len(data) < 4:
        raise ModelFileError(f"{name}: truncated: a llama2.c tokenizer starts with a 4-byte max_token_length")
    while pos < len(data):
        if pos + 8 > len(data):
            raise ModelFileError(f"{name}: truncated: token {len(pieces)} record ends after {len(data) - pos} bytes")
        score, length = struct.unpack_from("<fi", data, pos)
        if length < 0 or pos + 8 + length > len(data):
            raise ModelFileError(f"{name}: truncated or corrupt: token {len(pieces)} claims {length} bytes")
        try:
            piece = data[pos + 8 : pos + 8 + length].decode("utf-8")
        except UnicodeDecodeError:
            raise ModelFileError(f"{name}: token {len(pieces)} is not UTF-8: not a llama2.c tokenizer") from None
        pieces.append({"\n<s>\n": "<s>", "\n</s>\n": "</s>"}.get(piece, piece.replace(" ", "▁")))
        scores.append(score)
        pos += 8 + length
    if len(pieces) < 3:
        raise ModelFileError(f"{name}: holds {len(pieces)} tokens: not a llama2.c tokenizer (needs <unk>, BOS and EOS)")
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE if _BYTE_PIECE.fullmatch(p) else NORMAL for p in pieces[3:]]
    return pieces, scores, types
