"""The KV cache one party keeps across its turns of a rollout.

Without it every turn re-feeds a party's whole conversation to the model, so prefill grows
with the square of the number of turns. With it a party feeds only what is new since its
last turn: the other party's reply and the chat-template text around it.

One `KVCache` holds the keys and values of many conversations (rows) of one party:

    keys[layer], values[layer]   [rows, kv_heads, capacity, head_dim], preallocated
    mask                         [rows, capacity] True where a position holds a real token
    width                        positions in use (the same for every row)

Rows differ in history length and in how much is new each turn, so a row's real tokens do
not sit in one block: every turn appends the new suffix of each row at the same columns
(left-padded), and the pads in between stay in the cache as *holes*, masked out forever.
Each row's position ids continue from its count of real tokens, so the model sees exactly
the positions a fresh prefill would give it. When holes make up a third of the width or
more, `compact` packs every row's real tokens to the right again (one copy of the cache).

Rows are ordered so that the rows being computed are always the FIRST rows of the buffers
(`buffers[:n]` is a view, not a copy): a turn's batch is moved to the front, and a row
whose turn ended (EOS) is swapped towards the back at the next check, so it leaves the
decode batch while its cache stays for its next turn. Rows of ended episodes are dropped.

The model sees this object as its `cache`: `update` writes the new keys/values of the front
rows in place (no concatenation: no copy of the cache per token) and returns views of the
used width. The attention mask is built here as a 4-D mask (holes + causal), which the
sdpa and eager attention of transformers use as given.

A cache lives for one rollout: `rollout` opens a `session()`, and each speaker takes its
own cache from it with `party_cache(speaker)`; outside a session a speaker gets a fresh,
empty cache every turn (a full prefill, the behaviour without reuse).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

_SESSION: contextvars.ContextVar[dict | None] = contextvars.ContextVar("minscope_kv_session", default=None)


@contextlib.contextmanager
def session():
    """Caches opened inside this block are kept across turns and freed when it ends."""
    token = _SESSION.set({})
    try:
        yield
    finally:
        _SESSION.reset(token)


def party_cache(owner) -> "KVCache":
    """The cache of `owner` (a speaker) in the current session; a fresh one outside any."""
    caches = _SESSION.get()
    if caches is None:
        return KVCache()
    if id(owner) not in caches:
        caches[id(owner)] = (owner, KVCache())   # the owner is kept so its id stays unique
    return caches[id(owner)][1]


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    diff = torch.tensor(a[:n]) != torch.tensor(b[:n])
    return int(diff.nonzero()[0, 0])


class KVCache:
    """Keys/values of one party's conversations, kept between its turns (see module doc)."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []      # per layer [row capacity, H, capacity, D]
        self.values: list[torch.Tensor] = []
        self.mask: torch.Tensor | None = None   # [row capacity, capacity] bool
        self.width = 0                          # positions in use
        self.capacity = 0                       # positions allocated
        self.front = 0                          # rows the next forward computes (rows [0, front))
        self.owners: list = []                  # per row: the conversation it belongs to
        self.cached: list[list[int]] = []       # per row: the ids whose keys/values it holds
        self.last_prefilled: list[int] = []     # per prompt of the last turn: ids fed to the model
        self.last_shared: list[int] = []        # per prompt: ids whose keys/values another row fed

    # ------------------------------------------------------------------ the model's side
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Write the front rows' new keys/values at [width, width + S); return the used views."""
        n, _, s, _ = key_states.shape
        while len(self.keys) <= layer_idx:
            self.keys.append(None)
            self.values.append(None)
        if self.keys[layer_idx] is None:
            shape = (max(len(self.owners), n), key_states.shape[1], self.capacity, key_states.shape[-1])
            self.keys[layer_idx] = key_states.new_zeros(shape)
            self.values[layer_idx] = value_states.new_zeros(shape[:3] + (value_states.shape[-1],))
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k[:n, :, self.width:self.width + s] = key_states
        v[:n, :, self.width:self.width + s] = value_states
        return k[:n, :, :self.width + s], v[:n, :, :self.width + s]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.width

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.width + query_length, 0

    def __len__(self):
        return len(self.keys)

    # ------------------------------------------------------------------ our side
    @property
    def rows(self) -> int:
        return len(self.owners)

    def reserve(self, s: int, device) -> None:
        """Make room for `s` more positions (and clear their mask).

        `sample` reserves a whole turn (new suffix + max_new_tokens) at once, so the buffers
        grow at most once per turn, to what the turn needs (rounded up to 64 positions).
        Layers are regrown one at a time, so growing never holds two copies of the cache."""
        need = self.width + s
        if need > self.capacity:
            cap = -(-need // 64) * 64
            for bufs in (self.keys, self.values):
                for i, buf in enumerate(bufs):
                    if buf is not None:     # one layer at a time: its old buffer goes next
                        bufs[i] = _grow(buf, 2, cap)
            self.mask = _grow(self._mask(device), 1, cap)
            self.capacity = cap
        self._mask(device)[:, self.width:need] = False

    def _mask(self, device) -> torch.Tensor:
        if self.mask is None:
            self.mask = torch.zeros((self.rows, self.capacity), dtype=torch.bool, device=device)
        return self.mask

    def advance(self, s: int) -> None:
        """The forward wrote `s` positions: they are in use now."""
        self.width += s

    def add_rows(self, owners: list, device) -> None:
        """Append empty rows (nothing cached yet) for new conversations."""
        new = len(self.owners) + len(owners)
        for bufs in (self.keys, self.values):
            for i, buf in enumerate(bufs):
                if buf is not None:
                    bufs[i] = _grow(buf, 0, new)
        self.mask = _grow(self._mask(device), 0, new)
        self.mask[len(self.owners):new] = False
        self.owners += owners
        self.cached += [[] for _ in owners]

    def reorder(self, order: list[int]) -> None:
        """Row i becomes the old row order[i]; rows not in `order` are dropped.

        Only rows that move are copied, so swapping a few finished rows to the back of the
        decode batch costs those rows, not the whole cache.
        """
        moved = [i for i, r in enumerate(order) if r != i]
        if moved and self.mask is not None:
            dst = torch.tensor(moved, device=self.mask.device)
            src = torch.tensor([order[i] for i in moved], device=self.mask.device)
            for buf in self.keys + self.values:
                if buf is not None:
                    buf[dst, :, :self.width] = buf[src, :, :self.width]
            self.mask[dst, :self.width] = self.mask[src, :self.width]
        self.owners = [self.owners[r] for r in order]
        self.cached = [self.cached[r] for r in order]

    def prepare(self, owners: list, prompts: list[list[int]], device) -> list[int]:
        """Put the rows of `owners` first, in that order (new conversations get empty rows),
        and make each row hold only a prefix of its prompt. Returns, per prompt, how many of
        its leading ids are cached and need no prefill.

        A row whose cached ids are not a prefix of the prompt (its history was rewritten:
        Verbalized Sampling shows only the drawn reply, a template dropped old content, a
        stream restarted) keeps only the longest common prefix; with nothing in common that
        is a full prefill. The prompt's last id is always fed again, since its logits start
        the turn.
        """
        if len({id(o) for o in owners}) != len(owners):
            raise ValueError("each conversation may appear only once in a batch")
        new = [o for o in owners if id(o) not in {id(x) for x in self.owners}]
        if new:
            self.add_rows(new, device)
        row_of = {id(o): r for r, o in enumerate(self.owners)}
        batch = [row_of[id(o)] for o in owners]
        chosen = set(batch)
        self.reorder(batch + [r for r in range(self.rows) if r not in chosen])
        self.front = len(owners)
        reused = []
        for r, ids in enumerate(prompts):
            keep = min(common_prefix(self.cached[r], ids), len(ids) - 1)
            if keep < len(self.cached[r]):
                self.crop_row(r, keep)
            reused.append(keep)
        if self.width > 1.5 * max(len(c) for c in self.cached) + 64:   # a third or more holes
            self.compact()
        return reused

    def record(self, owners: list, cached: list[list[int]]) -> None:
        """After a turn: the ids whose keys/values each owner's row now holds."""
        row_of = {id(o): r for r, o in enumerate(self.owners)}
        for o, ids in zip(owners, cached):
            self.cached[row_of[id(o)]] = ids

    def discard(self, ended) -> None:
        """Drop the rows of conversations for which `ended(owner)` is true."""
        keep = [r for r, o in enumerate(self.owners) if not ended(o)]
        if len(keep) < self.rows:
            self.reorder(keep)

    def crop_row(self, row: int, keep: int) -> None:
        """Forget all but the first `keep` real tokens of `row` (its history was rewritten)."""
        real = self.mask[row, :self.width]
        self.mask[row, :self.width] = real & (real.cumsum(0) <= keep)
        self.cached[row] = self.cached[row][:keep]

    def compact(self) -> None:
        """Pack each row's real tokens to the right end of a narrower width (drop holes)."""
        lengths = [len(c) for c in self.cached]
        new_width = max(lengths, default=0)
        if self.rows == 0 or new_width == self.width:
            return
        device = self.mask.device
        real = self.mask[:self.rows, :self.width]
        # for row r, the positions of its real tokens, right-aligned into new_width slots
        index = torch.zeros((self.rows, new_width), dtype=torch.long, device=device)
        for r, n in enumerate(lengths):
            if n:
                index[r, new_width - n:] = real[r].nonzero().flatten()
        for bufs in (self.keys, self.values):
            for i, buf in enumerate(bufs):
                if buf is not None:
                    idx = index[:, None, :, None].expand(-1, buf.shape[1], -1, buf.shape[3])
                    packed = buf[:self.rows].gather(2, idx)
                    buf[:self.rows, :, :new_width] = packed
        new_mask = torch.zeros((self.rows, new_width), dtype=torch.bool, device=device)
        for r, n in enumerate(lengths):
            new_mask[r, new_width - n:] = True
        self.mask[:self.rows, :new_width] = new_mask
        self.width = new_width

    def attention_mask(self, s: int, dtype: torch.dtype, additive: bool) -> torch.Tensor:
        """The 4-D mask [front, 1, s, width] of the next forward of `s` new positions.

        A new position attends to the real tokens up to itself (causal by position in the
        cache) and always to itself, so a pad query never has an empty row (no NaN).
        """
        n, total = self.front, self.width + s
        real = self.mask[:n, :total]                                         # [n, total]
        if s == 1:
            allowed = real.clone()
            allowed[:, -1] = True
            allowed = allowed[:, None, None, :]
        else:
            device = real.device
            q = torch.arange(total - s, total, device=device)[:, None]          # [s, 1]
            kv = torch.arange(total, device=device)[None, :]                    # [1, total]
            allowed = (real[:, None, :] & (kv <= q)[None]) | (kv == q)[None]    # [n, s, total]
            allowed = allowed[:, None]
        if not additive:
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
            ~allowed, torch.finfo(dtype).min)


def _grow(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`t` with dimension `dim` enlarged to `size` (new entries zero); `t` itself if big enough."""
    if t.shape[dim] >= size:
        return t
    shape = list(t.shape)
    shape[dim] = size
    out = t.new_zeros(shape)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out
