"""Prompts in and replies out: chat-template encoding of a message list, empty prompt -> BOS, token-id checks, stop strings, reply text."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxkv.errors import JaxkvError


def encode_prompt(tokenizer, prompt: str, *, chat: bool = False) -> list[int]:
    """Token ids of a text prompt, as :func:`jaxkv.sample` and ``jaxkv batch`` feed it.

    Args:
      tokenizer: the model's :class:`~jaxkv.io.tokenizer.Tokenizer`.
      prompt: the text. chat: wrap it in the tokenizer's chat template as one user message
        (the template writes any BOS itself: none is added).
    Returns:
      the ids: the tokenizer's BOS first if it adds one; an empty prompt is BOS alone.
    Raises:
      JaxkvError: an empty prompt and a tokenizer without BOS; no chat template (with ``chat``).
    """
    if chat:
        return encode_messages(tokenizer, [{"role": "user", "content": prompt}])
    return _bos_if_empty(tokenizer, tokenizer.encode(prompt))


def encode_messages(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of a conversation rendered by the tokenizer's chat template with the
    generation prompt, as the model reads it (``jaxkv sample --chat`` and ``jaxkv serve``'s
    ``/v1/chat/completions`` encode prompts with it).

    Args:
      tokenizer: the model's :class:`~jaxkv.io.tokenizer.Tokenizer`.
      messages: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``.
    Returns:
      the ids: the template writes any BOS itself (none is added); a rendering that encodes to
      no tokens is BOS alone.
    Raises:
      JaxkvError: no chat template, a template that rejects the messages, or nothing to encode
      and no BOS.
    """
    return _bos_if_empty(tokenizer, tokenizer.encode(tokenizer.apply_chat_template(list(messages)), add_bos=False))


def _bos_if_empty(tokenizer, ids: list[int]) -> list[int]:
    if ids:
        return ids
    if tokenizer.bos_id is None:
        raise JaxkvError("empty prompt and the tokenizer has no BOS token to start from")
    return [tokenizer.bos_id]


def prompt_text(tokenizer, prompt: str, *, chat: bool = False) -> str:
    """The text :func:`encode_prompt` encodes: ``prompt`` itself, or with ``chat`` the chat
    template's rendering of it as one user message (special tokens as text).

    Raises:
      JaxkvError: no chat template (with ``chat``).
    """
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt


def stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """``stop`` (None, one string, or a list or tuple of them) as a tuple of stop strings.

    Raises:
      JaxkvError: an empty string, or something that is not a string.
    """
    stops = tuple(stop) if isinstance(stop, (list, tuple)) else () if stop is None else (stop,)
    for s in stops:
        if not isinstance(s, str) or not s:
            raise JaxkvError(f"stop string {s!r}: expected a non-empty string")
    return stops


def check_token_ids(ids: Sequence[int], vocab_size: int, what: str = "token id") -> None:
    """Raise :class:`JaxkvError` naming the first id outside ``[0, vocab_size)`` (``what`` starts the message)."""
    a = np.asarray(ids, np.int64).reshape(-1)
    bad = (a < 0) | (a >= vocab_size)
    if bad.any():
        raise JaxkvError(f"{what} {int(a[bad][0])} is outside the vocabulary [0, {vocab_size})")


def reply_text(tokenizer, ids: Sequence[int], finish_reason: str) -> str:
    """The text of generated ``ids``; a stopping EOS (``finish_reason == "eos"``) is not part of it."""
    return tokenizer.decode(list(ids[:-1]) if finish_reason == "eos" else list(ids))
