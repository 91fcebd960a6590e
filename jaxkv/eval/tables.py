"""KIVI tables: cache memory by mode (bytes of the pytree leaves), and greedy agreement with fp32.

(a) **Memory**, by default at SmolLM2-135M's KV shape (30 layers, 3 KV heads, head dim 64,
B = 1), G = 32, R = 32, counted from the *allocated* pytree leaves of ``KVCache.create``
(zeros, so cheap) with :func:`jaxkv.memory_report`: everything is included (codes, scales
and zeros, the full-precision residual, sinks, position arrays and lengths).

"N stored tokens" means a cache with exactly N token slots per row and layer, every one of
which holds a token once N tokens have been appended:

* fp32 / fp16 / bf16: a full cache, ``CacheSpec(max_len=N)``;
* int8 / int4 / int2: a KIVI window of ``W = N - R`` quantised slots plus the ``R``-token
  full-precision residual, ``CacheSpec(window=N - R, residual=R, group_size=G)``. With the
  lazy flush (DESIGN §2), after N tokens the quantised ring holds
  ``R * floor((N - 1) / R) = N - R`` tokens and the residual the last R: all N stored.

(b) **Greedy match**: prompts decoded together (``generate``, ragged batch), ``new_tokens``
each, greedy, EOS disabled (``eos_id=-1``, so every row runs every step), with a *full*
cache of ``longest prompt + new_tokens`` slots in each mode. KIVI modes use G = R = 32 by
default: with R = 128 a ~110-token sequence would never leave the residual and nothing
would be quantised. The score of a prompt is the fraction of the fp32-cache tokens
reproduced before the first divergence (1.0 = all identical).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from jaxkv.cache.kv import KVCache
from jaxkv.cache.memory import MemoryReport, memory_report
from jaxkv.cache.spec import QUANT_MODES, CacheSpec
from jaxkv.decode import generate, plan_chunks
from jaxkv.errors import JaxkvError
from jaxkv.io import LoadedModel

SMOLLM2_SHAPE = dict(n_layers=30, n_kv_heads=3, head_dim=64)
MEMORY_TOKENS = (128, 256, 512, 1024, 2048)
MEMORY_MODES = ("fp32", "bf16", "int8", "int4", "int2")
GREEDY_MODES = ("bf16", "int8", "int4", "int2")
GROUP_SIZE = 32
RESIDUAL = 32
NEW_TOKENS = 100
PROMPTS = (
    # the prior implementation's four
    "The first president of the United States",
    "In machine learning,",
    "Once upon a time",
    "Photosynthesis is",
    # four more: a story opening, dialogue, a list, a question
    "Lily and her dog went to the park. They",
    '"Can I have a cookie?" asked Tom. His mom said',
    "The three primary colors are",
    "Why is the sky blue? The sky is blue because",
)


# ------------------------------------------------------------------------- (a) memory


def memory_spec(mode: str, tokens: int, *, group_size: int = GROUP_SIZE, residual: int = RESIDUAL) -> CacheSpec:
    """The cache with exactly ``tokens`` token slots per row and layer in ``mode`` (see the module docstring).

    Raises:
      JaxkvError: as :class:`CacheSpec` (e.g. ``tokens - residual`` not a positive multiple of ``group_size``).
    """
    if mode in QUANT_MODES:
        return CacheSpec(window=tokens - residual, kv_quantize=mode, group_size=group_size, residual=residual)
    return CacheSpec(max_len=tokens, kv_quantize=mode)


def allocated_report(spec: CacheSpec, *, batch: int = 1, shape: dict = SMOLLM2_SHAPE) -> tuple[MemoryReport, int]:
    """:class:`jaxkv.MemoryReport` of a freshly allocated cache, and the summed bytes of its pytree leaves.

    Args:
      spec: the cache.
      batch: rows B.
      shape: ``dict(n_layers=L, n_kv_heads=K, head_dim=H)``.
    Returns:
      ``(report, leaf_bytes)``: ``leaf_bytes`` = sum of ``nbytes`` over every leaf (int, bytes),
      which ``report.allocated_bytes`` must equal.
    """
    cache = KVCache.create(spec, batch=batch, **shape)
    leaves = sum(int(x.nbytes) for x in jax.tree.leaves(cache))
    return memory_report(cache), leaves


def filled_report(spec: CacheSpec, tokens: int, *, shape: dict = SMOLLM2_SHAPE) -> MemoryReport:
    """:class:`jaxkv.MemoryReport` of a one-row cache after ``tokens`` tokens (zeros) appended through the cache API.

    For a cache whose capacity is not exactly ``tokens`` slots: ``live_bytes`` counts only
    the slots holding a token. One compile per spec and shape (chunks of ``spec.max_chunk``,
    planned by :func:`jaxkv.decode.plan_chunks`).

    Args:
      spec: the cache; tokens: tokens appended (>= 0); shape: as :func:`allocated_report`.
    """
    cache = KVCache.create(spec, batch=1, **shape)
    t = spec.max_chunk
    kv = jnp.zeros((shape["n_layers"], 1, shape["n_kv_heads"], t, shape["head_dim"]), jnp.float32)

    def append(cache, n):  # entries >= n ignored
        cache, step = cache.begin(n, t)
        return cache.commit(step, kv, kv)

    step = jax.jit(append)  # one compile
    for chunk in plan_chunks(spec, [0], [tokens], t):
        cache = step(cache, jnp.asarray(chunk.n))
    return memory_report(cache)


def memory_rows(
    tokens=MEMORY_TOKENS,
    modes=MEMORY_MODES,
    *,
    group_size: int = GROUP_SIZE,
    residual: int = RESIDUAL,
    shape: dict = SMOLLM2_SHAPE,
) -> list[dict]:
    """The memory table: one dict per (stored tokens, mode), caches of :func:`memory_spec`.

    Returns:
      ``[{"tokens": N, "mode": str, "capacity": slots, "bytes": allocated bytes,
      "leaf_bytes": bytes summed over the pytree leaves (equal to "bytes"), "groups":
      {group: bytes} (codes, scales_zeros, residual, sinks, bookkeeping),
      "ratio_vs_bf16": bf16 bytes / these bytes}, ...]``, tokens-major.
    Raises:
      JaxkvError: as :func:`memory_spec`.
    """
    rows = []
    for n in tokens:
        reports = {
            m: allocated_report(memory_spec(m, n, group_size=group_size, residual=residual), shape=shape) for m in modes
        }
        bf16 = (
            reports["bf16"][0].allocated_bytes
            if "bf16" in reports
            else allocated_report(memory_spec("bf16", n), shape=shape)[0].allocated_bytes
        )
        for m in modes:
            rep, leaves = reports[m]
            rows.append(
                dict(
                    tokens=n,
                    mode=m,
                    capacity=rep.capacity,
                    bytes=rep.allocated_bytes,
                    leaf_bytes=leaves,
                    groups=dict(rep.allocated),
                    ratio_vs_bf16=bf16 / rep.allocated_bytes,
                )
            )
    return rows


def memory_markdown(rows: list[dict]) -> str:
    """:func:`memory_rows` as markdown: MiB (2**20 bytes) and ratio per (tokens, mode), then the
    bytes by group at the largest token count."""
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    tokens = list(dict.fromkeys(r["tokens"] for r in rows))
    cell = {(r["tokens"], r["mode"]): r for r in rows}
    out = ["| stored tokens | " + " | ".join(modes) + " |", "|---:|" + "---:|" * len(modes)]
    for n in tokens:
        out.append(
            f"| {n} | "
            + " | ".join(f"{cell[n, m]['bytes'] / 2**20:.3f} MiB ({cell[n, m]['ratio_vs_bf16']:.2f}x)" for m in modes)
            + " |"
        )
    out.append("")
    out.append(f"Breakdown at {tokens[-1]} stored tokens (bytes):")
    out.append("")
    groups = [g for g in rows[0]["groups"]]
    out.append("| mode | " + " | ".join(groups) + " | total |")
    out.append("|---|" + "---:|" * (len(groups) + 1))
    for m in modes:
        r = cell[tokens[-1], m]
        out.append(f"| {m} | " + " | ".join(str(r["groups"][g]) for g in groups) + f" | {r['bytes']} |")
    return "\n".join(out)


# ------------------------------------------------------------------- (b) greedy match


def prefix_match(reference, got) -> float:
    """Fraction of the tokens of ``reference`` that ``got`` reproduces before the first divergence.

    Args:
      reference, got: token id sequences (``got`` may be shorter or longer).
    Returns:
      ``n / len(reference)`` in [0, 1], ``n`` = length of the common prefix in tokens.
    Raises:
      JaxkvError: an empty ``reference``.
    """
    if len(reference) == 0:
        raise JaxkvError("prefix_match: the reference has no tokens")
    n = 0
    for a, b in zip(reference, got):
        if a != b:
            break
        n += 1
    return n / len(reference)


def greedy_match(
    model: LoadedModel,
    prompts=PROMPTS,
    *,
    modes=GREEDY_MODES,
    new_tokens: int = NEW_TOKENS,
    group_size: int = GROUP_SIZE,
    residual: int = RESIDUAL,
) -> dict:
    """Greedy-decode ``prompts`` together with an fp32 full cache and with each of ``modes``.

    Args:
      model: a :class:`jaxkv.LoadedModel` (its tokenizer encodes the prompts, BOS as the model's default).
      prompts: texts, decoded as one ragged batch.
      modes: cache modes to compare with fp32 (float or KIVI; KIVI with ``group_size``/``residual``),
        or a mapping ``{label: spec(max_len)}`` for any other full cache: ``spec`` takes the slots
        the run needs (longest prompt + ``new_tokens``) and returns the
        :class:`jaxkv.CacheSpec` (or per-layer specs) to decode with.
      new_tokens: tokens generated per prompt (EOS disabled).
    Returns:
      ``{"reference": [[ids]], "fp32": timing, "prompt_lengths": [tokens], "modes": {mode: {"per_prompt":
      [:func:`prefix_match`], "mean": float, "exact": int rows, "tokens": [[ids]], **timing}}}`` (``mode``:
      the label for a mapping); ``timing`` holds wall ``seconds``, ``cpu_seconds`` (all threads) and
      generate's ``compile_s``/``prefill_s``/``decode_s``.
    Raises:
      JaxkvError: as :func:`jaxkv.generate` and :class:`jaxkv.CacheSpec`.
    """
    ids = [model.tokenizer.encode(p) for p in prompts]
    max_len = max(len(p) for p in ids) + new_tokens

    def mode_spec(mode):
        return lambda slots: CacheSpec(
            max_len=slots, kv_quantize=mode, group_size=group_size, residual=residual
        )  # G, R: KIVI only

    specs = dict(modes) if isinstance(modes, Mapping) else {mode: mode_spec(mode) for mode in modes}

    def run(make_spec):
        t0, c0 = time.perf_counter(), time.process_time()
        spec = make_spec(max_len)
        out = generate(model, ids, max_new_tokens=new_tokens, cache=spec, eos_id=-1)
        assert all(len(t) == new_tokens for t in out.token_ids), out.finish_reasons
        timing = dict(
            seconds=time.perf_counter() - t0,
            cpu_seconds=time.process_time() - c0,
            compile_s=out.compile_s,
            prefill_s=out.prefill_s,
            decode_s=out.decode_s,
        )
        return out.token_ids, timing

    reference, ref_timing = run(mode_spec("fp32"))
    result = dict(reference=reference, fp32=ref_timing, prompt_lengths=[len(p) for p in ids], modes={})
    for mode, make_spec in specs.items():
        got, timing = run(make_spec)
        per = [prefix_match(r, g) for r, g in zip(reference, got)]
        result["modes"][mode] = dict(
            per_prompt=per, mean=sum(per) / len(per), exact=sum(p == 1.0 for p in per), tokens=got, **timing
        )
    return result


def greedy_markdown(results: dict) -> str:
    """``{model name: greedy_match(...)}`` as markdown: mean prefix match (exact rows) per mode, then per prompt."""
    modes = list(next(iter(results.values()))["modes"])
    first = next(iter(results.values()))["reference"]
    n, steps = len(first), len(first[0])
    out = [
        f"Mean prefix match with the fp32 cache ({n} prompts, {steps} greedy tokens each; exact rows in brackets):",
        "",
        "| model | " + " | ".join(modes) + " |",
        "|---|" + "---:|" * len(modes),
    ]
    for name, res in results.items():
        out.append(
            f"| {name} | "
            + " | ".join(f"{res['modes'][m]['mean']:.3f} ({res['modes'][m]['exact']}/{n})" for m in modes)
            + " |"
        )
    out += ["", "Per prompt (fraction before the first divergence):", ""]
    out.append("| model | mode | " + " | ".join(f"p{i}" for i in range(n)) + " |")
    out.append("|---|---|" + "---:|" * n)
    for name, res in results.items():
        for m in modes:
            out.append(f"| {name} | {m} | " + " | ".join(f"{x:.2f}" for x in res["modes"][m]["per_prompt"]) + " |")
    return "\n".join(out)
