"""User simulators: every way the paper lets a simulator take part in training.

All of them are *speakers*: `respond(episodes, env) -> [Turn]` produces the partner's next
turn for a batch of conversations, and `assign(episodes)` (called once per rollout) says
which simulator serves each episode. The rollout engine and the trainer only see that.

    Frozen           one fixed LM (+ adapter + prompt)                 RL (Single)
    Verbalized       a frozen LM asked for k replies with probabilities; one is drawn
    Ensemble         K frozen simulators rotated across groups and rollouts
    PersonaGuided    a frozen LM conditioned on a persona drawn per rollout
    Trainable        a LoRA adapter trained on its own turns            Co-Training
    Population       a FIFO pool of the trainable adapter's snapshots  Population Co-Training

A mode-collapsed ("aligned") simulator is an LM sampled with its logits multiplied by
gamma > 1, i.e. temperature 1/gamma (the paper's P^gamma model of alignment).
"""

from __future__ import annotations

import copy
import random
from collections import deque

from .envs.base import Turn
from .adapters import adapter_nbytes, adapter_state, has_adapter, load_adapter_state
from .rollout import LMSpeaker
from . import verbalized


class Frozen(LMSpeaker):
    """A fixed simulator: an LM (optionally through an adapter) at a fixed temperature."""

    def __init__(self, model, tokenizer, adapter=None, temperature: float = 1.0,
                 max_new_tokens: int = 64, name: str = "frozen", system_suffix=""):
        super().__init__(model, tokenizer, "partner", adapter, temperature, max_new_tokens, name,
                         system_suffix)


class Verbalized:
    """Verbalized Sampling around a frozen simulator.

    The simulator's system prompt gets an instruction asking for `k` candidate replies with
    probabilities as JSON; the reply that enters the conversation is drawn from the parsed
    candidates (`weighted` by the renormalised probabilities, or `uniform`). Rows whose
    output cannot be parsed are regenerated up to `retries` times, then fall back to the
    raw text. `stats` counts parse failures, retries, fallbacks and the drawn entropy.
    """

    def __init__(self, base: LMSpeaker, k: int = 5, mode: str = "weighted", retries: int = 2,
                 seed: int = 0, max_new_tokens: int | None = None, name: str | None = None):
        budget, label = max_new_tokens or base.max_new_tokens * (k + 1), name or f"vs({base.name})"
        if getattr(base, "served", False):   # an endpoint: the VS request goes through it
            self.speaker = base.derive(max_new_tokens=budget, name=label, system_suffix=verbalized.vs_instruction(k))
        else:
            self.speaker = LMSpeaker(base.model, base.tokenizer, "partner", base.adapter, base.temperature,
                                     budget, label, verbalized.vs_instruction(k))
        self.name, self.k, self.mode, self.retries = self.speaker.name, k, mode, retries
        self.base = base
        self.rng = random.Random(seed)
        self.stats = verbalized.VSStats()

    def assign(self, episodes):
        self.speaker.assign(episodes)

    def read_amount(self, episodes, env, *question, decide: bool = False):
        """A readout (`LMSpeaker.read_amount`) is the simulator's own judgement: it reads the
        base simulator, without the VS instruction."""
        if not hasattr(self.base, "read_amount"):
            raise ValueError(f"{self.base.name}'s next-token probabilities cannot be read (a served simulator)")
        return self.base.read_amount(episodes, env, *question, decide=decide)

    def respond(self, episodes, env):
        replies: list[Turn | None] = [None] * len(episodes)
        todo = list(range(len(episodes)))
        raw = {}
        for attempt in range(self.retries + 1):
            if not todo:
                break
            if attempt:
                for i in todo:   # regenerate from the same history: drop the failed attempt's
                    # stream; the next call re-tokenizes the whole prompt (VS streams are
                    # rewritten every turn anyway, and a VS simulator is never trained on them)
                    episodes[i].info.get("streams", {}).pop("partner", None)
            texts, ids, _ = self.speaker.generate([episodes[i] for i in todo], env)
            failed = []
            for i, text, tok in zip(todo, texts, ids):
                reply, cands, dist = verbalized.pick(text, self.rng, self.mode, self.stats, attempt)
                raw[i] = text
                if reply is None:
                    failed.append(i)
                else:
                    replies[i] = Turn("partner", reply, token_ids=tok,
                                      meta={"vs_candidates": [(c.text, c.probability) for c in cands],
                                            "vs_dist": dist})
            todo = failed
        for i in todo:
            replies[i] = Turn("partner", verbalized.fallback(raw[i], self.stats), meta={"vs_fallback": True})
        return replies


