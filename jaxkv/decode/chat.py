"""Endless chat: a multi-turn conversation over one bounded KV cache, saved and resumed.

Multi-round dialogue is what StreamingLLM was made for (Xiao et al. 2023, §1 and §4.3):
with a sinks + window cache, old turns are evicted while the sinks stay, so the
conversation never runs out of cache. :class:`ChatSession` holds the cache (an immutable
:class:`KVCache` pytree, one row) between turns and feeds each turn *only its new tokens*.

Turn rendering. The cache must hold exactly the token stream of the model's chat template
(``apply_chat_template`` of the whole conversation), built turn by turn:

* the first turn (also after :meth:`ChatSession.reset`) is the template of
  ``[system?, user]`` with the generation prompt. Templates that inject a default system
  prompt (SmolLM2's ChatML) do so here, once. It gets the tokenizer's BOS only when the
  tokenizer adds one and the template did not already write it;
* a later turn is the text the template writes *after the previous reply's content*: the
  template is rendered over a fixed context ``[system?, user: <sentinel>, assistant:
  <sentinel>, user: message]`` and the text after the assistant sentinel is taken (the
  reply's closing marker, e.g. ``<|im_end|>\\n``, the new user message and the generation
  prompt). The context has constant size, so a turn costs O(message), not O(conversation),
  and a default system prompt is never repeated.

The pending token. :func:`jaxkv.decode.decode` leaves the last sampled token of a reply
out of the cache (it was never fed back). It is kept as ``pending`` and fed first in the
next turn. If the reply stopped at EOS (``<|im_end|>`` for ChatML) the pending token *is*
the template's closing marker, so that marker (and whitespace before it) is dropped from
the rendered text; if it stopped at the token budget, the reply's last token is fed and
then the full closing marker. Either way the cache ends up holding the template's
transcript, with the reply's own token ids (not a re-tokenisation of its text).

Default cache: ``sink 4 + window 1020`` (1024 slots; fewer if the model's context is
shorter) with ``positions="cache"`` (StreamingLLM §3.2: RoPE positions are ranks in the
cache, so they never exceed the model's trained context however long the chat). It never
runs out. A full cache (``CacheSpec(max_len=N)``) refuses a turn that does not fit with a
:class:`CacheFullError`; a reply that fills it stops with ``finish_reason="cache_full"``.

Save and resume. :meth:`ChatSession.save` writes a ``jaxkv-chat/3`` file with the generic
cache checkpoint (:mod:`jaxkv.cache.checkpoint`: safetensors, atomic, fsync, mode 0600, SHA-256
over everything): the cache leaves as their live prefixes (the file grows with the tokens the
cache holds: a short chat with the 1,024-slot default cache is a few MB, not 47), the
conversation's token ids, and string metadata (counters, the pending token, sampler, messages,
and the model's identity: config fields, parameter dtype, tokenizer ids, a hash of the chat
template, a SHA-256 of the embedding weights plus strided samples of every other weight). A
cache with no empty slot is written as ``jaxkv-chat/2`` (every leaf whole), the same arrays
and metadata as before; both are read. :meth:`ChatSession.load` refuses a file for another
model or cache spec (naming what differs), and a truncated, corrupt or inconsistent one
(every field checked: a missing entry, a count, a token id, a cache length unlike the
transcript's) with a :class:`JaxkvError` naming the file and the field.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.cache.checkpoint import load_cache, save_cache
from jaxkv.cache.kv import KVCache
from jaxkv.cache.memory import format_bytes, memory_report
from jaxkv.cache.spec import CacheSpec, LayerSpecs
from jaxkv.decode.loop import FINISH_REASONS, STREAM_S, model_cache_spec, new_cache, prefill_and_decode
from jaxkv.decode.prompt import check_token_ids, reply_text
from jaxkv.decode.sampler import SEED_LIMIT, Sampler
from jaxkv.decode.text import text_stream
from jaxkv.errors import INT32_LIMIT, CacheFullError, JaxkvError, check_int
from jaxkv.io import LoadedModel
from jaxkv.models.weights import HELD_FORMS, legacy_leaves

FILE_FORMAT = "jaxkv-chat/3"  # 3: cache leaves stored as live prefixes (checkpoint's prefix_format)
WHOLE_FORMAT = "jaxkv-chat/2"  # 2: KIVI codes in the split-half bit layout, every leaf whole
_USER_SENTINEL = "JAXKV_SENTINEL_USER_8c1f"
_REPLY_SENTINEL = "JAXKV_SENTINEL_REPLY_8c1f"
_SAMPLED_ELEMENTS = 4096  # elements hashed per non-embedding weight in the model fingerprint


DEFAULT_SINK = 4
DEFAULT_CACHE_TOKENS = 1024
"""The default cache's sinks and retained tokens (:func:`default_cache_spec`: ``jaxkv chat``'s and
``jaxkv serve``'s cache when no cache size is given), capped by the model's trained context."""


def default_cache_spec(
    config,
    *,
    kv_quantize: str = "fp32",
    group_size: int = 32,
    residual: int = 128,
    positions: str = "cache",
    sink: int = DEFAULT_SINK,
    slots: int = DEFAULT_CACHE_TOKENS,
    k_quantize: str | None = None,
    v_quantize: str | None = None,
    residual_dtype: str = "float32",
    pre_rope_keys: bool = False,
    hadamard: str = "none",
    codebook: str = "uniform",
    clip: bool = False,
    scale_dtype: str = "float16",
    keep: int = 0,
    keep_score: str = "recent",
    keep_quantize: str | None = None,
) -> CacheSpec:
    """The chat's default cache: a StreamingLLM cache that never runs out.

    ``config``: the model's (its ``max_seq_len``, the trained context, is read).
    ``sink`` sinks plus a window filling ``min(slots, config.max_seq_len)`` retained tokens
    (``sink 4 + window 1020`` for SmolLM2; ``4 + 508`` for stories260K's 512-token
    context). With KIVI the residual counts towards the retained tokens and the window is
    rounded down to a multiple of ``group_size``. ``positions="cache"`` keeps RoPE
    positions below the retained count (StreamingLLM §3.2), hence inside the model's context.
    ``k_quantize``, ``v_quantize``, ``residual_dtype``, ``pre_rope_keys``, ``hadamard``, ``codebook``,
    ``clip``, ``scale_dtype``, ``keep``,
    ``keep_score``, ``keep_quantize``: as :class:`CacheSpec` takes them (a keep tier's slots come
    on top of the window).

    Raises:
      JaxkvError: sizes that leave no valid window (the message names them).
    """
    total = min(slots, config.max_seq_len)
    # the storage of a spec that has validated these values (named errors, not a division by zero)
    modes = dict(
        kv_quantize=kv_quantize,
        k_quantize=k_quantize,
        v_quantize=v_quantize,
        residual_dtype=residual_dtype,
        pre_rope_keys=pre_rope_keys,
        hadamard=hadamard,
        codebook=codebook,
        clip=clip,
        scale_dtype=scale_dtype,
    )
    storage = CacheSpec(max_len=1, group_size=group_size, residual=residual, positions=positions, **modes).storage
    window = storage.window_for(total - sink)
    if window < 1:
        raise JaxkvError(
            f"default chat cache: {total} retained tokens leave no window after sink={sink}"
            + (f" and residual={residual}" if storage.flush else "")
            + "; pass --streaming-llm-window M (CacheSpec(window=M)) explicitly"
        )
    return CacheSpec(
        sink=sink,
        window=window,
        group_size=group_size,
        residual=residual,
        positions=positions,
        keep=keep,
        keep_score=keep_score,
        keep_quantize=keep_quantize,
        **modes,
    )


@dataclasses.dataclass(frozen=True)
class ChatStats:
    """What :meth:`ChatSession.stats` returns.

    Attributes:
      turns: replies so far (since creation or the last reset).
      tokens_seen: tokens appended to the cache over the whole conversation (the last reply's
        last token is appended by the next turn, see :attr:`ChatSession.pending_token`).
      tokens_stored: tokens the cache holds now (at most ``capacity``).
      capacity: token slots of the cache (sinks + window/residual + quantised ring).
      cache_bytes: bytes allocated for the cache (every leaf).
      cache_live_bytes: bytes of the slots holding a live token (bookkeeping counted whole).
      spec: the cache spec.
    """

    turns: int
    tokens_seen: int
    tokens_stored: int
    capacity: int
    cache_bytes: int
    cache_live_bytes: int
    spec: CacheSpec | LayerSpecs

    def summary(self) -> str:
        """One line, e.g. ``tokens seen 812, tokens stored 64 (capacity 64), cache 80.00 KiB allocated, 80.00 KiB live``."""
        return (
            f"tokens seen {self.tokens_seen}, tokens stored {self.tokens_stored} (capacity {self.capacity}), "
            f"cache {format_bytes(self.cache_bytes)} allocated, {format_bytes(self.cache_live_bytes)} live; "
            f"{self.turns} turns; {self.spec.describe()}"
        )


class ChatSession:
    """A conversation with a model over one KV cache that lives between turns.

    Args:
      model: a :class:`LoadedModel` whose tokenizer has a chat template (or pass ``chat_template``).
      cache: the cache spec, or :class:`~jaxkv.LayerSpecs` (one per layer, e.g. boosted layers);
        None = :func:`default_cache_spec` (StreamingLLM, never runs out).
      sampler: the next-token rule (default greedy). seed: PRNG seed; the PRNG stream
        continues across turns (and across save/load).
      max_new_tokens: most tokens per reply (>= 1).
      system: a system message, sent with the first turn (None = the template's default, if any).
      chat_template: a Jinja chat template overriding the tokenizer's.
      block: decode steps per compiled call, i.e. how often ``on_text`` is called.
    Attributes:
      messages: the conversation as ``[{"role", "content"}]`` (system message included).
      last_logits: float32[V], the logits the last reply's first token was drawn from (the
        model's output after the last turn's prompt), None before the first turn.
      last_reply_ids: the last reply's token ids (a stopping EOS included).
      finish_reason: why the last reply stopped: ``eos``, ``length`` or ``cache_full``.
    Raises:
      JaxkvError: no chat template, bad counts, a sampler that is not a :class:`Sampler`.
    """

    def __init__(
        self,
        model: LoadedModel,
        cache: CacheSpec | LayerSpecs | None = None,
        *,
        sampler: Sampler = Sampler(),
        seed: int = 0,
        max_new_tokens: int = 256,
        system: str | None = None,
        chat_template: str | None = None,
        block: int = 8,
    ):
        if not isinstance(model, LoadedModel):
            raise JaxkvError(f"ChatSession: model must be a LoadedModel (jaxkv.load_model), got {type(model).__name__}")
        if model.tokenizer is None:
            raise JaxkvError("ChatSession: the model has no tokenizer")
        if chat_template is not None:
            tok = copy.copy(model.tokenizer)
            tok.chat_template = chat_template
            model = dataclasses.replace(model, tokenizer=tok)
        if model.tokenizer.chat_template is None:
            raise JaxkvError(
                f"{model.tokenizer.name}: the model has no chat template; give one with --chat-template JINJA|FILE (CLI) or chat_template=... (Python)"
            )
        if not isinstance(sampler, Sampler):
            raise JaxkvError(f"ChatSession: sampler must be a jaxkv.Sampler, got {type(sampler).__name__}")
        for name, value, low, high in (
            ("max_new_tokens", max_new_tokens, 1, INT32_LIMIT),
            ("block", block, 1, None),
            ("seed", seed, 0, SEED_LIMIT),
        ):
            check_int(f"ChatSession: {name}", value, low, high)
        if system is not None and not isinstance(system, str):
            raise JaxkvError(f"ChatSession: system={system!r}, expected a string or None")
        if cache is not None and not isinstance(cache, (CacheSpec, LayerSpecs)):
            raise JaxkvError(f"ChatSession: cache must be a CacheSpec, LayerSpecs or None, got {type(cache).__name__}")
        self.model = model
        self.spec = cache if cache is not None else default_cache_spec(model.config)
        self.sampler, self.seed, self.max_new_tokens = sampler, seed, max_new_tokens
        self.system, self.block = system, block
        self._fingerprint: str | None = None
        self.reset()

    # ---- state ----------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the conversation: an empty cache, no pending token, PRNG stream back at its start."""
        self._cache = new_cache(self.model.config, self.spec, 1)
        self._pending: int | None = None
        self._step = 0
        self._turns = 0
        self._transcript: list[int] = []
        self.messages: list[dict] = [] if self.system is None else [{"role": "system", "content": self.system}]
        self.last_logits: np.ndarray | None = None
        self.last_reply_ids: list[int] = []
        self.finish_reason: str | None = None

    @property
    def cache(self) -> KVCache:
        """The current cache (the conversation minus the pending token). Do not donate it."""
        return self._cache

    @property
    def pending_token(self) -> int | None:
        """The last reply's last token, not yet in the cache (fed first in the next turn)."""
        return self._pending

    @property
    def transcript_ids(self) -> list[int]:
        """Every token of the conversation in order: all tokens fed to the cache, then the pending one."""
        return list(self._transcript)

    @property
    def tokens_seen(self) -> int:
        """Tokens appended to the cache so far."""
        return int(np.asarray(self._cache.length)[0])

    def stats(self) -> ChatStats:
        """Tokens seen and stored, cache bytes allocated and live (see :class:`ChatStats`)."""
        r = memory_report(self._cache)
        return ChatStats(
            turns=self._turns,
            tokens_seen=r.tokens_seen[0],
            tokens_stored=r.tokens_stored[0],
            capacity=r.capacity,
            cache_bytes=r.allocated_bytes,
            cache_live_bytes=r.live_bytes,
            spec=self.spec,
        )

    # ---- a turn -----------------------------------------------------------------------------------
    def turn_ids(self, message: str) -> list[int]:
        """The token ids the next :meth:`send` of ``message`` feeds (pending token first); no side effects."""
        if not isinstance(message, str):
            raise JaxkvError(f"ChatSession.send: message must be a string, got {type(message).__name__}")
        tok = self.model.tokenizer
        system = [] if self.system is None else [{"role": "system", "content": self.system}]
        user = {"role": "user", "content": message}
        if self._pending is None:  # the first turn: the whole template, default system prompt included
            text = tok.apply_chat_template(system + [user], add_generation_prompt=True)
            bos = tok.id_to_token(tok.bos_id) if tok.bos_id is not None else None
            add_bos = bool(tok.add_bos and bos is not None and not text.startswith(bos))
            return tok.encode(text, add_bos=add_bos)
        context = system + [
            {"role": "user", "content": _USER_SENTINEL},
            {"role": "assistant", "content": _REPLY_SENTINEL},
            user,
        ]
        text = tok.apply_chat_template(context, add_generation_prompt=True)
        at = text.find(_REPLY_SENTINEL)
        if at < 0:
            raise JaxkvError(
                f"{tok.name}: the chat template does not write an assistant message's content verbatim, "
                "so a turn cannot be rendered on its own"
            )
        suffix = text[at + len(_REPLY_SENTINEL) :]
        if self.finish_reason == "eos" and tok.eos_id is not None:
            eos = tok.id_to_token(tok.eos_id)
            end = suffix.find(eos)
            if end >= 0 and not suffix[:end].strip():  # the pending EOS is the template's closing marker
                suffix = suffix[end + len(eos) :]
        return [self._pending] + tok.encode(suffix, add_bos=False)

    def send(self, message: str, on_text: Callable[[str], None] | None = None) -> str:
        """Add a user message, generate the reply into the same cache, return its text.

        Only the new turn's tokens are prefilled (the previous reply's pending token, the
        rendered turn); the reply streams through ``on_text`` (pieces of text, as decode
        blocks complete) and stops at the tokenizer's EOS, ``max_new_tokens``, or a full cache.
        A call that raises (or is interrupted) leaves the session as it was before it.

        Raises:
          CacheFullError: a full cache (``window=None``) without room for this turn's tokens.
          JaxkvError: a message that is not a string, token ids outside the model's vocabulary.
        """
        model, tok = self.model, self.model.tokenizer
        ids = self.turn_ids(message)
        check_token_ids(ids, model.config.vocab_size, "rendered turn: token id")
        limit = self.spec.token_limit
        if limit is not None and self.tokens_seen + len(ids) > limit:
            raise CacheFullError(
                f"this turn needs {len(ids)} tokens but the full cache has {limit - self.tokens_seen} of its "
                f"max_len={limit} slots left: reset the conversation (/reset) or use a StreamingLLM cache "
                "(--streaming-llm-window M)"
            )
        before = jax.tree.map(jnp.copy, self._cache)  # prefill and decode donate the cache
        try:
            on_block, flush = text_stream(tok, ids, on_text)
            result = prefill_and_decode(
                model,
                self._cache,
                [ids],
                max_new_tokens=[self.max_new_tokens],
                sampler=self.sampler,
                seed=self.seed,
                step=self._step,
                block=self.block,
                eos_id=tok.eos_id,
                on_block=on_block,
                stream_s=None if on_text is None else STREAM_S,
            )
            flush()
        except BaseException:
            self._cache = before
            raise
        reply, reason = result.token_ids[0], result.finish_reasons[0]
        self._cache = result.cache
        self._transcript += (ids[1:] if self._pending is not None else ids) + reply
        self._pending = reply[-1]
        self._step += len(reply)
        self._turns += 1
        self.last_logits = np.asarray(result.logits[0])
        self.last_reply_ids, self.finish_reason = list(reply), reason
        text = reply_text(tok, reply, reason)
        self.messages += [{"role": "user", "content": message}, {"role": "assistant", "content": text}]
        return text

    # ---- save / load ------------------------------------------------------------------------------
    def model_identity(self) -> dict:
        """What a saved file must match: config fields, parameter dtype, tokenizer and a weights fingerprint."""
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.model)
        return _identity(self.model, self._fingerprint)

    def save(self, path: str | os.PathLike) -> None:
        """Write the session to ``path`` (safetensors), atomically: an interrupted save leaves the old file.

        The file is :func:`jaxkv.cache.checkpoint.save_cache` of the cache (leaves as live
        prefixes: ``jaxkv-chat/3``; ``jaxkv-chat/2`` when no slot is empty), with the
        conversation's token ids (``transcript``) and metadata ``model`` (:meth:`model_identity`) and ``state``.

        Raises:
          OSError: the directory is not writable (nothing is left behind).
        """
        state = {
            "turns": self._turns,
            "step": self._step,
            "pending": self._pending,
            "finish_reason": self.finish_reason,
            "seed": self.seed,
            "max_new_tokens": self.max_new_tokens,
            "sampler": dataclasses.asdict(self.sampler),
            "system": self.system,
            "messages": self.messages,
            "last_reply_ids": self.last_reply_ids,
        }
        metadata = {
            "model": json.dumps(self.model_identity(), sort_keys=True),
            "state": json.dumps(state, sort_keys=True),
        }
        save_cache(
            path,
            self._cache,
            metadata,
            arrays={"transcript": np.asarray(self._transcript, np.int32)},
            file_format=WHOLE_FORMAT,
            prefix_format=FILE_FORMAT,
        )

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        model: LoadedModel,
        *,
        cache: CacheSpec | LayerSpecs | None = None,
        sampler: Sampler | None = None,
        seed: int | None = None,
        max_new_tokens: int | None = None,
        chat_template: str | None = None,
        block: int = 8,
    ) -> ChatSession:
        """Resume a session written by :meth:`save`, with the model it was written for.

        Args:
          cache: the spec the caller expects (refused if the file's differs from the cache the
            model makes of it, :func:`~jaxkv.decode.loop.model_cache_spec`); None = the file's.
          sampler, seed, max_new_tokens: None = those saved (the PRNG stream continues where it stopped).
          chat_template: as in the constructor (must be the one the file was written with).
        Raises:
          JaxkvError: a missing, truncated or corrupt file, one whose fields are missing, of the
            wrong type or inconsistent (named), or one for another model or cache spec (what
            differs is named).
        """
        path = os.fspath(path)
        made = []

        def corrupt(problem: str) -> JaxkvError:
            return JaxkvError(f"{path}: corrupt jaxkv chat file ({problem})")

        def session_for(spec: CacheSpec | LayerSpecs, meta: dict) -> KVCache:
            try:
                identity = _json_object(meta, "model")
                state = _checked_state(_json_object(meta, "state"))
            except ValueError as e:
                raise corrupt(str(e)) from None
            if cache is not None and model_cache_spec(model.config, cache) != spec:
                raise JaxkvError(
                    f"{path} holds a cache for another cache spec ({spec.describe()}), not the one asked for "
                    f"({cache.describe()}): pass the same cache flags, or delete the file to start over"
                )
            session = cls(
                model,
                spec,
                sampler=sampler or state["sampler"],
                seed=state["seed"] if seed is None else seed,
                max_new_tokens=state["max_new_tokens"] if max_new_tokens is None else max_new_tokens,
                system=state["system"],
                chat_template=chat_template,
                block=block,
            )
            mine = session.model_identity()
            if isinstance(identity.get("config"), dict):  # files of older jaxkv versions
                identity["config"] = _without_defaults(model.config, identity["config"])
            if identity != mine:
                what = [k for k in sorted(set(identity) | set(mine)) if identity.get(k) != mine.get(k)]
                raise JaxkvError(
                    f"{path} was saved for another model ({', '.join(what)} differ: {_differences(identity, mine)}): "
                    "load it with the model it was written for, or delete it to start over"
                )
            made.append((session, state))
            return session.cache

        kv, arrays, _ = load_cache(
            path, session_for, file_format=WHOLE_FORMAT, prefix_format=FILE_FORMAT, what="jaxkv chat cache"
        )
        session, state = made[0]
        transcript = arrays.get("transcript")
        if set(arrays) != {"transcript"} or transcript.dtype != np.int32 or transcript.ndim != 1:
            raise corrupt("expected one int32[N] transcript beside the cache")
        ids = [
            *transcript.tolist(),
            *state["last_reply_ids"],
            *([] if state["pending"] is None else [state["pending"]]),
        ]
        check_token_ids(ids, model.config.vocab_size, f"{path}: corrupt jaxkv chat file: token id")
        reply, held, started = state["last_reply_ids"], int(np.asarray(kv.length)[0]), state["pending"] is not None
        if transcript.size < len(reply) or transcript[transcript.size - len(reply) :].tolist() != reply:
            raise corrupt(
                f"the transcript of {transcript.size} tokens does not end with state.last_reply_ids {_short(reply)}"
            )
        if not started and transcript.size:
            raise corrupt(f"state.turns=0 with a transcript of {transcript.size} tokens")
        if held != transcript.size - started:
            raise corrupt(
                f"the cache holds {held} tokens, expected {transcript.size - started}: the transcript's "
                f"{transcript.size} less the pending last token"
            )
        session._cache = kv
        session._transcript = [int(i) for i in transcript]
        session._step, session._turns = state["step"], state["turns"]
        session._pending = state["pending"]
        session.finish_reason = state["finish_reason"]
        session.messages = state["messages"]
        session.last_reply_ids = state["last_reply_ids"]
        return session


