"""The sampler: many prompts decoded in one batch, with a party's kept KV cache.

`sample` feeds each prompt's part that the party's `KVCache` (minscope/kvcache.py) does not
hold yet, left padded, then draws the next token of every row from softmax(logits /
temperature), one batched forward per new token, and records each token's log-prob under that
distribution; rows that end leave the decode batch. `tail_logits` reads the logits of a
prompt's last positions without sampling anything (a readout). `share_prefixes` prefills a
prompt prefix that several new conversations share once and copies its keys and values to the
others. `_Forward` is the one forward of the cache's front rows that all of them run (through
minscope/lean.py for Llamas on the CPU). `eos_token_ids` are the ids that end a turn.
"""

from __future__ import annotations

import torch

from .kvcache import KVCache, common_prefix
from .lean import lean_forward
from .models import model_device
from .precision import widen


LEAN = True      # Llama models on the CPU decode through minscope/lean.py (less overhead; packed.py: few-row products)

def _cache_kwarg(model) -> str:
    """transformers renamed `past_key_values` to `cache` in 5.2x; support both."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


@torch.no_grad()
def sample(model, prompts: list[list[int]], pad_id: int, eos_ids: set[int], max_new_tokens: int,
           temperature: float = 1.0, adapter_names: list[str] | None = None,
           cache: KVCache | None = None, owners: list | None = None, check_every: int = 4,
           uniforms: torch.Tensor | None = None, share_prefix: bool = False):
    """Sample continuations of many prompts in one batch.

    temperature 0 means greedy. Returns (token ids, log-probs) per prompt; each list stops
    after the first EOS or at `max_new_tokens`. Log-probs are under the sampling
    distribution softmax(logits / temperature) (the greedy token's under temperature 1).

    cache/owners: a party's `KVCache` kept across its turns, and the conversation each
    prompt belongs to. Only the part of a prompt that is not already cached is fed (the
    suffix since the party's last turn); without a cache every prompt is fed whole.
    `cache.last_prefilled` says how many ids of each prompt were fed.

    Tokens stay on the device; every `check_every` tokens the finished flags are copied to
    the host once, rows that hit EOS leave the decode batch and the loop ends when all did.

    uniforms: [B, max_new_tokens] numbers in [0, 1): sample by inverse CDF, token t of row i
    being the first whose cumulative probability exceeds uniforms[i, t], instead of drawing
    from torch's generator (the collapse meter holds a party's noise fixed this way).

    share_prefix: prompts with nothing cached that start with the same ids (a group's shared
    system prompt and persona) are prefilled once, by one of them, and the others copy its
    keys/values (`share_prefixes`); the same tokens, fewer prefilled ids.
    """
    device = model_device(model)
    model.eval()          # generation is inference (and peft's per-row adapters require it)
    cache = KVCache() if cache is None else cache
    owners = [object() for _ in prompts] if owners is None else owners
    B = len(prompts)
    reused = cache.prepare(owners, prompts, device)
    shared, reused_before = [0] * B, reused
    if share_prefix:
        reused, shared = share_prefixes(model, cache, prompts, reused, adapter_names, pad_id, device)
    cache.last_prefilled = [len(p) - k + s for p, k, s in zip(prompts, reused, shared)]
    cache.last_shared = [k - r - s for k, s, r in zip(reused, shared, reused_before)]
    run = _Forward(model, cache, adapter_names)
    cache.reserve(max(len(p) - k for p, k in zip(prompts, reused)) + max_new_tokens, device)   # the whole turn

    logits = run(*suffix_batch(prompts, reused, pad_id, device))

    out_ids = torch.full((B, max_new_tokens), -1, dtype=torch.long, device=device)
    out_logp = torch.zeros((B, max_new_tokens), dtype=logits.dtype, device=device)
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)
    uniforms = None if uniforms is None else uniforms.to(device)
    row = torch.arange(B, device=device)              # the prompt of each row being decoded
    next_pos = torch.tensor([len(p) for p in prompts], device=device)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    steps = 0
    for t in range(max_new_tokens):
        if temperature > 0:
            logprobs = torch.log_softmax(logits / temperature, dim=-1)
            if uniforms is None:
                token = torch.multinomial(logprobs.exp(), 1).squeeze(1)      # [b]
            else:
                cdf = logprobs.exp().cumsum(-1)
                u = uniforms[row, t, None].to(cdf.dtype)
                token = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=cdf.shape[-1] - 1)
        else:
            logprobs = torch.log_softmax(logits, dim=-1)
            token = logprobs.argmax(-1)
        out_ids[row, t] = token
        out_logp[row, t] = logprobs.gather(1, token[:, None]).squeeze(1)
        finished |= torch.isin(token, eos)
        steps = t + 1
        if steps == max_new_tokens:
            break                              # the last token is not fed: nothing follows it
        if steps % check_every == 0:
            done = finished.tolist()           # the one device->host copy of these steps
            if all(done):
                break
            if any(done):                      # finished rows leave the decode batch
                keep = [i for i, d in enumerate(done) if not d]
                run.keep_rows(keep, [i for i, d in enumerate(done) if d])
                index = torch.tensor(keep, device=device)
                row, token, next_pos, finished = row[index], token[index], next_pos[index], finished[index]
        # A row that just sampled EOS is still fed until the next check; that position is
        # masked out (a hole), so the cache keeps exactly the ids before each row's last token.
        logits = run(token[:, None], ~finished[:, None], next_pos[:, None])
        next_pos = next_pos + (~finished).long()

    ids_all, logp_all = out_ids[:, :steps].tolist(), out_logp[:, :steps].tolist()   # one copy per turn
    result_ids, result_logp = [], []
    for i in range(B):
        ids = ids_all[i]
        end = next((j + 1 for j, x in enumerate(ids) if x in eos_ids), len(ids))
        result_ids.append(ids[:end])
        result_logp.append(logp_all[i][:end])
    cache.record(owners, [p + g[:-1] for p, g in zip(prompts, result_ids)])
    return result_ids, result_logp


def suffix_batch(prompts: list[list[int]], reused: list[int], pad_id: int, device):
    """The prefill of each prompt's uncached suffix (its first `reused` ids are cached), left
    padded: (input_ids, real, position) [B, S] on `device`; positions continue from the
    cached ids."""
    S = max(len(p) - k for p, k in zip(prompts, reused))
    input_ids = torch.full((len(prompts), S), pad_id, dtype=torch.long)
    real = torch.zeros((len(prompts), S), dtype=torch.bool)
    position = torch.zeros((len(prompts), S), dtype=torch.long)
    for i, (p, k) in enumerate(zip(prompts, reused)):
        n = len(p) - k
        input_ids[i, S - n:] = torch.tensor(p[k:])
        real[i, S - n:] = True
        position[i, S - n:] = torch.arange(k, len(p))
    return input_ids.to(device), real.to(device), position.to(device)


@torch.no_grad()
def tail_logits(model, prompts: list[list[int]], pad_id: int, keep: int = 1, adapter_names: list[str] | None = None,
                cache: KVCache | None = None, owners: list | None = None) -> torch.Tensor:
    """The logits at the last `keep` positions of each prompt, [B, keep, V] on the CPU (a
    readout: nothing is sampled, no random number drawn). With a party's kept `cache`, only
    what it does not hold is fed: after an episode, a readout of the party's view costs the
    question's few tokens, not the conversation again. The cache then holds the prompts
    (`record`), so the next readout of the same conversation drops this one's tokens."""
    device = model_device(model)
    model.eval()
    cache = KVCache() if cache is None else cache
    owners = [object() for _ in prompts] if owners is None else owners
    reused = cache.prepare(owners, prompts, device)
    for r, (k, p) in enumerate(zip(reused, prompts)):
        if k > len(p) - keep:             # the positions read must be fed again
            cache.crop_row(r, len(p) - keep)
            reused[r] = len(p) - keep
    cache.last_prefilled = [len(p) - k for p, k in zip(prompts, reused)]
    logits = _Forward(model, cache, adapter_names)(*suffix_batch(prompts, reused, pad_id, device), keep=keep)
    cache.record(owners, prompts)
    return (logits[:, None] if keep == 1 else logits).cpu()


# Shorter common prefixes are prefilled by every row: not worth a forward of their own (and the
# toy's prompts, all shorter, sample exactly as before).
SHARE_MIN = 64


def share_prefixes(model, cache: KVCache, prompts, reused, adapter_names, pad_id: int, device):
    """Prefill each shared prompt prefix once and copy its keys/values to the rows that share it.

    Rows with nothing cached (`reused` 0: a conversation's first turn) whose prompts start with
    the same `SHARE_MIN` ids and use the same adapter form a cluster; its prefix is the ids all
    of them share (never a prompt's last id: its logits start the turn). One row per cluster
    (the leader) feeds the prefix, in one batch with the other leaders; the other rows get a
    copy of the leader's keys/values and mask at those columns (the cache's rows are separate
    buffers, so a copy, not a view; it costs memory traffic, not a forward). Returns the new
    `reused` (ids of each prompt now cached) and, per prompt, the ids it fed for a cluster.
    """
    B = len(prompts)
    names = adapter_names or [None] * B
    buckets: dict = {}
    for i, (p, k) in enumerate(zip(prompts, reused)):
        if k == 0 and len(p) > SHARE_MIN:
            buckets.setdefault((names[i], tuple(p[:SHARE_MIN])), []).append(i)
    clusters = []
    for rows in buckets.values():
        # Within a bucket, each row joins the cluster where it saves the most fed ids, or starts
        # its own: a cluster of k rows sharing n ids that takes a row sharing only n2 < n feeds
        # (k - 1) * (n - n2) more, and a row that shares more ids with the next row than the two
        # would save by joining starts a cluster with it. So two P4G groups, whose persuadee
        # prompts share their first ~100 ids and then differ by persona (~420 ids each), make
        # two clusters, not one of 100.
        found: list[list] = []                      # [rows, ids they all share]
        for at, r in enumerate(rows):
            best, gain = None, 0
            for c in found:
                n2 = min(c[1], common_prefix(prompts[c[0][0]], prompts[r]), len(prompts[r]) - 1)
                saves = n2 - (len(c[0]) - 1) * (c[1] - n2)
                if n2 >= SHARE_MIN and saves > gain:
                    best, gain, shared_ids = c, saves, n2
            # or r starts a cluster with the next row (a group's rows are consecutive)
            nxt = rows[at + 1] if at + 1 < len(rows) else None
            ahead = 0 if nxt is None else min(common_prefix(prompts[r], prompts[nxt]), len(prompts[r]) - 1,
                                              len(prompts[nxt]) - 1)
            if best is None or (ahead >= SHARE_MIN and ahead > gain + shared_ids):
                found.append([[r], len(prompts[r]) - 1])
            else:
                best[0].append(r)
                best[1] = shared_ids
        clusters += [(c[0], c[1]) for c in found if len(c[0]) >= 2 and c[1] >= SHARE_MIN]
    shared = [0] * B
    if not clusters:
        return reused, shared
    leaders = [rows[0] for rows, _ in clusters]
    order = leaders + [i for i in range(B) if i not in set(leaders)]
    cache.reorder(order + list(range(B, cache.rows)))        # the leaders are the front rows
    cache.front = len(leaders)
    run = _Forward(model, cache, None if adapter_names is None else [adapter_names[i] for i in leaders])
    S = max(n for _, n in clusters)
    cache.reserve(S, device)
    input_ids = torch.full((len(leaders), S), pad_id, dtype=torch.long)
    real = torch.zeros((len(leaders), S), dtype=torch.bool)
    position = torch.zeros((len(leaders), S), dtype=torch.long)
    for j, (rows, n) in enumerate(clusters):
        input_ids[j, S - n:] = torch.tensor(prompts[rows[0]][:n])
        real[j, S - n:] = True
        position[j, S - n:] = torch.arange(n)
    w0 = cache.width
    run(input_ids.to(device), real.to(device), position.to(device))
    cols = slice(w0, w0 + S)
    back = {i: r for r, i in enumerate(order)}        # prompt i sits at row back[i] now
    reused = list(reused)
    for j, (rows, n) in enumerate(clusters):
        dst = torch.tensor([back[r] for r in rows[1:]], device=device)
        for buf in cache.keys + cache.values:
            if buf is not None:
                # (a copy of the source: when the columns span the whole buffer, torch refuses
                # to write rows of a tensor from a view into that same tensor)
                buf[dst, :, cols] = buf[j, :, cols].clone().unsqueeze(0)
        cache.mask[dst, cols] = cache.mask[j, cols].clone().unsqueeze(0)
        for r in rows:
            cache.cached[back[r]] = list(prompts[r][:n])
            reused[r] = n
        shared[rows[0]] = n
    inverse = [back[i] for i in range(B)]
    cache.reorder(inverse + list(range(B, cache.rows)))      # back in the prompts' order
    cache.front = B
    return reused, shared


class _Forward:
    """One forward of the cache's front rows over `s` new positions; returns last logits."""

    def __init__(self, model, cache: KVCache, adapter_names):
        self.model, self.cache, self.names = model, cache, adapter_names
        self.cache_kw = _cache_kwarg(model)
        impl = getattr(model.config, "_attn_implementation", "sdpa")
        if impl not in ("sdpa", "eager"):
            raise ValueError(f"sampling with a kept KV cache needs sdpa or eager attention, not {impl!r} "
                             "(load the model with attn_implementation='sdpa')")
        self.additive = impl == "eager"
        self.dtype = model.get_input_embeddings().weight.dtype
        self.lean = lean_forward(model) if LEAN else None    # Llamas on the CPU (minscope/lean.py)

    def keep_rows(self, keep: list[int], leave: list[int]):
        """Rows `keep` (positions in the decode batch) stay in front; rows `leave` move back."""
        c = self.cache
        c.reorder(keep + leave + list(range(c.front, c.rows)))
        c.front = len(keep)
        if self.names is not None:
            self.names = [self.names[i] for i in keep]

    def __call__(self, input_ids, real, position, keep: int = 1):
        """Logits of the last position [B, V], or of the last `keep` positions [B, keep, V]."""
        c, s = self.cache, input_ids.shape[1]
        c.reserve(s, input_ids.device)
        c.mask[:c.front, c.width:c.width + s] = real
        mask = c.attention_mask(s, self.dtype, self.additive)
        if self.lean is not None:     # the same operations without the general forward's overhead
            logits = self.lean(input_ids, mask, position, c, self.names, keep)
            c.advance(s)
            return logits
        extra = {"adapter_names": self.names} if self.names is not None else {}
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position,
                         use_cache=True, logits_to_keep=keep, **{self.cache_kw: c}, **extra)
        c.advance(s)
        return widen(out.logits[:, -1] if keep == 1 else out.logits[:, -keep:])


def eos_token_ids(tokenizer, model=None) -> set[int]:
    ids = {tokenizer.eos_token_id}
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen is not None:
        ids |= set(gen if isinstance(gen, list) else [gen])
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return {i for i in ids if i is not None}
