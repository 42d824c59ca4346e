"""The checkpoint's own MTP heads as a draft source (models/mtp_heads.py loads them).

An MTP step takes the target's hidden state h_p at a position and the token t_{p+1} after it,
and predicts t_{p+2}; its output is the hidden state of the next step, so k drafts cost k small
steps (one decoder layer each, and the target's output head) and no target pass.

Where the hidden states come from: `Tap` stands in for the model in the prefill and the decode
batch and returns its logits as before (the same computation, `MTPHeads.forward`), keeping the
hidden states they came from. A speculative request's prefill makes its row's `MTPDraft`
(`prefill_source`, kept on its `Live`) and hands it every chunk's hidden states (`chunk`): one
block step per chunk over the chunk's pairs, so after a cold prefill its cache holds every pair
(h_p, t_{p+1}) of the prompt, the last hidden state waiting for the next token (a resident
session keeps its source for the next turn: `cut`). The decode batch adopts that source;
after each pass the batch (plain steps, engine/batch.py) or the speculator (verify passes,
step.py) hands it the hidden states of the positions that stay in its caches: a
verify pass's kept prefix only, so the MTP never sees a rejected position.

Its own KV cache (one per MTP layer and row) holds exactly one entry per pair (h_p, t_{p+1})
whose both halves are committed: pairs are fed when their next token is known, and the steps
that draft (fed the MTP's own outputs) are trimmed off again as soon as the draft is read, so
no rollback is ever owed after a verify pass. A prompt-cache checkpoint stores its state of
exactly its tokens (`state`), and a prefix the cache serves starts the row's source from it
(`prefill_source`, `restored`: cache/mtp_part.py). Positions it never saw (an entry stored
without that state, an image chunk, whose pass bypasses the tap) are a source of lost
acceptance, not of wrong tokens (verify.py decides what is kept, and the MTP only guesses).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from mlx_kvserve.cache.exceptions import out_of_memory
from mlx_kvserve.cache.kinds import LayerCache, leaves
from mlx_kvserve.cache.mtp_part import MTPState
from mlx_kvserve.engine.speculation.drafts import Draft
from mlx_kvserve.models.mtp_heads import MTPHeads

SOURCE = "mtp"
log = logging.getLogger("mlx_kvserve.engine")
_PENDING = 64  # hidden states kept unfed at most: then fed in one step (a row lookup serves)
MAX_DRAFT = 8  # steps a proposal runs at most (a grammar row asks for more, forced tokens too)


class Tap:
    """The target as the decode batch and the prefill call it: its logits, with `hidden` kept
    from the last pass (and the caches it ran on); anything else is the model's."""

    def __init__(self, model: nn.Module, heads: MTPHeads) -> None:
        self.model, self.heads = model, heads
        self.hidden: mx.array | None = None  # (B, L, H) of the last pass
        self.cache: list | None = None  # the caches that pass ran on
        self._form: list[tuple[mx.Dtype, tuple[int, ...]]] | None = None

    def __call__(self, inputs: mx.array, cache: list | None = None) -> mx.array:
        self.hidden, logits = self.heads.forward(inputs, cache)
        self.cache = cache
        return logits

    def __getattr__(self, name: str) -> object:
        return getattr(self.model, name)  # make_cache, layers, args...

    def fits(self, state: MTPState) -> bool:
        """Whether a stored MTP state has the shapes and dtypes the heads' caches hold (asked
        of one step over a dummy pair, once): a prompt-cache entry's may be another model's."""
        if self._form is None:
            caches = self.heads.make_cache()
            size = self.heads.block.norm.weight.shape[0]
            dummy = mx.zeros((1, 1, size), self.heads.block.norm.weight.dtype)
            self.heads.step(mx.zeros((1, 1), mx.uint32), dummy, caches)
            plain = all(type(c) is KVCache for c in caches)
            self._form = [_form(a) for c in caches for a in (c.keys, c.values)] if plain else []
            self._form.append((dummy.dtype, (size,)))
        mine = [_form(a) for k, v in zip(state.keys, state.values, strict=True) for a in (k, v)]
        hidden = [] if state.hidden is None else [state.hidden]
        return (
            len(self._form) == 2 * len(state.keys) + 1
            and mine == self._form[:-1]
            and all(h.shape == self._form[-1][1] for h in hidden)
        )