# ---- helpers ----------------------------------------------------------------------------------------


def model_fingerprint(model: LoadedModel) -> str:
    """SHA-256 over every parameter's name, dtype and shape, the whole embedding, and strided samples of the rest.

    Names are the parameters' paths in the NNX state joined by dots (``embed``, ``wq``, ...;
    a Variable's ``.value`` left out). A held matrix (:mod:`jaxkv.models.weights`) is hashed
    in the layout jaxkv held it in before the transposed one, by its last leaf as then (the
    matrix; the scales, or the mins for ``q4``), so chat files saved before still resume.
    """
    h = hashlib.sha256()
    flat, _ = jax.tree_util.tree_flatten_with_path(nnx.state(model.model), is_leaf=lambda x: isinstance(x, HELD_FORMS))
    weights = {
        ".".join(
            str(getattr(k, "key", getattr(k, "idx", ""))) for k in path if not isinstance(k, jax.tree_util.GetAttrKey)
        ): legacy_leaves(leaf)[-1] if isinstance(leaf, HELD_FORMS) else leaf
        for path, leaf in flat
    }
    for name in sorted(weights):
        a = np.asarray(weights[name])
        h.update(f"{name}:{a.dtype.name}:{a.shape};".encode())
        flat = a.reshape(-1)
        if name != "embed":
            flat = flat[:: max(1, flat.size // _SAMPLED_ELEMENTS)]
        h.update(np.ascontiguousarray(flat).tobytes())
    return h.hexdigest()


_V2_CONFIG_FIELDS = frozenset(
    {
        "vocab_size",
        "dim",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "head_dim",
        "hidden_dim",
        "rope_theta",
        "norm_eps",
        "max_seq_len",
        "tie_embeddings",
        "attention_bias",
    }
)
"""The config fields of the model identity when ``jaxkv-chat/2`` was defined; later ones are
written only when they differ from their default, so older files keep their identity."""


def _without_defaults(config, fields: dict) -> dict:
    """Config ``fields`` (JSON values) less the later ones (not in :data:`_V2_CONFIG_FIELDS`) at their default."""
    defaults = {f.name: f.default for f in dataclasses.fields(config) if f.default is not dataclasses.MISSING}
    return {k: v for k, v in fields.items() if k in _V2_CONFIG_FIELDS or not (k in defaults and v == defaults[k])}


def _identity(model: LoadedModel, fingerprint: str) -> dict:
    config = {k: v for k, v in dataclasses.asdict(model.config).items() if k != "name"}
    config = json.loads(json.dumps({k: (v.item() if isinstance(v, np.generic) else v) for k, v in config.items()}))
    config = _without_defaults(model.config, config)
    tok = model.tokenizer
    template = hashlib.sha256((tok.chat_template or "").encode()).hexdigest()
    return {
        "config": config,
        "dtype": np.dtype(model.model.embed[...].dtype).name,
        "tokenizer": {
            "vocab_size": tok.vocab_size,
            "bos_id": tok.bos_id,
            "eos_id": tok.eos_id,
            "add_bos": tok.add_bos,
            "chat_template_sha256": template,
        },
        "weights_sha256": fingerprint,
    }


def _short(value, limit: int = 40) -> str:
    """``value`` as JSON, cut to about ``limit`` characters (a hash to its first 12 digits)."""
    text = json.dumps(value, sort_keys=True)
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return f'"{value[:12]}..."'
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _differences(file: dict, mine: dict, budget: int = 250) -> str:
    """The leaves that differ between two model identities, e.g. ``config.n_layers: file 5,
    this model 2; weights_sha256: file "3f2a9c0e1b7d...", this model "..."``: as many as fit in
    about ``budget`` characters, then ``and N more``."""

    def leaves(tree: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in tree.items():
            out.update(leaves(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
        return out

    a, b = leaves(file), leaves(mine)
    keys = [k for k in sorted(set(a) | set(b)) if k not in a or k not in b or a[k] != b[k]]
    parts = []
    for k in keys:
        part = f"{k}: file {_short(a[k]) if k in a else 'absent'}, this model {_short(b[k]) if k in b else 'absent'}"
        if parts and len("; ".join(parts + [part])) > budget:
            break
        parts.append(part)
    more = len(keys) - len(parts)
    return "; ".join(parts) + (f"; and {more} more" if more else "")


def _json_object(meta: dict, key: str) -> dict:
    """Metadata entry ``key`` of a chat file, a JSON object (JaxkvError naming the entry otherwise)."""
    if key not in meta:
        raise JaxkvError(f"no {key!r} entry")
    try:
        value = json.loads(meta[key])
    except ValueError as e:
        raise JaxkvError(f"{key}: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise JaxkvError(f"{key}: expected a JSON object, got {_short(value)}")
    return value


_STATE_FIELDS = (
    "turns",
    "step",
    "pending",
    "finish_reason",
    "seed",
    "max_new_tokens",
    "sampler",
    "system",
    "messages",
    "last_reply_ids",
)


def _checked_state(state: dict) -> dict:
    """The ``state`` entry of a chat file, every field checked alone and against the others.

    Raises:
      JaxkvError: naming the field: ``state has no 'seed'``, ``state.turns=-1: expected an
        integer >= 0``, ``state.messages: ...``, a started conversation without a pending token, ...
    """
    missing = [k for k in _STATE_FIELDS if k not in state]
    unknown = sorted(set(state) - set(_STATE_FIELDS))
    if missing or unknown:
        raise JaxkvError(f"state has no {missing[0]!r}" if missing else f"state has an unknown field {unknown[0]!r}")
    out = dict(state)
    for name in ("turns", "step", "seed"):
        check_int(f"state.{name}", out[name], 0)
    check_int("state.max_new_tokens", out["max_new_tokens"], 1)
    if out["pending"] is not None:
        check_int("state.pending", out["pending"], 0)
    if out["finish_reason"] not in (None, *FINISH_REASONS[1:]):
        raise JaxkvError(
            f"state.finish_reason={out['finish_reason']!r}: expected one of {', '.join(FINISH_REASONS[1:])}"
        )
    if out["system"] is not None and not isinstance(out["system"], str):
        raise JaxkvError(f"state.system={_short(out['system'])}: expected a string or null")
    if not isinstance(out["last_reply_ids"], list):
        raise JaxkvError(f"state.last_reply_ids={_short(out['last_reply_ids'])}: expected a list of token ids")
    for i in out["last_reply_ids"]:
        check_int("state.last_reply_ids: token id", i, 0)
    if not isinstance(out["sampler"], dict):
        raise JaxkvError(f"state.sampler={_short(out['sampler'])}: expected a JSON object of Sampler fields")
    try:
        out["sampler"] = Sampler(**out["sampler"])
    except (TypeError, ValueError) as e:
        raise JaxkvError(f"state.sampler: {e}") from None
    turns, reply = out["turns"], out["last_reply_ids"]
    if any((v is not None and v != []) != (turns > 0) for v in (out["pending"], out["finish_reason"], reply)):
        raise JaxkvError(
            f"state.turns={turns} with pending={out['pending']}, finish_reason={out['finish_reason']!r} and "
            f"{len(reply)} last_reply_ids: a conversation that has not started has none of them, one that has all"
        )
    if reply and reply[-1] != out["pending"]:
        raise JaxkvError(f"state.pending={out['pending']} is not the last of state.last_reply_ids {_short(reply)}")
    if out["step"] < len(reply):
        raise JaxkvError(f"state.step={out['step']}: fewer sampled tokens than the last reply's {len(reply)}")
    roles = ["system"] * (out["system"] is not None) + ["user", "assistant"] * turns
    messages = out["messages"]
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and set(m) == {"role", "content"} and all(isinstance(v, str) for v in m.values())
        for m in messages
    ):
        raise JaxkvError("state.messages: expected a list of {role, content} strings")
    if [m["role"] for m in messages] != roles or (roles[:1] == ["system"] and messages[0]["content"] != out["system"]):
        raise JaxkvError(
            f"state.messages: roles {_short([m['role'] for m in messages], 80)}, expected the system message "
            f"(if any) then {turns} user/assistant pairs"
        )
    return out
