"""The update's forward pass: the final hidden states of each unit, its shared prompt prefix once.

Every episode of a group starts from the same prompt (system prompt, persona, task), and
often every group does (the persuader's system prompt is the same for every persona). The
plain update feeds each row whole, so that prompt goes through the model (forward, and
backward through the adapter) once per row. Here, for a run of rows that share their first
P ids and train none of the tokens 1..P:

    prefix  ids[0, :P]              one row, forward (with grad when training) ─► K, V per layer
    suffix  ids[rows, P:]           b rows, each attending to [K, V expanded to b rows | its own]
                                    ─► hidden states of positions P.. (the ones that carry loss)

The suffix sees exactly the keys and values a whole-row forward computes for positions < P
(the same ids at the same positions), so its hidden states, the loss and the gradients are
those of the plain path (up to float rounding: a test measures it). The gradient reaches the
prefix through the expanded K and V, summed over the b rows by autograd: the prefix's
parameters get it once, from one backward.

The keys/values are passed through a small cache object (`PrefixKV`) that never changes
during the suffix forward (it returns cat(prefix, new) and keeps nothing), so activation
checkpointing can replay a layer and see the same thing: the layers are told they may keep
their cache under checkpointing while it runs (`_can_checkpoint_with_cache`), which is only
right because this cache is read-only; in the prefix forward it records each layer's K, V
the first time only (a replay records nothing). The prefix and the suffix use two cache
objects, so that the backward's replay of a prefix layer, which runs after the suffix
forward has begun serving, finds its own cache still recording.

`plan` cuts a batch into units: runs of at most `micro_batch` consecutive rows with a
shared prefix of at least `min_prefix` ids, and plain micro-batches of the rest. A run ends
where extending it would shrink its prefix by more than it saves: two P4G groups share the
persuadee prompt's first ~100 ids but each its own ~420-id persona prompt, so each group is
its own unit, not one unit sharing 100 ids.

`unit_hidden_states` is the one call the update (minscope/trainer.py) makes per unit: it
returns the hidden states that meet the LM head in minscope/logprobs.py, with the prefix, the
cache and the checkpointing all inside it. A unit that shares nothing is the plain forward
(`final_hidden_states`: the transformer body only, no LM head).
"""

from __future__ import annotations

import contextlib
import inspect

import torch

# Shorter common prefixes are not worth a separate forward (and the toy's prompts, all shorter,
# keep the plain path's numbers exactly).
MIN_PREFIX = 64


class PrefixKV:
    """The cache the model sees: records the prefix's K/V, then serves them to the suffix."""

    def __init__(self):
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.rows = 0          # 0 while recording; then the suffix's batch size
        self.length = 0        # prefix positions

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if not self.rows:                           # recording the prefix (a replay keeps the first)
            self.keys.setdefault(layer_idx, key_states)
            self.values.setdefault(layer_idx, value_states)
            return key_states, value_states
        k, v = self.keys[layer_idx], self.values[layer_idx]
        b = key_states.shape[0]
        return (torch.cat([k.expand(b, -1, -1, -1), key_states], dim=2),
                torch.cat([v.expand(b, -1, -1, -1), value_states], dim=2))

    def serve(self, rows: int, length: int) -> None:
        self.rows, self.length = rows, length

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.length + query_length, 0

    def __len__(self):
        return len(self.keys)


def body_of(model):
    return model.get_base_model().model if hasattr(model, "get_base_model") else model.model


def supported(model) -> bool:
    """The attention implementations that take our 4-D masks as given (as the rollout's)."""
    return getattr(model.config, "_attn_implementation", "sdpa") in ("sdpa", "eager")


@contextlib.contextmanager
def _cache_kept_under_checkpointing(body):
    """Let checkpointed decoder layers keep the (read-only) PrefixKV cache."""
    layers = [m for m in body.modules() if hasattr(type(m), "_can_checkpoint_with_cache")]
    saved = [m.__dict__.get("_can_checkpoint_with_cache") for m in layers]
    for m in layers:
        m._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for m, s in zip(layers, saved):
            if s is None:
                del m._can_checkpoint_with_cache
            else:
                m._can_checkpoint_with_cache = s


def _cache_kw(body) -> str:
    return "cache" if "cache" in inspect.signature(body.forward).parameters else "past_key_values"


def unit_hidden_states(model, input_ids, attention_mask, unit) -> torch.Tensor:
    """The update's forward pass of one unit (rows, prefix, length) of `plan`: the final hidden
    states [b, length - 1 - prefix, H] of its rows at the positions prefix..length-2, those
    whose next token may carry loss. The unit's shared prefix is fed once (`hidden_states`),
    and the layers may keep its keys and values under activation checkpointing."""
    rows, p, n = unit
    return hidden_states(model, input_ids[rows, :n], attention_mask[rows, :n], p)[:, :-1]