def _form(a: mx.array) -> tuple[mx.Dtype, tuple[int, ...]]:
    """An array's dtype and its shape without the positions axis (2), or a hidden state's."""
    return a.dtype, (*a.shape[:2], *a.shape[3:]) if a.ndim == 4 else tuple(a.shape)


def held(caches: Sequence[LayerCache]) -> list[mx.array]:
    """The arrays the MTP layers' caches hold, a `CacheList`'s parts too (DeepSeek-V3.2's and
    GLM-5's indexer keys beside the attention's), to evaluate with a prefill chunk."""
    parts = [c for c in leaves(caches) if c is not None]
    arrays = [a for c in parts for a in (getattr(c, "keys", None), getattr(c, "values", None))]
    return [a for a in arrays if a is not None]


class MTPDraft:
    """One row's MTP drafts: a `DraftSource` fed the target's hidden states as well."""

    name = SOURCE
    # A 2-token lookup match loses to it, a longer one wins (and it is then not run: drafts.py)
    evidence = 3

    def __init__(self, heads: MTPHeads) -> None:
        self.heads = heads
        self.cache = heads.make_cache()
        self.tokens: list[int] = []
        self.hidden: dict[int, mx.array] = {}  # position -> the target's (H,) there, unfed
        self.fed = -1  # the last position whose pair is in `cache`
        # the first pair of the run that ends at `fed` with no position missing (the cache's
        # last fed - tail + 1 entries): a prompt-cache checkpoint stores pairs from there on
        self.tail = 0
        self.out: mx.array | None = None  # the block's (1, 1, H) at `fed`: predicts fed + 2
        self._memo: tuple[int, list[int]] = (-1, [])
        # hidden states already fed that a checkpoint may still ask for (its last position's
        # pairs with the token after it): the last prefill chunk's rows, the last one fed
        self._rows: tuple[int, mx.array] | None = None
        self._last: tuple[int, mx.array] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def record(self, start: int, hidden: mx.array) -> None:
        """The target's hidden states (L, H) at positions start..start+L-1, which stay in the
        row's caches."""
        for j in range(hidden.shape[0]):
            self.hidden[start + j] = hidden[j]
        if len(self.hidden) > _PENDING:
            self._catch_up()

    def ready(self) -> bool:
        """Whether it can draft now (the target's hidden state before the last token is
        known), without running the block."""
        end = len(self.tokens)
        return (self.out is not None and self.fed == end - 2) or end - 2 in self.hidden

    def propose(self, limit: int) -> Draft | None:
        """`limit` tokens after the row's last one: the block from the target's hidden state
        before it, then from its own outputs; None while that hidden state is unknown."""
        end, limit = len(self.tokens), min(limit, MAX_DRAFT)
        if limit <= 0:
            return None
        if self._memo[0] == end and len(self._memo[1]) >= limit:
            return Draft(tuple(self._memo[1][:limit]), SOURCE, self.evidence)
        self._catch_up()
        if self.out is None or self.fed != end - 2:
            return None
        out, drafts = self.out, []
        while True:
            token = mx.argmax(self.heads.head(out)[:, -1], axis=-1)
            drafts.append(token)
            if len(drafts) == limit:
                break
            out = self.heads.step(token[None], out, self.cache)
        tokens = mx.concatenate(drafts).tolist()
        for c in self.cache:  # the drafting steps: the next pairs come from the target
            c.trim(limit - 1)
        self._memo = (end, tokens)
        return Draft(tuple(tokens), SOURCE, self.evidence)

    def chunk(self, start: int, tokens: Sequence[int], hidden: mx.array | None) -> list[mx.array]:
        """A prefill chunk: `tokens` at positions start.. and the target's hidden states there
        (L, H), or None where its pass gave none (an image chunk: a gap, its pairs lost). One
        block step feeds the pairs whose next token is now known: the last hidden state of the
        chunk before, and the chunk's own but its last (which waits for the next chunk's first
        token). Returns what to evaluate with the chunk's caches: the hidden states are not
        kept past that evaluation, so the step must run with it."""
        assert len(self.tokens) == start, (len(self.tokens), start)
        self.extend(tokens)
        if any(p < start - 1 for p in self.hidden):  # a resident session's last decode pass
            self._catch_up(until=start - 2)
        pending = self.hidden.pop(start - 1, None)  # none after a gap
        if hidden is None:
            return []
        pairs = hidden[:-1] if pending is None else mx.concatenate([pending[None], hidden[:-1]])
        first = start - (pending is not None)
        if pairs.shape[0]:
            ids = mx.array([self.tokens[first + 1 : start + len(tokens)]], dtype=mx.uint32)
            self.out = self.heads.step(ids, pairs[None], self.cache)[:, -1:]
            if first != self.fed + 1:  # a gap before it: the run restarts here
                self.tail = first
            self.fed = start + len(tokens) - 2
        self.hidden[start + len(tokens) - 1] = last = hidden[-1]
        self._rows = (start, hidden)
        fed = [self.out] if self.out is not None else []
        return fed + [last] + held(self.cache)

    def copy(self) -> MTPDraft:
        """Another row's source over the same tokens (a fork of the prompt): its own cache."""
        other = copy.copy(self)
        other.cache = copy.deepcopy(self.cache)
        other.tokens, other.hidden = list(self.tokens), dict(self.hidden)
        return other

    def state(self, length: int) -> MTPState | None:
        """Its state over the first `length` tokens, for a prompt-cache checkpoint there: the
        KV of pairs [tail, length - 1) and h_{length-1}; None where it lacks them (a gap, a
        hidden state already let go, a cache kind other than plain KV)."""
        if not 1 < length <= len(self.tokens):
            return None
        self._catch_up(until=length - 2)
        hidden = self._hidden_at(length - 1)
        if hidden is None or self.fed < length - 2 or self.tail >= length - 1:
            return None
        if not self.cache or not all(type(c) is KVCache for c in self.cache):
            return None  # a CacheList (V3.2, GLM-5): not stored (a lost guess after a restore)
        end = self.cache[0].offset - (self.fed - (length - 2))
        begin = end - (length - 1 - self.tail)
        if begin < 0:  # pragma: no cover - `tail` accounts for every pair in the cache
            return None
        keys = [c.keys[..., begin:end, :] for c in self.cache]
        values = [c.values[..., begin:end, :] for c in self.cache]
        return MTPState(self.tail, keys, values, hidden)

    def restored(self, state: MTPState) -> MTPDraft:
        """Its cache set from a prompt-cache entry's MTP state over its first tokens: pairs
        [fed_from, n - 1) fed, h_{n-1} pending where the entry had it for exactly its tokens."""
        n = state.n_tokens
        if state.fed_from < 0 or n > len(self.tokens) or self.fed >= 0:
            return self
        for c, k, v in zip(self.cache, state.keys, state.values, strict=True):
            c.state = (k, v, int(k.shape[2]))
        self.fed, self.tail, self.out = n - 2, state.fed_from, None
        if state.hidden is not None and n == len(self.tokens):
            self.hidden[n - 1] = state.hidden
        return self

    def _hidden_at(self, position: int) -> mx.array | None:
        """The target's hidden state at `position`, pending or still kept after its feed."""
        if position in self.hidden:
            return self.hidden[position]
        if self._rows is not None and 0 <= position - self._rows[0] < self._rows[1].shape[0]:
            return self._rows[1][position - self._rows[0]]
        if self._last is not None and self._last[0] == position:
            return self._last[1]
        return None

    def cut(self, tokens: Sequence[int]) -> MTPDraft:
        """This source over `tokens` instead (a resident session's, cut back to the common
        prefix of the next prompt; or the tokens its row's caches hold when it ends): the
        pairs and hidden states that only their common prefix made stay."""
        same = 0
        for mine, theirs in zip(self.tokens, tokens, strict=False):
            if mine != theirs:
                break
            same += 1
        if same == len(self.tokens):  # theirs extend mine (a row's drafter not yet synced):
            same = len(tokens)  # the hidden states its passes recorded are theirs
        keep = min(self.fed, same - 2)  # pair p holds t_{p+1}
        if keep < self.fed:
            for c in self.cache:  # after a gap (an image chunk) this gives back more: a loss
                c.trim(self.fed - keep)
            for p in range(keep + 1, self.fed + 1):  # their hidden states, pending again
                h = self._hidden_at(p)
                if h is not None:
                    self.hidden.setdefault(p, h)
            self.fed, self.out = keep, None
            self.tail = min(self.tail, keep + 1)
        if self._rows is not None and self._rows[0] + self._rows[1].shape[0] > same:
            self._rows = None
        if self._last is not None and self._last[0] >= same:
            self._last = None
        self.hidden = {p: h for p, h in self.hidden.items() if keep < p < same}
        self.tokens, self._memo = list(tokens), (-1, [])
        return self

    def adopted(self) -> MTPDraft:
        """Its tokens forgotten (the pairs fed and pending kept at their positions): a row's
        drafter gives every source the row's tokens from the first."""
        self.tokens, self._memo = [], (-1, [])
        self._rows = None  # the prefill's last chunk: its checkpoints are taken
        return self

    def _catch_up(self, until: int | None = None) -> None:
        """Feed the block every recorded pair (h_p, t_{p+1}) whose next token is committed
        (up to position `until`)."""
        last = len(self.tokens) - 2 if until is None else until
        ready = sorted(p for p in self.hidden if self.fed < p <= last)
        if not ready:
            return
        tokens = mx.array([[self.tokens[p + 1] for p in ready]], dtype=mx.uint32)
        self._last = (ready[-1], self.hidden[ready[-1]])
        hidden = mx.stack([self.hidden.pop(p) for p in ready])[None]
        self.out = self.heads.step(tokens, hidden, self.cache)[:, -1:]
        for before, p in zip([self.fed, *ready], ready, strict=False):
            if p != before + 1:  # a position never recorded: the run restarts after it
                self.tail = p
        self.fed = ready[-1]
        for p in [p for p in self.hidden if p <= self.fed]:
            del self.hidden[p]


