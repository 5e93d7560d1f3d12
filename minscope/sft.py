"""Supervised fine-tuning on chat transcripts (next-token loss on assistant turns only).

Used to make the toy world's tiny models (the policy's starting point, the user
simulators) and as the "realism anchor" a trainable simulator can keep. Conversations go
through the same chat template as rollouts, so an SFT'd model sees exactly the prompts it
will see when it plays.
"""

from __future__ import annotations

import random

import torch
from tqdm.auto import tqdm

from .adapters import output_embedding
from .logprobs import token_logprobs
from .precision import round_parameters
from .prefix import final_hidden_states


def encode_chat(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of a conversation and a mask that is 1 on assistant content + end token.

    An assistant message with `"train": False` is context only (mask 0)."""
    ids, mask, done = [], [], ""
    clean = [{"role": m["role"], "content": m["content"]} for m in messages]
    for j, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(clean[:j], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(clean[:j + 1], tokenize=False)
        head, answer = prompt[len(done):], full[len(prompt):]
        # train on the content and the end-of-turn token, not on the newline after it
        body = answer.rstrip("\n")
        train = int(msg.get("train", True))
        for text, m in ((head, 0), (body, train), (answer[len(body):], 0)):
            if text:
                t = tokenizer(text, add_special_tokens=False)["input_ids"]
                ids += t
                mask += [m] * len(t)
        done = full
    return ids, mask


def pad_batch(rows, pad_id):
    T = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), T), dtype=torch.long)
    mask = torch.zeros((len(rows), T))
    for r, (i, m) in enumerate(rows):
        ids[r, :len(i)], attn[r, :len(i)], mask[r, :len(m)] = torch.tensor(i), 1, torch.tensor(m, dtype=torch.float)
    return ids, attn, mask


class AnchorBatches:
    """A method's realism anchor (`Method.anchor`): each call, a random SFT batch of real-user
    transcripts. Its `rng` is part of the saved state, so a resumed run draws the same batches."""

    def __init__(self, encoded, batch: int, pad_id: int, rng: random.Random):
        self.encoded, self.batch, self.pad_id, self.rng = encoded, batch, pad_id, rng

    def __call__(self):
        return pad_batch(self.rng.sample(self.encoded, min(self.batch, len(self.encoded))), self.pad_id)


def nll(model, ids, attn, mask) -> torch.Tensor:
    """Mean negative log-likelihood of the masked next tokens."""
    hidden = final_hidden_states(model, ids, attn)[:, :-1]                    # [B, T-1, H]
    logp = token_logprobs(hidden, output_embedding(model), ids[:, 1:])        # [B, T-1]
    m = mask[:, 1:]
    return -(logp * m).sum() / m.sum().clamp_min(1)


def sft(model, tokenizer, conversations: list[list[dict]], steps: int = 300, batch_size: int = 32,
        lr: float = 3e-3, seed: int = 0, desc: str = "sft", progress: bool = True) -> list[float]:
    """Train all trainable parameters of `model` on the assistant turns. Returns losses."""
    rng = random.Random(seed)
    encoded = sorted((encode_chat(tokenizer, c) for c in conversations), key=lambda e: len(e[0]))
    # Little padding, still i.i.d. batches: split the length-sorted data into 4 buckets, pick a
    # bucket in proportion to its size, then a uniformly random batch inside it.
    buckets = [b for b in (encoded[i * len(encoded) // 4:(i + 1) * len(encoded) // 4] for i in range(4)) if b]
    sizes = [len(b) for b in buckets]
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / steps))
    model.train()
    losses = []
    bar = tqdm(range(steps), desc=desc, leave=False, disable=not progress)
    for _ in bar:
        bucket = rng.choices(buckets, weights=sizes)[0]
        rows = [bucket[rng.randrange(len(bucket))] for _ in range(batch_size)]
        ids, attn, mask = (t.to(device) for t in pad_batch(rows, tokenizer.pad_token_id))
        loss = nll(model, ids, attn, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        round_parameters(params)          # float64 models (the toy's) only: minscope/precision.py
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return losses