def hidden_states(model, input_ids, attention_mask, prefix: int = 0) -> torch.Tensor:
    """Final hidden states [b, T - prefix, H] of positions prefix..T-1 of right-padded rows
    whose first `prefix` ids are the same in every row (prefix 0: the plain forward)."""
    if prefix <= 0:
        return final_hidden_states(model, input_ids, attention_mask)
    body = body_of(model)
    kw = _cache_kw(body)
    b, T = input_ids.shape
    device = input_ids.device
    recorder = PrefixKV()
    with _cache_kept_under_checkpointing(body):
        body(input_ids=input_ids[:1, :prefix], attention_mask=torch.ones((1, prefix), dtype=torch.long, device=device),
             position_ids=torch.arange(prefix, device=device)[None], use_cache=True, **{kw: recorder})
        # the suffix gets a cache of its own: the backward replays the prefix's checkpointed
        # layers with `recorder`, which must still be recording then (not serving 2P keys)
        kv = PrefixKV()
        kv.keys, kv.values = recorder.keys, recorder.values
        kv.serve(b, prefix)
        S = T - prefix
        real = attention_mask[:, prefix:].bool()                                    # [b, S]
        q = torch.arange(S, device=device)[:, None]
        k = torch.arange(S, device=device)[None, :]
        own = (real[:, None, :] & (k <= q)[None]) | (k == q)[None]                  # [b, S, S]
        allowed = torch.cat([torch.ones((b, S, prefix), dtype=torch.bool, device=device), own], dim=2)[:, None]
        if getattr(model.config, "_attn_implementation", "sdpa") == "eager":
            dtype = model.get_input_embeddings().weight.dtype
            allowed = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(
                ~allowed, torch.finfo(dtype).min)
        out = body(input_ids=input_ids[:, prefix:], attention_mask=allowed,
                   position_ids=(prefix + torch.arange(S, device=device))[None].expand(b, S),
                   use_cache=True, **{kw: kv})
    return out.last_hidden_state


def final_hidden_states(model, input_ids, attention_mask) -> torch.Tensor:
    """Run the transformer body only (no LM head), returning hidden states [B, T, H].

    The LM head is applied by `logprobs.token_logprobs` in chunks, so no [B, T, V]
    logits tensor is ever built during training.
    """
    body = model.get_base_model().model if hasattr(model, "get_base_model") else model.model
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    out = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
               use_cache=False)
    return out.last_hidden_state


def plan(input_ids, attention_mask, loss_mask, micro_batch: int, min_prefix: int | None = None):
    """Units of at most `micro_batch` consecutive rows: (rows, prefix, length) with `prefix`
    ids shared by the unit's rows and no trained token among ids 1..prefix, and `length` the
    unit's longest row; or (rows, 0, the batch's width): a plain micro-batch, exactly as
    without sharing (rows that share nothing make the same micro-batches as before)."""
    min_prefix = MIN_PREFIX if min_prefix is None else min_prefix
    lengths = attention_mask.sum(1).tolist()
    trained = loss_mask != 0
    # loss position t trains id t+1: a prefix of P ids is shared only if positions < P carry no loss
    first = torch.where(trained.any(1), trained.float().argmax(1).long(), attention_mask.sum(1).long())
    limit = [min(int(f), n - 1) for f, n in zip(first.tolist(), lengths)]

    def common(i, j):
        n = min(lengths[i], lengths[j])
        diff = (input_ids[i, :n] != input_ids[j, :n]).nonzero()
        return int(diff[0, 0]) if len(diff) else n

    def worth(k: int, p: int, p2: int, j: int) -> bool:
        """Whether row j joins the k rows sharing p ids, at a common prefix of p2: the k - 1
        rows beyond the first would feed p - p2 more ids each, and row j, left out, could
        share its own prefix with the row after it (e.g. the next group's longer persona
        prompt) instead of the p2 ids all the rows have in common."""
        if p2 == p:
            return True
        q = min(limit[j], limit[j + 1], common(j, j + 1)) if j + 1 < B else 0
        return (k - 1) * (p - p2) + (q if q >= min_prefix else 0) <= p2

    units, i, B = [], 0, input_ids.shape[0]
    while i < B:
        j, p = i + 1, limit[i]
        while j < B and j - i < micro_batch:
            p2 = min(p, limit[j], common(i, j))
            if p2 < min_prefix or not worth(j - i, p, p2, j):
                break
            p, j = p2, j + 1
        if j - i >= 2 and p >= min_prefix:
            units.append((list(range(i, j)), p))
            i = j
            continue
        if units and units[-1][1] == 0 and len(units[-1][0]) < micro_batch and units[-1][0][-1] == i - 1:
            units[-1][0].append(i)
        else:
            units.append(([i], 0))
        i += 1
    width = input_ids.shape[1]
    return [(rows, p, max(lengths[r] for r in rows) if p else width) for rows, p in units]


def fed_tokens(attention_mask, units) -> int:
    """The real ids the units feed forward: a shared prefix once per unit."""
    lengths = attention_mask.sum(1).tolist()
    return sum(p + sum(lengths[r] - p for r in rows) for rows, p, _ in units)
