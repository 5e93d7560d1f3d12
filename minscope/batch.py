"""The training view of one party's episodes: the token ids it was fed and sampled, right
padded, the mask of its own sampled tokens and their sampling log-probs (`training_batch`),
which the update (minscope/trainer.py) trains on.

Only exact streams (minscope/stream.py) are used; when too few episodes kept one, the run stops
with a `StreamError` instead of training on a biased subset of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .envs.base import Episode


@dataclass
class TrainingBatch:
    input_ids: torch.Tensor      # [B, T] right-padded
    attention_mask: torch.Tensor # [B, T]
    loss_mask: torch.Tensor      # [B, T-1] 1 where target token t+1 was sampled by the party
    old_logp: torch.Tensor       # [B, T-1] sampling log-prob of those targets
    index: list[int]             # which episodes made it in (those with a usable stream)


MIN_EXACT_FRAC = 0.9      # below this share of exact streams a party is not trained


class StreamError(ValueError):
    """Too few episodes kept an exact token stream to train on."""


def training_batch(episodes: list[Episode], key: str, pad_id: int, dtype: torch.dtype = torch.float32) -> TrainingBatch:
    """Token ids + loss mask of one party's own sampled tokens, for every episode.

    Episodes whose stream for `key` is missing or was rewritten are left out (`index` says
    which rows are kept), so nothing is ever trained on re-tokenized text. `dtype`: of the
    sampling log-probs (float64 for the toy's float64 models: minscope/precision.py).
    """
    rows = [(i, ep.info["streams"][key]) for i, ep in enumerate(episodes)
            if key in ep.info.get("streams", {}) and ep.info["streams"][key].exact]
    frac = len(rows) / max(1, len(episodes))
    if frac < MIN_EXACT_FRAC:
        # Training on the few exact streams would be a biased subset (e.g. the episodes
        # that happened to be short): stop and say why instead.
        raise StreamError(f"only {len(rows)} of {len(episodes)} episodes kept an exact '{key}' token stream "
                          f"(exact_stream_frac {frac:.2f} < {MIN_EXACT_FRAC}): the chat template rewrote the "
                          "conversation between turns, so the sampled tokens can no longer be trained on as "
                          "sampled (see minscope/chat.py)")
    T = max(len(s.ids) for _, s in rows)
    B = len(rows)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.float)
    logp = torch.zeros((B, T), dtype=dtype)
    for r, (_, s) in enumerate(rows):
        n = len(s.ids)
        ids[r, :n] = torch.tensor(s.ids)
        attn[r, :n] = 1
        mask[r, :n] = torch.tensor(s.mask, dtype=torch.float)
        logp[r, :n] = torch.tensor(s.logp, dtype=dtype)
    # Position t predicts token t+1: shift the target-side tensors left by one.
    return TrainingBatch(ids, attn, mask[:, 1:], logp[:, 1:], [i for i, _ in rows])
