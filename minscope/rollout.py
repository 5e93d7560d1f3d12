"""The multi-turn, two-party rollout engine.

An *agent* (the policy) and a *partner* (a user simulator, or a second agent) take turns.
Each party sees the conversation through its own chat template with the roles flipped:
its own turns are "assistant", the other party's are "user", environment turns (tool
results) are "tool" for the party they are addressed to (`Turn.to`, the agent by default)
and hidden from the other.

Every live conversation's next turn is generated in ONE batched call per party (left
padding, KV cache). Each party keeps, per episode, a token *stream*: exactly the ids it was
fed and the ids it sampled. The stream is extended by tokenizing only the new chat-template
text between turns, so the tokens a party is later trained on are exactly the ones it
sampled — generated text is never re-tokenized.

    Episode ──► streams["agent"]   = ids, mask (1 on the agent's sampled tokens), logp
            └─► streams["partner"] = ids, mask (1 on the partner's sampled tokens), logp

On generated tokens the two masks are complementary: every sampled token belongs to exactly
one party's stream with mask 1.

One file, though long: sampling, the kept KV cache and the token streams interlock (a
party's stream must hold exactly what its cache was fed), so the code that keeps them
consistent is read in one place.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field

import torch

from .chat import chat_format, strip_reasoning
from .compute import parameter_count
from .envs.base import Episode, Turn, turn_noise
from .kvcache import KVCache, common_prefix, party_cache, session
from .lean import lean_forward
from .models import model_device, use_adapter
from .precision import widen
from .readout import DECISION_TOKENS, amount_tokens, expected_amount, read_tokens


# --------------------------------------------------------------------------- sampling
LEAN = True      # Llama models on the CPU decode through minscope/lean.py (bit-identical, less overhead)

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


# --------------------------------------------------------------------------- views
def view_messages(env, episode: Episode, role: str) -> list[dict]:
    """The conversation as `role` sees it, as chat messages (its own turns = assistant)."""
    lead = env.agent_messages(episode.task) if role == "agent" else env.partner_messages(episode.task)
    messages = list(lead)
    for turn in episode.turns:
        if turn.role == role:
            messages.append({"role": "assistant", "content": turn.text})
        elif turn.role == "env":
            if (turn.to or "agent") == role:    # tool results go to the party addressed (the agent by default)
                messages.append({"role": "tool", "content": turn.text})
        elif turn.public:
            messages.append({"role": "user", "content": turn.text})
    return messages


@dataclass
class Stream:
    """What one party was fed and sampled in one episode (see module docstring).

    While `exact` is True, `ids` only ever grows by appending: each turn appends the
    chat-template text of the messages that are new to this party (`chat.ChatFormat.delta`)
    and then the tokens it sampled. If the conversation this party sees was rewritten (the
    messages already in the stream are no longer a prefix of its view, e.g. Verbalized
    Sampling shows the drawn reply instead of what was sampled), or the template cannot be
    rendered turn by turn, the stream restarts from the full prompt and `exact` becomes
    False: such a stream is never trained on.
    """
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)      # 1 = sampled by this party
    logp: list[float] = field(default_factory=list)    # sampling log-prob (0 where mask 0)
    text: str = ""                                      # the text that `ids` spell
    exact: bool = True                                  # False once the history was rewritten
    messages: list = field(default_factory=list)        # the view's messages already in `ids`
    sampled_end: str = ""                               # end-of-turn text the last sampled turn ended with

    def extend_prompt(self, chat, messages: list[dict], tools=None):
        """Append the template text of the messages in `messages` (this party's whole view)
        that the stream does not hold yet, and the generation prompt. `chat` is the party's
        `chat.ChatFormat`."""
        n = len(self.messages)
        new = messages[n:]
        if not self.ids:                                 # the first turn: the whole prompt
            delta = template_text(chat, messages, tools)
        elif (messages[:n] == self.messages and chat.incremental
              and all(m["role"] != "assistant" for m in new)):
            delta = template_text(chat, new, tools, self.sampled_end)
        else:
            # The history was rewritten, or the template cannot be rendered turn by turn:
            # restart from the full prompt (not used for training: `exact` is False).
            self.ids, self.mask, self.logp, self.text, self.exact = [], [], [], "", False
            delta = template_text(chat, messages, tools)
        ids = text_ids(chat, delta) if delta else []
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logp += [0.0] * len(ids)
        self.text += delta
        self.messages = [dict(m) for m in messages]
        self.sampled_end = ""

    def extend_forced(self, ids: list[int], text: str):
        """Append ids this party did not sample (the start of an answer it is made to give)."""
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logp += [0.0] * len(ids)
        self.text += text

    def extend_sampled(self, ids: list[int], logp: list[float], text: str, shown: str | None = None,
                       end: str = ""):
        """Append a sampled turn. `shown`: the turn's text as it enters the conversation
        (what this party's view will hold as its own message); `end`: the text of the
        end-of-turn token the turn ended with ('' when it stopped at the length cap)."""
        self.ids += ids
        self.mask += [1] * len(ids)
        self.logp += logp
        self.text += text
        if shown is not None:
            self.messages.append({"role": "assistant", "content": shown})
        self.sampled_end = end


# ------------------------------------------------------------- memoised text <-> ids
# Rendering a chat template (jinja) and calling a tokenizer cost about a millisecond each, per
# episode and turn; the toy's conversations repeat the same few texts, so most of them are
# the same call again. These are pure functions of their inputs, memoised per chat format
# (bounded; short inputs only; not for templates that read the clock), so the text and ids
# are exactly what the direct calls give.
MEMO_ENTRIES, MEMO_KEY_CHARS = 4096, 4000


def _memo(chat, kind: str, key, compute):
    memo = chat.__dict__.setdefault("_rollout_memo", {})
    key = (kind, len(chat.tokenizer), key)      # (a tokenizer that gained tokens starts afresh)
    if key in memo:
        return memo[key]
    value = compute()
    if len(memo) >= MEMO_ENTRIES:
        memo.clear()
    memo[key] = value
    return value


def template_text(chat, messages: list[dict], tools=None, sampled_end: str | None = None) -> str:
    """chat.render(messages, tools), or chat.delta(messages, tools, sampled_end) when given."""
    def compute():
        return chat.render(messages, tools) if sampled_end is None else chat.delta(messages, tools, sampled_end)
    if "strftime" in (getattr(chat.tokenizer, "chat_template", None) or ""):
        return compute()
    try:
        key = json.dumps([messages, tools, sampled_end])      # keeps the order of keys: it is rendered
    except (TypeError, ValueError):
        return compute()
    return compute() if len(key) > MEMO_KEY_CHARS else _memo(chat, "text", key, compute)


def text_ids(chat, text: str) -> list[int]:
    """chat.tokenizer(text, add_special_tokens=False)["input_ids"] (a fresh list)."""
    def compute():
        return chat.tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(text) > MEMO_KEY_CHARS:
        return compute()
    return list(_memo(chat, "ids", text, compute))


def ids_text(chat, ids: list[int]) -> str:
    """chat.tokenizer.decode(ids, skip_special_tokens=False)."""
    return _memo(chat, "decode", tuple(ids), lambda: chat.tokenizer.decode(ids, skip_special_tokens=False))


def eos_token_ids(tokenizer, model=None) -> set[int]:
    ids = {tokenizer.eos_token_id}
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen is not None:
        ids |= set(gen if isinstance(gen, list) else [gen])
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return {i for i in ids if i is not None}


def with_system_suffix(messages: list[dict], suffix, episode) -> list[dict]:
    """`messages` with `suffix` (a string, or a function episode -> string) appended to the
    system message, or a system message of its own when there is none."""
    suffix = suffix(episode) if callable(suffix) else suffix
    if suffix:
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + suffix}
        else:
            messages.insert(0, {"role": "system", "content": suffix})
    return messages


class LMSpeaker:
    """A party played by a causal LM (optionally through a LoRA adapter).

    role: "agent" or "partner" — whose turns this speaker produces.
    adapter: adapter name, None for the plain base, or a function episode -> name for
             per-episode adapters (a population): rows with different adapters are still
             generated in one batch (peft mixed-adapter batches).
    temperature: sampling temperature. An "aligned", mode-collapsed simulator is modelled
             by gamma-sharpening the logits, i.e. temperature = 1 / gamma.
    thinking: let a thinking chat template (Qwen3) think; False (the default) renders with
             `enable_thinking=False`. The other party never sees the reasoning.
    """

    reuse_cache = True     # keep the KV cache between turns (False: re-feed the whole stream)
    share_prefix = True    # prefill the prompt prefix shared by a batch's new conversations once
    holds_noise = True     # samples with an episode's fixed noise when it has one (envs.base.turn_noise)

    def __init__(self, model, tokenizer, role: str, adapter=None, temperature: float = 1.0,
                 max_new_tokens: int = 64, name: str | None = None, system_suffix: str = "",
                 thinking: bool = False):
        self.model, self.tokenizer, self.role = model, tokenizer, role
        self.thinking = thinking
        self.adapter, self.temperature, self.max_new_tokens = adapter, temperature, max_new_tokens
        self.name = name or (adapter if isinstance(adapter, str) else role)
        self.system_suffix = system_suffix  # str or episode -> str, appended to the system message
        self.eos = eos_token_ids(tokenizer, model) | self.chat.stop_ids    # (a plain transcript: a newline too)

    @property
    def chat(self):
        """This party's chat format (`chat.ChatFormat`, one per tokenizer and thinking mode)."""
        return chat_format(self.tokenizer, self.thinking)

    def adapter_of(self, episode):
        return self.adapter(episode) if callable(self.adapter) else self.adapter

    def messages_for(self, env, episode) -> tuple[list[dict], list | None]:
        """This party's view of the conversation (with its system suffix), and its tools."""
        messages = with_system_suffix(view_messages(env, episode, self.role), self.system_suffix, episode)
        if self.role == "agent":
            tools = env.agent_tools(episode.task)
        else:
            tools = env.partner_tools(episode.task) if hasattr(env, "partner_tools") else None
        return messages, tools

    def render(self, env, episode) -> str:
        """The whole prompt of this party's next turn, rendered in one go."""
        return self.chat.render(*self.messages_for(env, episode))

    def generate(self, episodes: list[Episode], env):
        """Sample one turn for each episode; returns (texts, ids, logps). Updates streams."""
        key = self.role
        streams = []
        for ep in episodes:
            stream = ep.info.setdefault("streams", {}).setdefault(key, Stream())
            stream.extend_prompt(self.chat, *self.messages_for(env, ep))
            streams.append(stream)
        ids, logps = self._sample(episodes, [s.ids for s in streams])
        texts = []
        for stream, gen, lp in zip(streams, ids, logps):
            ended = bool(gen) and gen[-1] in self.eos
            # The turn's text is decoded exactly as the template will show it later, so the
            # next prompt extends this stream instead of re-tokenizing it.
            text = ids_text(self.chat, gen[:-1] if ended else gen)
            end = ids_text(self.chat, gen[-1:]) if ended else ""
            shown = strip_reasoning(text)      # the other party never sees the reasoning
            stream.extend_sampled(gen, lp, text + end, shown=shown, end=end)
            texts.append(shown)
        return texts, ids, logps

    def _sample(self, episodes: list[Episode], prompts: list[list[int]]):
        """One turn of every episode in one batch. Inside a rollout the speaker keeps its KV
        cache between its turns and feeds only each stream's new suffix (`reuse_cache`);
        ep.info["tokens"][role] counts the ids fed ("prefilled") and sampled ("generated"), and
        holds the N of the model that did it (minscope/compute.py)."""
        cache = party_cache(self) if self.reuse_cache else KVCache()
        cache.discard(lambda ep: ep.done)           # ended episodes leave the cache
        names = [self.adapter_of(ep) for ep in episodes]
        kwargs = dict(pad_id=self.tokenizer.pad_token_id, eos_ids=self.eos, cache=cache, owners=episodes,
                      max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                      share_prefix=self.share_prefix)
        noise = [turn_noise(ep, self.role) for ep in episodes]
        if any(n is not None for n in noise):   # the collapse meter holds this party's noise fixed
            if not all(n is not None for n in noise):
                raise ValueError("a batch mixes episodes with and without fixed sampling noise")
            kwargs["uniforms"] = torch.tensor([n.random(self.max_new_tokens).tolist() for n in noise])
        if len(set(names)) == 1:
            with use_adapter(self.model, names[0]):
                ids, logps = sample(self.model, prompts, **kwargs)
        else:   # a population: one batch, one adapter per row ("__base__" = no adapter);
            # a row's adapter is fixed for its episode, so its cached keys/values stay valid
            ids, logps = sample(self.model, prompts, adapter_names=[n or "__base__" for n in names], **kwargs)
        copies = cache.last_shared if len(cache.last_shared) == len(ids) else [0] * len(ids)   # (another sampler)
        for ep, name, fed, copied, gen in zip(episodes, names, cache.last_prefilled, copies, ids):
            count = ep.info.setdefault("tokens", {}).setdefault(self.role, {"prefilled": 0, "generated": 0})
            count["prefilled"] += fed
            count["shared"] = count.get("shared", 0) + copied     # ids copied from another row's prefill
            count["generated"] += len(gen)
            count["params"] = parameter_count(self.model, name)     # N, for the FLOPs estimate
        return ids, logps

    def read_amount(self, episodes: list[Episode], env, question: str | None, answer_prefix: str,
                    decide: bool = False) -> list[dict]:
        """After the episodes, the amount this party states when asked `question` (a user
        message; None: none) and its reply begins with `answer_prefix` (minscope/readout.py):
        per episode {"amount": the expected dollars, an unreadable answer counting $0 (what a
        sampled reading pays, on average), "conditional": the expected dollars given a readable
        amount, "coverage": the probability that it writes a readable one}, all under its
        sampling distribution (its temperature; greedy at 0). Each episode is read through the adapter that played it;
        inside the rollout's session the party's kept KV cache is reused.

        decide=False: a held-out reading; the episodes' own streams are left as they are (a
        copy is extended). decide=True: the question and the prefix join this party's own
        stream (mask 0) and it samples its decision there (`readout.DECISION_TOKENS` tokens,
        mask 1, with their log-probs), so a trained party learns it like any of its turns;
        the entry also holds "stated" (the sampled reading, None if unreadable) and "text"."""
        chat = self.chat
        tok = amount_tokens(lambda t: text_ids(chat, t), answer_prefix)
        streams = []
        for ep in episodes:
            mine = ep.info.setdefault("streams", {}).setdefault(self.role, Stream())
            s = mine if decide else Stream(ids=list(mine.ids), mask=list(mine.mask), logp=list(mine.logp),
                                           text=mine.text, exact=mine.exact, messages=list(mine.messages),
                                           sampled_end=mine.sampled_end)
            messages, tools = self.messages_for(env, ep)
            if question:
                messages = messages + [{"role": "user", "content": question}]
            s.extend_prompt(chat, messages, tools)
            s.extend_forced(text_ids(chat, answer_prefix), answer_prefix)
            streams.append(s)
        prompts = [s.ids for s in streams]
        cache = party_cache(self) if self.reuse_cache else KVCache()
        names = [self.adapter_of(ep) for ep in episodes]
        single = len(set(names)) == 1
        rows = None if single else [n or "__base__" for n in names]
        pad = self.tokenizer.pad_token_id
        fed, made = [0] * len(episodes), [0] * len(episodes)
        with use_adapter(self.model, names[0]) if single else contextlib.nullcontext():
            forced = []
            for lead in (0, 1):      # teacher-forced "0." and "1.": every distribution the rules read
                logits = tail_logits(self.model, [p + [tok.digits[lead], tok.point] for p in prompts], pad, keep=3,
                                     adapter_names=rows, cache=cache, owners=episodes)
                fed = [f + n for f, n in zip(fed, cache.last_prefilled)]
                logits = logits.to("cpu", torch.float64)     # log-probs in float64, whatever the model's dtype
                if self.temperature > 0:
                    forced.append(torch.log_softmax(logits / self.temperature, dim=-1))
                else:
                    forced.append(torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1])
                                 .to(torch.float64).log())
            read = expected_amount(forced[0], forced[1], tok)
            out = [{"amount": a, "conditional": g, "coverage": c}
                   for a, g, c in zip(read.amount.tolist(), read.conditional.tolist(), read.coverage.tolist())]
            if decide:
                ids, logps = sample(self.model, prompts, pad, self.eos, DECISION_TOKENS, self.temperature,
                                    adapter_names=rows, cache=cache, owners=episodes)
                fed = [f + n for f, n in zip(fed, cache.last_prefilled)]
                made = [len(g) for g in ids]
                for s, o, gen, lp in zip(streams, out, ids, logps):
                    text = ids_text(chat, gen)
                    s.extend_sampled(gen, lp, text)
                    o.update(stated=read_tokens(gen, tok), text=text)
        for ep, n, g in zip(episodes, fed, made):
            count = ep.info.setdefault("tokens", {}).setdefault(self.role, {"prefilled": 0, "generated": 0})
            count["prefilled"] += n
            count["generated"] += g
        return out

    def respond(self, episodes: list[Episode], env) -> list[Turn]:
        texts, ids, _ = self.generate(episodes, env)
        return [Turn(role=self.role, text=t, token_ids=i) for t, i in zip(texts, ids)]

    def assign(self, episodes: list[Episode]):
        for ep in episodes:
            ep.partner_name = self.name


