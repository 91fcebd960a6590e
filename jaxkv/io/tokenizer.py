"""Tokenizers: SentencePiece ``.model``, llama2.c ``tokenizer.bin`` and GGUF vocabularies.

All of them sit behind one :class:`Tokenizer` with ``encode``/``decode``, the BOS/EOS ids,
the model's chat template and an incremental decoder for streaming output. Special
(control) tokens written in the text, such as ``<|im_start|>`` or ``<s>``, encode to
their single ids, as in llama.cpp and Hugging Face.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import sentencepiece
from tokenizers import Tokenizer as HFTokenizer

from jaxkv.errors import JaxkvError, ModelFileError
from jaxkv.io import _vocab

_REPLACEMENT = "\ufffd"  # what a decoder prints for incomplete UTF-8


class _HFBackend:
    """Adapter over a Hugging Face ``tokenizers.Tokenizer``."""

    def __init__(self, tokenizer: HFTokenizer):
        self._tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def id_to_token(self, i: int) -> str:
        return self._tokenizer.id_to_token(i)


class _SentencePieceBackend:
    """Adapter over ``sentencepiece``, which splits control pieces out of the text itself."""

    def __init__(self, sp: sentencepiece.SentencePieceProcessor):
        self._sp = sp
        self.vocab_size = sp.get_piece_size()
        self._special = {sp.id_to_piece(i): i for i in range(self.vocab_size) if sp.is_control(i) or sp.is_unknown(i)}
        self._splitter = re.compile(
            "(" + "|".join(re.escape(p) for p in sorted(self._special, key=len, reverse=True)) + ")"
        )

    def encode(self, text: str) -> list[int]:
        ids = []
        for i, part in enumerate(self._splitter.split(text) if self._special else [text]):
            if i % 2:
                ids.append(self._special[part])
            elif part:
                ids += self._sp.encode(part)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(ids)

    def id_to_token(self, i: int) -> str:
        return self._sp.id_to_piece(i)


class Tokenizer:
    """Text <-> token ids for one model.

    Attributes:
      bos_id: the beginning-of-sequence id, or None if the vocabulary has none.
      eos_id: the end-of-sequence id (generation stops there), or None.
      vocab_size: number of ids, added tokens included.
      chat_template: the model's Jinja chat template, or None.
      add_bos: whether :meth:`encode` prepends BOS by default.
      name: where the vocabulary came from (file name), for messages.
    """

    def __init__(
        self,
        backend: _HFBackend | _SentencePieceBackend,
        *,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        chat_template: str | None = None,
        name: str = "tokenizer",
    ):
        self._backend = backend
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos
        self.chat_template, self.name = chat_template, name
        self.vocab_size = backend.vocab_size

    # -- constructors ------------------------------------------------------------------

    @classmethod
    def from_sentencepiece(cls, path: str | os.PathLike) -> Tokenizer:
        """From a SentencePiece ``.model`` file; BOS is added by default (Llama convention).

        Raises:
          ModelFileError: naming the file, if it is not a SentencePiece model.
        """
        sp = sentencepiece.SentencePieceProcessor()
        try:
            sp.Load(os.fspath(path))
        except (OSError, RuntimeError) as e:
            raise ModelFileError(f"{os.fspath(path)}: not a SentencePiece model: {e}") from None
        return cls(
            _SentencePieceBackend(sp),
            bos_id=sp.bos_id() if sp.bos_id() >= 0 else None,
            eos_id=sp.eos_id() if sp.eos_id() >= 0 else None,
            add_bos=True,
            name=os.path.basename(os.fspath(path)),
        )

    @classmethod
    def from_hf(
        cls,
        tokenizer: HFTokenizer,
        *,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        chat_template: str | None = None,
        name: str = "tokenizer",
    ) -> Tokenizer:
        """Wrap a Hugging Face ``tokenizers.Tokenizer`` object (read from a file or built in
        memory, as :func:`jaxkv.testing.tiny_tokenizer` does).

        Args:
          tokenizer: the ``tokenizers.Tokenizer``; its added special tokens written in the
            text encode to their single ids, and decoding skips them.
          bos_id, eos_id: BOS and EOS ids (None: the vocabulary has none).
          add_bos: whether :meth:`encode` prepends BOS by default.
          chat_template: a Jinja chat template, or None.
          name: where the vocabulary came from, for messages.

        Raises:
          JaxkvError: ``bos_id`` or ``eos_id`` outside ``[0, vocab_size)`` (named), or
            ``add_bos`` without a ``bos_id``.
        """
        backend = _HFBackend(tokenizer)
        for role, token_id in (("bos_id", bos_id), ("eos_id", eos_id)):
            if token_id is not None and not 0 <= token_id < backend.vocab_size:
                raise JaxkvError(
                    f"{name}: {role}={token_id!r} is not an id of the {backend.vocab_size}-token vocabulary"
                )
        if add_bos and bos_id is None:
            raise JaxkvError(f"{name}: add_bos=True needs a bos_id")
        return cls(backend, bos_id=bos_id, eos_id=eos_id, add_bos=add_bos, chat_template=chat_template, name=name)

    @classmethod
    def from_llama2c(cls, path: str | os.PathLike, *, remove_extra_whitespaces: bool = True) -> Tokenizer:
        """From a llama2.c ``tokenizer.bin`` (BOS 1, EOS 2, BOS added by default).

        ``remove_extra_whitespaces`` (SentencePiece's normalizer option; the file does not
        record it) defaults to True, SentencePiece's training default and what
        llama2.c's ``tok{V}`` vocabularies were trained and used with; Meta's Llama 2
        vocabulary was trained with it off.

        Raises:
          ModelFileError: naming the file, if it is truncated or not a llama2.c tokenizer.
        """
        pieces, scores, types = _vocab.read_llama2c_vocab(path)
        hf = _vocab.sentencepiece_bpe(pieces, scores, types, remove_extra_whitespaces=remove_extra_whitespaces)
        return cls(_HFBackend(hf), bos_id=1, eos_id=2, add_bos=True, name=os.path.basename(os.fspath(path)))

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], *, name: str = "gguf") -> Tokenizer:
        """From the ``tokenizer.*`` keys of a GGUF file (a plain ``{key: value}`` dict).

        ``tokenizer.ggml.model`` "llama" is a SentencePiece BPE vocabulary (tokens with "▁",
        scores); "gpt2" is a byte-level BPE (tokens and merges, pre-tokenizer named by
        ``tokenizer.ggml.pre``). Control tokens (token_type 3) become special tokens,
        user-defined ones (4) added tokens. BOS is added when ``tokenizer.ggml.add_bos_token``
        says so (default: True for "llama", False for "gpt2").

        Raises:
          JaxkvError: for another tokenizer model or pre-tokenizer.
        """
        kind = metadata.get("tokenizer.ggml.model")
        if kind not in ("llama", "gpt2"):
            raise JaxkvError(f"{name}: GGUF tokenizer model {kind!r} is not supported: expected 'llama' or 'gpt2'")

        def need(key):
            if key not in metadata:
                raise JaxkvError(f"{name}: GGUF tokenizer model {kind!r} needs metadata {key!r}, which is absent")
            return metadata[key]

        tokens = need("tokenizer.ggml.tokens")
        types = metadata.get("tokenizer.ggml.token_type", [_vocab.NORMAL] * len(tokens))
        if kind == "llama":
            hf = _vocab.sentencepiece_bpe(
                tokens,
                need("tokenizer.ggml.scores"),
                types,
                add_dummy_prefix=bool(metadata.get("tokenizer.ggml.add_space_prefix", True)),
                remove_extra_whitespaces=bool(metadata.get("tokenizer.ggml.remove_extra_whitespaces", False)),
            )
        else:
            pre = metadata.get("tokenizer.ggml.pre", "gpt2")
            hf = _vocab.byte_level_bpe(tokens, need("tokenizer.ggml.merges"), types, pre=pre)
        return cls(
            _HFBackend(hf),
            bos_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_id=metadata.get("tokenizer.ggml.eos_token_id"),
            add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")),
            chat_template=metadata.get("tokenizer.chat_template"),
            name=name,
        )

    # -- text <-> ids ------------------------------------------------------------------

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``, special tokens written in it recognised.

        Args:
          add_bos: prepend ``bos_id``; None means the model's default (``self.add_bos``).
        Raises:
          JaxkvError: if BOS is asked for and the vocabulary has none.
        """
        add_bos = self.add_bos if add_bos is None else add_bos
        if add_bos and self.bos_id is None:
            raise JaxkvError(f"{self.name}: has no BOS token; encode with add_bos=False")
        return ([self.bos_id] if add_bos else []) + self._backend.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``; special tokens (BOS, EOS, ...) are left out.

        Byte-fallback and byte-level tokens are joined into UTF-8; an incomplete character
        at the end decodes to U+FFFD (see :meth:`decode_stream` for streaming).
        """
        return self._backend.decode([int(i) for i in ids])

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary string of one id (e.g. "▁Once", "Ġthe", "<|im_end|>")."""
        return self._backend.id_to_token(int(token_id))

    def decode_stream(self, context_ids: Sequence[int] = ()) -> DecodeStream:
        """An incremental decoder that continues after ``context_ids`` (e.g. the prompt)."""
        return DecodeStream(self, context_ids)

    # -- chat --------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}]``) with the model's template.

        Rendered as Hugging Face does: Jinja2 in a sandbox with ``trim_blocks`` and
        ``lstrip_blocks``, given ``messages``, ``add_generation_prompt``, ``bos_token`` and
        ``eos_token``. The result contains special tokens as text; :meth:`encode` it with
        ``add_bos=False`` when the template writes the BOS itself.

        Raises:
          JaxkvError: if the model has no chat template, or the template rejects the messages.
        """
        if self.chat_template is None:
            raise JaxkvError(f"{self.name}: the model has no chat template; give a plain prompt instead")
        special = {
            f"{role}_token": self.id_to_token(i) if i is not None else ""
            for role, i in (("bos", self.bos_id), ("eos", self.eos_id))
        }
        try:
            return _compile_template(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **special
            )
        except jinja2.TemplateError as e:
            raise JaxkvError(f"{self.name}: chat template failed: {e}") from None


def _raise_exception(message: str):
    raise JaxkvError(f"chat template: {message}")


@functools.lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise JaxkvError(f"chat template does not parse: {e}") from None


class DecodeStream:
    """Turn token ids arriving block by block into text that is safe to print at once.

    Each :meth:`push` returns only the newly completed text: characters whose UTF-8 bytes
    are still arriving (a trailing U+FFFD) are held back until a later push completes them
    or :meth:`flush` gives them up. The ids before the stream (``context_ids``, e.g. the
    prompt) are decoded as context only, so a leading space of the first new token is kept.
    The decoded window is trimmed to the last few ids, so each push costs O(block), not
    O(sequence).
    """

    _KEEP = 8  # ids of context kept when the window is trimmed

    def __init__(self, tokenizer: Tokenizer, context_ids: Sequence[int] = ()):
        self._tokenizer = tokenizer
        self._ids = [int(i) for i in context_ids][-self._KEEP :]
        self._printed = len(tokenizer.decode(self._ids))  # chars of decode(self._ids) already out

    def push(self, ids: Iterable[int]) -> str:
        """Append ``ids``; return the text they complete (possibly "")."""
        self._ids += [int(i) for i in ids]
        text = self._tokenizer.decode(self._ids)
        ready = text.rstrip(_REPLACEMENT)
        out = ready[self._printed :]
        self._printed = max(self._printed, len(ready))
        if len(ready) == len(text) and len(self._ids) > 4 * self._KEEP:
            self._ids = self._ids[-self._KEEP :]
            self._printed = len(self._tokenizer.decode(self._ids))
        return out

    def flush(self) -> str:
        """Return whatever is held back (incomplete characters print as U+FFFD)."""
        text = self._tokenizer.decode(self._ids)
        out = text[self._printed :]
        self._printed = len(text)
        return out