class Ensemble:
    """K frozen simulators rotated across rollout groups and across rollouts.

    Each rollout (one `assign` call) draws an offset o from `rng`; group g is served by
    member (o + g) mod K. Within a rollout the members share the groups as evenly as
    possible; across rollouts every group slot meets every member, so a task that sits in
    the same slot at every step (the toy cycles its personas that way) still meets all K
    simulators. A fixed `g mod K` would pin such a task to one simulator for the whole run.
    `rng` is saved with the run's state and put back after evaluations, like the draws of
    the other speakers, so resumed runs and evaluations do not change the rotation.
    """

    def __init__(self, members: list, name: str = "ensemble", seed: int = 0):
        if not members:
            raise ValueError("an Ensemble needs at least one simulator")
        self.members, self.name, self.rng = members, name, random.Random(seed)

    def assign(self, episodes):
        offset = self.rng.randrange(len(self.members))
        for ep in episodes:
            ep.partner_name = self.members[(offset + ep.group) % len(self.members)].name

    def read_amount(self, episodes, env, *question, decide: bool = False):
        """A readout (`LMSpeaker.read_amount`) of each episode by the member that played it."""
        out: list = [None] * len(episodes)
        for member in self.members:
            idx = [i for i, ep in enumerate(episodes) if ep.partner_name == member.name]
            if idx:
                if not hasattr(member, "read_amount"):
                    raise ValueError(f"{member.name}'s next-token probabilities cannot be read (a served simulator)")
                for i, p in zip(idx, member.read_amount([episodes[i] for i in idx], env, *question, decide=decide)):
                    out[i] = p
        return out

    def respond(self, episodes, env):
        out: list[Turn | None] = [None] * len(episodes)
        for member in self.members:
            idx = [i for i, ep in enumerate(episodes) if ep.partner_name == member.name]
            if idx:
                for i, turn in zip(idx, member.respond([episodes[i] for i in idx], env)):
                    out[i] = turn
        return out


class PersonaGuided(LMSpeaker):
    """A frozen simulator told to play a persona drawn per rollout group from a bank."""

    def __init__(self, model, tokenizer, personas: list[str], adapter=None, temperature=1.0,
                 max_new_tokens=64, seed: int = 0, name: str = "persona"):
        super().__init__(model, tokenizer, "partner", adapter, temperature, max_new_tokens, name,
                         system_suffix=lambda ep: "Play this person:\n" + ep.info["persona"])
        if not personas:
            raise ValueError("PersonaGuided needs a non-empty persona bank from the environment")
        self.personas, self.rng = personas, random.Random(seed)

    def assign(self, episodes):
        drawn = {}
        for ep in episodes:
            if ep.group not in drawn:
                drawn[ep.group] = self.rng.choice(self.personas)
            ep.info["persona"] = drawn[ep.group]
            ep.partner_name = self.name


class Trainable(LMSpeaker):
    """The Co-Training simulator: adapter `adapter` on `model`, trained on its own turns
    with the simulator reward `reward` (adversarial | cooperative | curriculum | shared)."""

    def __init__(self, model, tokenizer, adapter: str = "simulator", reward: str = "adversarial",
                 temperature: float = 1.0, max_new_tokens: int = 64, name: str = "cotrain"):
        super().__init__(model, tokenizer, "partner", adapter, temperature, max_new_tokens, name)
        self.reward, self.trainable_adapter = reward, adapter


POOL_DRAWS = ("uniform", "hardest")