# --------------------------------------------------------------------------- the loop
ROLLOUT_BATCH: int | None = None   # default `max_batch` of `rollout` (see `rollout_batch`)


@contextlib.contextmanager
def rollout_batch(n: int | None):
    """Inside the block, `rollout` plays at most `n` episodes at once (None: all at once).
    A real run sets this from --rollout-batch: the KV cache of every live episode is held
    until the episode ends, so the chunk size bounds the rollout's memory."""
    global ROLLOUT_BATCH
    saved, ROLLOUT_BATCH = ROLLOUT_BATCH, n
    try:
        yield
    finally:
        ROLLOUT_BATCH = saved


def rollout(env, tasks, agent, partner, group_size: int = 1, max_batch: int | None = None,
            first_group: int = 0, seed: int | None = None) -> list[Episode]:
    """Play every task `group_size` times: returns scored episodes, grouped consecutively.

    `agent` and `partner` are speakers: objects with `respond(episodes, env) -> [Turn]`
    (an LM speaker, a simulator strategy, or a scripted population such as real users).
    max_batch: play the tasks in chunks of whole groups, at most `max_batch` episodes
    generated at once (at least one group); default `ROLLOUT_BATCH`. Every episode's
    info["rollout_s"] is the wall time of the whole call. seed: each chunk samples from
    torch's generator seeded by (seed, its first group number) and puts the generator back
    after, so a group's episodes do not depend on which process or chunk played it
    (`distributed`: the ranks of a torchrun job play one chunk each).
    """
    start = time.perf_counter()
    limit = ROLLOUT_BATCH if max_batch is None else max_batch
    per = max(1, limit // group_size) if limit else len(tasks)
    if len(tasks) > per:       # chunk by chunk; group numbers stay those of the whole call
        episodes = [ep for s in range(0, len(tasks), per)
                    for ep in rollout(env, tasks[s:s + per], agent, partner, group_size, max_batch=0,
                                      first_group=first_group + s, seed=seed)]
        elapsed = time.perf_counter() - start
        for ep in episodes:
            ep.info["rollout_s"] = elapsed
        return episodes
    if seed is not None:       # this chunk's own random stream
        cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed((1_000_003 * seed + first_group) % 2**63)
            return rollout(env, tasks, agent, partner, group_size, max_batch=0, first_group=first_group)
    episodes = [Episode(task=t, group=first_group + g) for g, t in enumerate(tasks) for _ in range(group_size)]
    if hasattr(partner, "assign"):
        partner.assign(episodes)
    speaker_of = {"agent": agent, "partner": partner}
    nxt = {id(ep): env.first_speaker(ep.task) for ep in episodes}
    live = list(episodes)
    with session():       # each LM speaker keeps its KV cache for this rollout only
        while live:
            for role in ("agent", "partner"):
                batch = [ep for ep in live if nxt[id(ep)] == role]
                if not batch:
                    continue
                for ep, turn in zip(batch, speaker_of[role].respond(batch, env)):
                    ep.turns.append(turn)
                    step = env.after_turn(ep)
                    ep.turns.extend(step.inject)
                    nxt[id(ep)] = step.next_speaker
                    if step.next_speaker is None:
                        ep.done = True
            live = [ep for ep in live if not ep.done]
        # Readouts (P4G's --p4g-reward expected|sampled): after the dialogue, the partner that
        # played each episode is asked a question and states an amount (minscope/readout.py),
        # kept in ep.info["readouts"] for `env.score`; the partner's KV cache is still here. The
        # environment's `decision` readout is sampled into the partner's own stream (trained
        # with its turns); the others read a copy, so they go first.
        reads = env.readouts() if hasattr(env, "readouts") else {}
        decision = getattr(env, "decision", None)
        for name in sorted(reads, key=lambda n: n == decision):
            if not hasattr(partner, "read_amount"):
                raise ValueError(f"{getattr(env, 'name', 'this environment')}'s readouts need a partner LM "
                                 f"whose next-token probabilities can be read; {type(partner).__name__} has none")
            question, prefix = reads[name]
            for ep, r in zip(episodes, partner.read_amount(episodes, env, question, prefix, decide=name == decision)):
                ep.info.setdefault("readouts", {})[name] = r
    # Scoring is the environment boundary. An evaluator that raises on one episode (tau2's
    # official checks raise when the agent never created what the task asks about) scores
    # that episode 0 and keeps the error in ep.info["score_error"] (train_step counts them);
    # a reward that is not a finite number would turn every parameter NaN: it is refused.
    import math

    from .errors import RunStopped

    for ep in episodes:
        try:
            reward, info = env.score(ep)
        except Exception as e:   # noqa: BLE001 - any evaluator failure, kept in the episode
            reward, info = 0.0, {"score_error": f"{type(e).__name__}: {e}"}
        try:
            reward = float(reward)
        except (TypeError, ValueError):
            reward = float("nan")
        if not math.isfinite(reward):
            task = next((getattr(ep.task, a) for a in ("id", "name") if getattr(ep.task, a, None) is not None),
                        repr(ep.task)[:80])
            raise RunStopped(f"{getattr(env, 'name', type(env).__name__)} scored task {task} with a "
                             f"non-finite reward ({reward}); rewards must be finite numbers, so the "
                             "run stops before the policy learns from it")
        ep.reward = reward
        ep.info.update(info)
    elapsed = time.perf_counter() - start
    for ep in episodes:
        ep.info["rollout_s"] = elapsed
    return episodes


# --------------------------------------------------------------------------- training view
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
