"""Batch decoding: many prompts from a JSONL file, in ragged batches, results in input order.

``jaxkv batch MODEL --input prompts.jsonl --output results.jsonl`` (and
``scripts/batch_decode.py``) run :func:`run_file`; Python callers use :func:`run_requests`
(text prompts) or :func:`run_rows` (token ids). docs/BATCH.md has the full story.

How rows become compiled calls:

* Rows are sorted by prompt length (less padding: rows of one batch have similar lengths)
  and cut into batches of ``batch_size`` rows, whatever their temperatures: each row's
  sampler is an array entry of the compiled decode loop, not a static argument.
* A short last batch is padded with one-token filler rows (budget 1) up to the next power
  of two, and every batch to a multiple of the mesh's ``data`` size, so batch shapes stay
  few. Prefill chunks are powers of two (:func:`jaxkv.decode.prefill`); a full cache is
  sized ``full_cache_len(the largest prompt + budget of its rows)`` (multiples of 256 slots).
  Each (batch size, chunk, cache spec) is compiled once and reused.
* Rows finish independently (EOS, their own ``max_new_tokens``, a full cache); finished
  rows append nothing while the others go on.
* Every row has its own PRNG seed (its ``seed``, else ``--seed + index``), so a sampled
  row's tokens do not depend on which rows share its batch: they are what
  :func:`jaxkv.sample` draws for its prompt with that seed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from jaxkv.cache import kv
from jaxkv.cache.memory import format_bytes
from jaxkv.cache.spec import CacheSpec, LayerSpecs
from jaxkv.decode import parallel
from jaxkv.decode.loop import full_cache_len, new_cache, new_cache_bytes, prefill_and_decode, to_host
from jaxkv.decode.prompt import check_token_ids, encode_prompt, reply_text
from jaxkv.decode.sampler import SEED_LIMIT, Sampler
from jaxkv.errors import CacheFullError, JaxkvError, check_int
from jaxkv.files import atomic_write, check_writable
from jaxkv.io import LoadedModel

POSITION_LIMIT = 2**31  # positions are int32: a row's prompt + budget stays below this
CacheChoice = CacheSpec | LayerSpecs | Callable[[int], CacheSpec | LayerSpecs] | None


# ---- input -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class Request:
    """One input record.

    Attributes:
      index: 0-based position of the record among the input's non-blank lines.
      line: 1-based line number in the input file.
      prompt: the prompt text (BOS added if the tokenizer adds one; empty = BOS alone).
      max_new_tokens, temperature, seed: per-row overrides (None = the run's defaults).
      id: any JSON value given as ``id``, copied to the result (None = absent).
    """

    index: int
    line: int
    prompt: str
    max_new_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None
    id: Any = None


@dataclasses.dataclass(frozen=True)
class LineError:
    """A record that was skipped: its 1-based line number and why."""

    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


def parse_line(text: str, *, index: int, line: int) -> Request:
    """Parse one JSONL record; raises :class:`JaxkvError` saying what is wrong with it."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise JaxkvError(f"invalid JSON ({e.msg} at column {e.colno})") from None
    except ValueError as e:  # "Exceeds the limit (4300 digits) for integer string conversion: ..."
        raise JaxkvError(f"invalid JSON ({str(e).split(':')[0]})") from None
    except RecursionError:
        raise JaxkvError("invalid JSON (nested too deeply for Python's parser)") from None
    if not isinstance(obj, dict):
        raise JaxkvError(f"expected a JSON object, got {type(obj).__name__}")
    if "prompt" not in obj:
        raise JaxkvError('missing "prompt"')
    prompt = obj["prompt"]
    if not isinstance(prompt, str):
        raise JaxkvError(f'"prompt" must be a string, got {type(prompt).__name__}')
    try:  # JSON allows a lone surrogate ("\ud800"), which is not Unicode text: no tokenizer takes it
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise JaxkvError(
            f'"prompt" holds a lone surrogate {e.object[e.start]!a} at character {e.start}: not valid Unicode text'
        ) from None
    n = obj.get("max_new_tokens")
    if n is not None:
        check_int('"max_new_tokens"', n, 1)
    t = obj.get("temperature")
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0):
        raise JaxkvError(f'"temperature" must be a finite number >= 0, got {t!r}')
    s = obj.get("seed")
    if s is not None:
        check_int('"seed"', s, 0, SEED_LIMIT)
    try:  # the id is copied to the output: it must be writable there
        json.dumps(obj.get("id"), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise JaxkvError(f'"id" holds a lone surrogate {e.object[e.start]!a}: not valid Unicode text') from None
    except RecursionError:
        raise JaxkvError('"id" is nested too deeply to be written back') from None
    return Request(
        index=index,
        line=line,
        prompt=prompt,
        max_new_tokens=n,
        temperature=None if t is None else float(t),
        seed=s,
        id=obj.get("id"),
    )


def parse_requests(lines: Iterable[str | bytes]) -> tuple[list[Request], list[LineError]]:
    """Parse JSONL lines: the valid records and one :class:`LineError` per malformed one.

    Blank lines are ignored; every other line is a record and takes the next ``index``
    (so a malformed record leaves a gap in the result indices, not a shift). A line given
    as bytes is decoded as UTF-8 on its own: one that is not UTF-8 is one malformed record.
    """
    requests, errors, index = [], [], 0
    for line, text in enumerate(lines, start=1):
        if isinstance(text, bytes):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError as e:
                errors.append(LineError(line, f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at byte {e.start + 1})"))
                index += 1
                continue
        if not text.strip():
            continue
        try:
            requests.append(parse_line(text, index=index, line=line))
        except JaxkvError as e:
            errors.append(LineError(line, str(e)))
        index += 1
    return requests, errors


def read_requests(path: str | os.PathLike) -> tuple[list[Request], list[LineError]]:
    """:func:`parse_requests` of a UTF-8 JSONL file, lines ending at ``\\n``, ``\\r\\n`` or ``\\r``
    (a U+2028 inside a JSON string does not split a line). Each line is decoded on its own: a
    line that is not UTF-8 is skipped, not the file.

    Raises:
      JaxkvError: a missing or unreadable file.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise JaxkvError(f"{path}: no such input file") from None
    except OSError as e:
        raise JaxkvError(f"{path}: cannot read it ({e.strerror})") from None
    return parse_requests(data.splitlines())


# ---- decoding ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    """One prompt as token ids with its own budget, temperature and seed (see :func:`run_rows`)."""

    ids: Sequence[int]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowResult:
    """What one row produced.

    Attributes:
      token_ids: generated ids (a stopping EOS included, as in :func:`jaxkv.generate`).
      finish_reason: ``eos``, ``length`` or ``cache_full``.
      stored_tokens: tokens the row's cache held at the end (the StreamingLLM cap shows here).
      prompt_tokens: the prompt's length in tokens.
    """

    token_ids: list
    finish_reason: str
    stored_tokens: int
    prompt_tokens: int


@dataclasses.dataclass
class BatchStats:
    """Counters of a run; seconds are wall time on the host.

    Attributes:
      rows, batches: rows decoded and compiled calls' batches run (filler rows not counted).
      prompt_tokens, generated_tokens: summed over rows.
      prefill_s: prefill wall time (first calls of each shape include their compile).
      decode_s: decode wall time, compile excluded; compile_s: decode-loop compiles.
      wall_s: the whole run.
    """

    rows: int = 0
    batches: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    compile_s: float = 0.0
    wall_s: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens per second of decode, summed over the rows of each batch."""
        return self.generated_tokens / max(self.decode_s, 1e-9)

    def summary(self) -> str:
        return (
            f"{self.rows} rows in {self.batches} batches; {self.prompt_tokens} prompt tokens, "
            f"{self.generated_tokens} generated; prefill {self.prefill_s:.1f} s (compiles included), decode {self.decode_s:.1f} s "
            f"({self.decode_tokens_per_s:.1f} tokens/s summed over rows), compile {self.compile_s:.1f} s, "
            f"wall {self.wall_s:.1f} s"
        )


def plan_batches(rows: Sequence[Row], batch_size: int) -> list[list[int]]:
    """Row indices per batch: sorted by prompt length (then input order), cut into ``batch_size``."""
    order = sorted(range(len(rows)), key=lambda i: (len(rows[i].ids), i))
    return [order[k : k + batch_size] for k in range(0, len(order), batch_size)]


def padded_batch_size(n_rows: int, batch_size: int, multiple: int = 1) -> int:
    """Rows a batch of ``n_rows`` is padded to: ``batch_size`` when full, else the next power of
    two (at most ``batch_size``), then up to a multiple of ``multiple`` (the mesh's data size)."""
    b = batch_size if n_rows >= batch_size else min(batch_size, 1 << max(n_rows - 1, 0).bit_length())
    return multiple * -(-b // multiple)


def resolve_cache(cache: CacheChoice, need: int) -> CacheSpec | LayerSpecs:
    """The batch's spec: ``cache`` itself, ``cache(need)``, or a full fp32 cache of
    ``full_cache_len(need)`` slots when None (``need`` = the largest prompt + budget of its rows)."""
    if cache is None:
        return CacheSpec(max_len=full_cache_len(need))
    if isinstance(cache, (CacheSpec, LayerSpecs)):
        return cache
    return cache(need)


class _RowLimits:
    """What one row may ask of a run, checked before any cache is allocated (:meth:`check`)."""

    def __init__(self, model: LoadedModel, cache: CacheChoice, batch_size: int, mesh):
        self.model, self.cache, self.mesh = model, cache, mesh
        self.batch = padded_batch_size(batch_size, batch_size, parallel.data_size(mesh))  # the most rows of a batch
        self._bytes: dict = {}
        self._free: float | None = None

    def cache_bytes(self, need: int) -> int:
        """Bytes of the cache of a batch (``self.batch`` rows) whose largest row needs ``need`` tokens."""
        spec = resolve_cache(self.cache, need)
        if spec not in self._bytes:
            self._bytes[spec] = new_cache_bytes(self.model.config, spec, self.batch)
        return self._bytes[spec]

    def check(self, row: Row) -> None:
        """Raise :class:`JaxkvError` naming why ``row`` cannot run: no tokens, ids outside the
        vocabulary, a budget < 1, a prompt longer than a fixed full cache, prompt + budget past
        the int32 positions, or (a cache sized per batch) a cache larger than the devices' memory
        (:func:`jaxkv.cache.kv.device_memory`) for a full batch of this row (the message says what would fit)."""
        p = len(row.ids)
        if p == 0:
            raise JaxkvError("run_rows: every prompt needs at least one token")
        n = check_int("max_new_tokens", row.max_new_tokens, 1)
        check_token_ids(row.ids, self.model.config.vocab_size)
        if p + n >= POSITION_LIMIT:
            raise JaxkvError(
                f"max_new_tokens={n} after a prompt of {p} tokens passes the last int32 position "
                f"2**31 - 1: at most max_new_tokens={POSITION_LIMIT - 1 - p}"
            )
        if isinstance(self.cache, (CacheSpec, LayerSpecs)):  # fixed: its size does not depend on the row
            if self.cache.token_limit is not None and p > self.cache.token_limit:
                raise CacheFullError(
                    f"prompt of {p} tokens does not fit a full cache of max_len={self.cache.token_limit}"
                )
            return
        if self._free is None:  # the memory KVCache.create checks the cache against
            memory, _ = kv.device_memory(None if self.mesh is None else list(self.mesh.devices.flat))
            self._free = math.inf if memory is None else memory
        nbytes = self.cache_bytes(p + n)
        if nbytes <= self._free:
            return
        lo, hi = p, p + n - 1  # the largest need that fits (lo = p: not even one new token)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.cache_bytes(mid) <= self._free else (lo, mid - 1)
        fits = f"at most max_new_tokens={lo - p} fits" if lo > p else "not even one new token fits"
        raise JaxkvError(
            f"max_new_tokens={n} after a prompt of {p} tokens needs a cache of "
            f"{resolve_cache(self.cache, p + n).describe()}: {format_bytes(nbytes)} for a batch of "
            f"{self.batch} rows, more than the {format_bytes(self._free)} of memory: {fits} "
            "(or use fewer rows per batch, or a StreamingLLM window)"
        )


def run_rows(
    model: LoadedModel,
    rows: Sequence[Row],
    *,
    batch_size: int = 8,
    cache: CacheChoice = None,
    top_k: int | None = None,
    top_p: float | None = None,
    block: int = 32,
    eos_id: int | None = None,
    mesh=None,
    progress: bool = False,
    stats: BatchStats | None = None,
    on_batch: Callable[[list[int], Any], None] | None = None,
    on_error: Callable[[int, JaxkvError], None] | None = None,
) -> list[RowResult | None]:
    """Decode token-id rows in ragged batches; results in the order of ``rows``.

    Args:
      model: a :class:`LoadedModel` (its tokenizer is not used).
      rows: :class:`Row` s (non-empty ids inside the vocabulary, budgets >= 1).
      batch_size: B, rows per compiled call (>= 1).
      cache: a :class:`CacheSpec` (or :class:`LayerSpecs`) for every batch, a function from the
        tokens a batch needs (the largest prompt + budget of its rows) to a spec, or None for a
        full fp32 cache of ``full_cache_len`` of that.
      top_k, top_p: sampler settings shared by all rows (temperatures are per row).
      block: decode steps per compiled call. eos_id: stop token (None = never stop on one).
      mesh: a :func:`jaxkv.decode.parallel.make_mesh` mesh to shard over, or None (one device).
      progress: show a tqdm bar on stderr. stats: a :class:`BatchStats` to add counters to.
      on_batch: called after each batch with the indices (into ``rows``) of its rows and the
        :class:`jaxkv.BatchGeneration` (rows in batch order, filler rows last; its ``cache``
        is the batch's final cache, e.g. for a memory report or to check shardings).
      on_error: called as ``on_error(i, error)`` for each row that cannot run (checked before
        any decoding: no tokens, ids outside the vocabulary, a budget < 1, a prompt longer than a
        fixed full cache, prompt + budget past the int32 positions, a cache sized per batch that
        would not fit in free memory for a full batch of that row); such a row is left out and
        its result is None. None: the first such row raises.
    Returns:
      one :class:`RowResult` per row (None for a row given to ``on_error``).
    Raises:
      JaxkvError: bad arguments, or a row that cannot run (without ``on_error``); CacheFullError
        (a JaxkvError): a prompt longer than a fixed full cache.
    """
    check_int("batch_size", batch_size, 1)
    limits = _RowLimits(model, cache, batch_size, mesh)
    accepted = []
    for i, r in enumerate(rows):
        try:
            limits.check(r)
        except JaxkvError as e:
            if on_error is None:
                raise
            on_error(i, e)
            continue
        accepted.append(i)
    stats = stats if stats is not None else BatchStats()
    t_start = time.perf_counter()
    if mesh is not None:
        model = parallel.shard_model(model, mesh)
    filler = Row(ids=[0], max_new_tokens=1)
    results: list[RowResult | None] = [None] * len(rows)
    bar = _progress(len(accepted), progress)
    try:
        for planned in plan_batches([rows[i] for i in accepted], batch_size):
            members = [accepted[j] for j in planned]
            batch = [rows[i] for i in members]
            b = padded_batch_size(len(batch), batch_size, parallel.data_size(mesh))
            padded = batch + [filler] * (b - len(batch))
            spec = resolve_cache(cache, max(len(r.ids) + r.max_new_tokens for r in batch))
            out = prefill_and_decode(
                model,
                new_cache(model.config, spec, b, mesh=mesh),
                [list(r.ids) for r in padded],
                max_new_tokens=[r.max_new_tokens for r in padded],
                sampler=[Sampler(temperature=r.temperature, top_k=top_k, top_p=top_p) for r in padded],
                seed=[r.seed % SEED_LIMIT for r in padded],
                block=block,
                eos_id=eos_id,
            )
            stats.prefill_s += out.prefill_s
            stored = to_host(out.cache.stored())
            for j, i in enumerate(members):
                results[i] = RowResult(
                    token_ids=out.token_ids[j],
                    finish_reason=out.finish_reasons[j],
                    stored_tokens=int(stored[j]),
                    prompt_tokens=len(rows[i].ids),
                )
            generated = sum(len(out.token_ids[j]) for j in range(len(batch)))
            stats.rows += len(batch)
            stats.batches += 1
            stats.prompt_tokens += sum(len(r.ids) for r in batch)
            stats.generated_tokens += generated
            stats.decode_s += out.decode_s
            stats.compile_s += out.compile_s
            if on_batch is not None:
                on_batch(members, out)
            bar.update(len(batch))
            bar.set_postfix_str(f"{stats.decode_tokens_per_s:.0f} tok/s", refresh=False)
    finally:
        bar.close()
    stats.wall_s += time.perf_counter() - t_start
    return results


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="row", file=sys.stderr, disable=not enabled, dynamic_ncols=True, desc="jaxkv batch")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Result:
    """One output record (:meth:`to_json` is what the JSONL holds)."""

    index: int
    line: int
    id: Any
    text: str
    token_ids: list
    finish_reason: str
    prompt_tokens: int
    stored_tokens: int

    def to_json(self) -> dict:
        obj = dict(index=self.index, line=self.line)
        if self.id is not None:
            obj["id"] = self.id
        obj.update(
            text=self.text,
            token_ids=self.token_ids,
            finish_reason=self.finish_reason,
            prompt_tokens=self.prompt_tokens,
            generated_tokens=len(self.token_ids),
            stored_tokens=self.stored_tokens,
        )
        return obj


def run_requests(
    model: LoadedModel,
    requests: Sequence[Request],
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    seed: int = 0,
    cache: CacheChoice = None,
    chat: bool = False,
    on_error: Callable[[LineError], None] | None = None,
    **kwargs,
) -> tuple[list[Result], list[LineError]]:
    """Tokenize and decode text requests; results sorted by ``index`` (input order).

    Args:
      model: a :class:`LoadedModel` with a tokenizer.
      requests: from :func:`parse_requests` / :func:`read_requests`.
      max_new_tokens, temperature: defaults for rows that do not set them.
      seed: rows without a ``seed`` use ``(seed + index) mod 2**32``.
      cache: see :func:`run_rows`.
      chat: wrap each prompt in the model's chat template (as one user message).
      on_error: called with each row skipped here, before any decoding: a prompt the tokenizer
        refuses, or a row :func:`run_rows` refuses (a prompt longer than a fixed full cache, a
        budget the cache or the memory cannot hold).
      kwargs: passed to :func:`run_rows` (batch_size, top_k, top_p, block, eos_id, mesh, progress, stats,
        on_batch); ``eos_id`` defaults to the tokenizer's (pass None never to stop on a token).
    Returns:
      ``(results, errors)``: one :class:`Result` per decoded request, and the rows skipped (by line).
    """
    Sampler(temperature=temperature)  # validate the defaults before any work
    check_int("max_new_tokens", max_new_tokens, 1)
    tok = model.tokenizer
    if tok is None:
        raise JaxkvError("run_requests: the model has no tokenizer (use run_rows with token ids)")
    kwargs.setdefault("eos_id", tok.eos_id)
    rows, kept, errors = [], [], []

    def skip(line: int, e: JaxkvError) -> None:
        errors.append(LineError(line, str(e)))
        if on_error is not None:
            on_error(errors[-1])

    for req in requests:
        try:
            ids = encode_prompt(tok, req.prompt, chat=chat)
        except JaxkvError as e:
            skip(req.line, e)
            continue
        rows.append(
            Row(
                ids=ids,
                max_new_tokens=req.max_new_tokens or max_new_tokens,
                temperature=temperature if req.temperature is None else req.temperature,
                seed=(seed + req.index) % SEED_LIMIT if req.seed is None else req.seed,
            )
        )
        kept.append(req)
    out = run_rows(model, rows, cache=cache, on_error=lambda i, e: skip(kept[i].line, e), **kwargs) if rows else []
    results = []
    for req, r in zip(kept, out):
        if r is None:  # refused by run_rows (reported)
            continue
        ids = r.token_ids
        results.append(
            Result(
                index=req.index,
                line=req.line,
                id=req.id,
                text=reply_text(tok, ids, r.finish_reason),
                token_ids=ids,
                finish_reason=r.finish_reason,
                prompt_tokens=r.prompt_tokens,
                stored_tokens=r.stored_tokens,
            )
        )
    results.sort(key=lambda r: r.index)
    errors.sort(key=lambda e: e.line)
    return results, errors


# ---- output ------------------------------------------------------------------------------------
def write_jsonl_atomic(path: str | os.PathLike, records: Iterable[dict]) -> None:
    """Write one JSON object per line to ``path`` atomically: a temporary file in the same
    directory, flushed and fsynced, then ``os.replace``; readers see the old file or the
    complete new one, never a partial one. The temporary file is removed on failure."""
    atomic_write(path, "".join(json.dumps(obj, ensure_ascii=False) + "\n" for obj in records).encode("utf-8"))


def run_file(
    model: LoadedModel,
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    *,
    report: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True),
    **kwargs,
) -> tuple[list[Result], list[LineError], BatchStats]:
    """Read a JSONL of requests, decode them, write the results JSONL atomically, in input order.

    Each malformed line is reported (``report("<input>: line N: why")``) and skipped; the
    other rows still produce results. ``kwargs`` go to :func:`run_requests`. In a
    multi-process run (``jax.distributed``) every process decodes (its share of each
    batch) and only process 0 reports, shows progress and writes the output.

    Raises:
      JaxkvError: unreadable input; an output that cannot be written (checked first, by
        :func:`jaxkv.files.check_writable`; also the input file itself); no valid row, or no
        row that could be decoded (nothing is written then).
    """
    check_writable(output_path, not_same_as=input_path)
    lead = parallel.is_lead()
    if not lead:
        report = lambda msg: None  # noqa: E731
        kwargs["progress"] = False
    requests, errors = read_requests(input_path)
    name = os.fspath(input_path)
    for e in errors:
        report(f"{name}: {e} (skipped)")
    if not requests:
        raise JaxkvError(f"{name}: no valid rows ({len(errors)} malformed)")
    stats = kwargs.pop("stats", None) or BatchStats()
    results, skipped = run_requests(
        model, requests, stats=stats, on_error=lambda e: report(f"{name}: {e} (skipped)"), **kwargs
    )
    if not results:
        raise JaxkvError(f"{name}: no row could be decoded ({len(errors)} malformed, {len(skipped)} skipped)")
    if lead:
        try:
            write_jsonl_atomic(output_path, (r.to_json() for r in results))
        except OSError as e:
            raise JaxkvError(f"{output_path}: cannot write the results ({e})") from None
    return results, sorted(errors + skipped, key=lambda e: e.line), stats