def prefill_source(
    model: object, tokens: Sequence[int], speculative: bool, restored: MTPState | None = None
) -> MTPDraft | None:
    """The MTP source a prefill through `model` feeds, over the `tokens` its caches already
    hold (a prefix the prompt cache served: its pairs from the entry's MTP state `restored`
    where it had one that fits the heads, else unknown); None without heads or for a row that
    drafts nothing."""
    if not speculative or not isinstance(model, Tap):
        return None
    source = MTPDraft(model.heads)
    source.extend(tokens)
    if restored is None:
        return source
    try:
        if model.fits(restored):
            return source.restored(restored)
        log.info("a prompt-cache entry's MTP state does not fit the heads: dropped")
    except Exception as exc:  # never the request's, nor the entry's: its target state is right
        if out_of_memory(exc):
            raise
        log.warning("a prompt-cache entry's MTP state failed to restore: %r", exc)
    source = MTPDraft(model.heads)
    source.extend(tokens)
    return source


def chunk_hidden(model: object, caches: list) -> mx.array | None:
    """The hidden states (L, H) of the pass just run on `caches`, None if it gave none (a
    vision model's image chunk runs the language model past the tap)."""
    if not isinstance(model, Tap) or model.hidden is None or model.cache is not caches:
        return None
    return model.hidden[0]


def untap(model: object) -> None:
    """Forget the last pass's hidden states, so a pass that bypasses the tap leaves none."""
    if isinstance(model, Tap):
        model.hidden = None
