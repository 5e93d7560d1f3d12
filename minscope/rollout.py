"""The multi-turn, two-party rollout: who speaks when, and how an LM party takes its turn.

An *agent* (the policy) and a *partner* (a user simulator, or a second agent) take turns
(`rollout`). Each party sees the conversation through its own view and keeps, per episode, a
token stream of exactly the ids it was fed and the ids it sampled (minscope/stream.py).

Every live conversation's next turn is generated in ONE batched call per party (`LMSpeaker`;
left padding, KV cache: minscope/sampling.py). A party's stream must hold exactly what its
cache was fed, so the speaker extends each stream with the chat-template text that is new to
it, samples from the part its cache does not hold yet, and appends the sampled ids as sampled.
"""

from __future__ import annotations

import contextlib
import time

import torch

from .chat import chat_format, strip_reasoning
from .compute import parameter_count
from .envs.base import Episode, Turn, turn_noise
from .kvcache import KVCache, party_cache, session
from .adapters import use_adapter
from .readout import DECISION_TOKENS, amount_tokens, expected_amount, read_tokens
from .sampling import eos_token_ids, sample, tail_logits
from .stream import Stream, ids_text, text_ids, view_messages, with_system_suffix


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
