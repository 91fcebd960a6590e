"""The prefix store: recent ``token prefix -> one-row cache state`` pairs in a bytes-bounded LRU.

A cache's state after a token prefix does not depend on what follows the prefix (DESIGN §2:
every token is appended to the same retained set, evictions included), so a request whose
tokens start with a stored prefix starts from that state and prefills only the rest. Once a
StreamingLLM ring has wrapped, a state can be extended but not rolled back to a shorter
prefix, so states are stored where later requests branch (llama.cpp keeps such checkpoints
for its sliding-window caches): at the end of each prompt, at the end of each generation
(chat clients resend the conversation each turn), and at the point where a new prompt
leaves the longest prefix it shares with a stored one (a shared system prompt).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Sequence

import jax

from jaxkv.errors import check_int


@dataclasses.dataclass(frozen=True)
class PrefixEntry:
    """One stored state.

    Attributes:
      tokens: the token prefix (a tuple of ids) the cache holds, in order.
      cache: the one-row cache after it (never donated: a request extends a copy).
      logits: float32[1, V], the logits after its last token.
      nbytes: bytes of ``cache`` and ``logits``.
    """

    tokens: tuple[int, ...]
    cache: object
    logits: jax.Array
    nbytes: int


def tree_bytes(tree) -> int:
    """Bytes of every array leaf of a pytree."""
    return sum(x.nbytes for x in jax.tree.leaves(tree))


class PrefixStore:
    """A bytes-bounded LRU of :class:`PrefixEntry` s, looked up by longest stored prefix.

    Args:
      max_bytes: the most bytes of stored states (0 = store nothing).
    Raises:
      JaxkvError: ``max_bytes`` not an integer >= 0.

    Counters (read by the engine's stats): ``hits`` / ``misses`` (lookups that found a prefix
    or not), ``nbytes`` (stored now), ``len(store)``. Thread-safe (stats are read from other
    threads; the engine thread alone stores and looks up).
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = check_int("prefix cache bytes", max_bytes, 0)
        self._entries: OrderedDict[tuple[int, ...], PrefixEntry] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, tokens: Sequence[int]) -> PrefixEntry | None:
        """The entry whose tokens are the longest prefix of ``tokens`` (all of them at most), or
        None; a hit becomes the most recently used entry."""
        tokens = tuple(tokens)
        with self._lock:
            best = max(
                (k for k in self._entries if len(k) <= len(tokens) and tokens[: len(k)] == k), key=len, default=None
            )
            if best is None:
                self.misses += 1
                return None
            self.hits += 1
            self._entries.move_to_end(best)
            return self._entries[best]

    def branch(self, tokens: Sequence[int]) -> int:
        """The longest common prefix, in tokens, of ``tokens`` and any stored entry's tokens."""
        tokens = tuple(tokens)
        with self._lock:
            return max((_common(tokens, k) for k in self._entries), default=0)

    def put(self, tokens: Sequence[int], cache, logits) -> bool:
        """Store the state ``cache`` (not to be donated afterwards) with ``logits`` after ``tokens``;
        least recently used entries go until it fits. Returns False (nothing stored) for a
        state larger than ``max_bytes`` or empty ``tokens``."""
        tokens = tuple(tokens)
        nbytes = tree_bytes(cache) + logits.nbytes
        if not tokens or nbytes > self.max_bytes:
            return False
        with self._lock:
            old = self._entries.pop(tokens, None)
            if old is not None:
                self.nbytes -= old.nbytes
            while self._entries and self.nbytes + nbytes > self.max_bytes:
                self.nbytes -= self._entries.popitem(last=False)[1].nbytes
            self._entries[tokens] = PrefixEntry(tokens=tokens, cache=cache, logits=logits, nbytes=nbytes)
            self.nbytes += nbytes
        return True


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common prefix of two token tuples."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