class Population(Trainable):
    """Population Co-Training: a FIFO pool of the last K snapshots of the trainable adapter.

    Each rollout group draws its simulator from the pool (one batch serves all members at
    once through per-row adapters). The trainable adapter keeps learning between snapshots;
    `snapshot()` is called every `every` policy steps. Snapshots are LoRA state dicts on the
    shared base, loaded into K adapter slots `pool0..pool{K-1}`.

    draw: "uniform" (the paper) or "hardest", a pool curator (the paper's future work): a
    member is drawn with weight (1 - r)^2 + 0.01, where r is the policy's recent reward
    against it (an average over its last groups, `observe`, halving the weight of older
    ones; rewards read in [0, 1]). A snapshot not yet met counts as r = 0, so it is tried
    soon. The policy then trains most against the members it does worst against, the ones
    whose replies it has not learned to exploit (the squared weight is the "hard" form of
    prioritised self-play; 0.01 keeps every member in play).
    """

    def __init__(self, model, tokenizer, adapter: str = "simulator", reward: str = "adversarial",
                 size: int = 5, every: int = 4, temperature: float = 1.0, max_new_tokens: int = 64,
                 seed: int = 0, name: str = "population", draw: str = "uniform"):
        super().__init__(model, tokenizer, adapter, reward, temperature, max_new_tokens, name)
        if draw not in POOL_DRAWS:
            raise ValueError(f"unknown pool draw {draw!r}; use {' or '.join(POOL_DRAWS)}")
        self.size, self.every, self.rng, self.draw = size, every, random.Random(seed), draw
        self.scores: dict[int, float] = {}         # snapshot step -> the policy's recent reward
        self.pool: deque = deque(maxlen=size)      # (step, state dict), oldest first
        self.slots = [f"pool{i}" for i in range(size)]
        for slot in self.slots:   # same LoRA layout as the trained adapter, so snapshots fit
            if not has_adapter(model, slot):
                model.add_adapter(slot, copy.deepcopy(model.peft_config[adapter]))
        self.adapter = lambda ep: ep.partner_name

    def snapshot(self, step: int):
        """Push the trainable adapter's weights into the pool (dropping the oldest)."""
        self.pool.append((step, adapter_state(self.model, self.trainable_adapter)))
        for slot, (_, state) in zip(self.slots, self.pool):
            load_adapter_state(self.model, slot, state)

    def played_by(self, episodes) -> list[int]:
        """The snapshot (the step it was taken at) that played each of `episodes`, as the pool
        stands now (call it before the next snapshot moves the slots)."""
        step_of = {slot: step for slot, (step, _) in zip(self.slots, self.pool)}
        return [step_of[ep.partner_name] for ep in episodes]

    def pool_nbytes(self) -> int:
        return sum(adapter_nbytes(s) for _, s in self.pool)

    def weights(self) -> list[float]:
        """Each member's draw weight (pool order): all 1 for "uniform"."""
        if self.draw == "uniform":
            return [1.0] * len(self.pool)
        return [(1.0 - min(max(self.scores.get(step, 0.0), 0.0), 1.0)) ** 2 + 0.01 for step, _ in self.pool]

    def assign(self, episodes):
        if not self.pool:
            self.snapshot(0)
        drawn, n, weights = {}, len(self.pool), self.weights()
        for ep in episodes:
            if ep.group not in drawn:
                i = self.rng.randrange(n) if self.draw == "uniform" else self.rng.choices(range(n), weights)[0]
                drawn[ep.group] = self.slots[i]
            ep.partner_name = drawn[ep.group]

    def observe(self, episodes):
        """Record the policy's reward against each member that served `episodes` (the curator's
        input; every draw keeps the record, so the log shows what the policy meets)."""
        step_of = {slot: step for slot, (step, _) in zip(self.slots, self.pool)}
        rewards: dict[int, list] = {}
        for ep in episodes:
            if ep.partner_name in step_of:
                rewards.setdefault(step_of[ep.partner_name], []).append(float(ep.reward))
        for step, rs in rewards.items():
            r = sum(rs) / len(rs)
            self.scores[step] = r if step not in self.scores else 0.5 * self.scores[step] + 0.5 * r
        live = {step for step, _ in self.pool}
        self.scores = {s: v for s, v in self.scores.items() if s in live}

    def state(self):
        return {"pool": list(self.pool), "rng": self.rng.getstate(), "scores": dict(self.scores)}

    def load_state(self, state):
        self.pool = deque(state["pool"], maxlen=self.size)
        self.rng.setstate(state["rng"])
        self.scores = dict(state.get("scores", {}))
        for slot, (_, s) in zip(self.slots, self.pool):
            load_adapter_state(self.model, slot, s)
