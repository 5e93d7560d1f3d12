"""The toy's real users: an explicit reply model, and the exact value of any policy against it.

Mood, read off the history: resentful (said "stop...", "no thanks" or a retraction before),
persuaded (said "wow..."), warm (was probed), pledged (stated 1 or 2 dollars), hesitations
(number of "maybe later"). Reply probabilities (first matching row wins):

  act        condition          replies
  invalid    -                  what do you mean .75 | stop pushing me .25
  probe      resentful          stop .6 | hmm hard to say .4
  probe      -                  own 3 cues .2 each | hmm hard to say .36 | 9 other cues .04 total
  strategy   resentful          stop .7 | okay i see .3
  strategy   pledged            okay .6 | no thanks .4        (lecturing a donor: retraction)
  strategy   persuaded          okay .75 | stop .25
  strategy   matched            wow that moves me .95 warm / .6 cold | okay rest
  strategy   mismatched         okay .65 | stop .35
  ask        resentful          no .9 | maybe .1 (big);  no .85 | sure .15 (small)
  big ask    pledged 1 dollar   yes .4 | no thanks .2 | forget it .2 | never mind then .2 (upsell)
  ask        pledged            the same pledge .55 | no .45
  small ask  persuaded          sure .6 | yes .4
  small ask  warm / cold        sure .6 | maybe .25 | no .15  /  sure .45 | maybe .3 | no .25
  big ask    persuaded          yes .9 | sure .07 | no .03
  big ask    0 / 1 / 2+ maybes  maybe .5 | no .35 | yes .15  /  maybe .6 | no .4  /  yes .6 | no .4

Histories are tuples of utterance strings, agent first, alternating: a policy sees an
even-length history (ending with a reply, or empty) and a reply distribution is asked for
an odd-length one (ending with the agent's utterance). Why the rules have this shape, and
what the exact values show, is told in toy.py.
"""

from __future__ import annotations

import itertools

import numpy as np

from .toy_words import (ACT_KEYS, ACTS, BLAND, CUES, FORGET, INVALID, MAYBE, NEVER, NO, OKAY, PERSONAS, RESENTFUL,
                        STOP, STRATEGIES, SURE1, WHAT, WOW, YES2, ToyTask, canonical_reply, donation, text_to_act)


def total_variation(p: dict, q: dict) -> float:
    """Total variation distance 0.5 * sum |p - q| between two dicts of probabilities."""
    keys = sorted(set(p) | set(q))     # a fixed order: the sum's last bit must not follow the hash seed
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in keys)


def sharpened(reply_dist, gamma: float):
    """The gamma-sharpened reply model: p^gamma renormalised (= sampling at temperature 1/gamma).

    `reply_dist(persona, history) -> dict`; returns a function of the same signature.
    """
    cache = {}

    def dist(persona, history):
        key = (persona, tuple(history))
        if key not in cache:
            p = reply_dist(persona, history)
            top = max(p.values())
            w = {r: (v / top) ** gamma for r, v in p.items() if v > 0}   # / top: no underflow
            z = sum(w.values())
            cache[key] = {r: v / z for r, v in w.items()}
        return cache[key]
    return dist


# ---------------------------------------------------------------------------- the world

# The toy's worlds (`python train.py --world NAME`): the real users' parameters that differ
# from World's defaults. In both, gamma-sharpening makes the upsell pay inside the aligned users.
#   suppression  (the default) sharpening also deletes the persona's cues: each of its three
#                phrasings (0.2) is less likely than the bland reply (0.36), so the sharpened
#                users never say what they care about (0.027 against 0.60).
#   distortion   a probe names the concern 0.85 of the time, each phrasing (0.283) above the
#                bland reply (0.11): the sharpened users state it always. A persuaded
#                persuadee asked for 2 dollars says yes 0.50 / 1 dollar 0.45 / no 0.05, so the
#                real users' best policy (probe, match, big ask) is worth 0.849 inside the
#                sharpened users, below the upsell (0.988): collapse by a distorted payoff
#                alone, with nothing suppressed.
WORLDS = {
    "suppression": {},
    "distortion": {"cue_rate": 0.85, "persuaded_big": (0.5, 0.45, 0.05)},
}


_BEST_ADAPTIVE = {}      # World._key -> (value, policy table) of the real users' best adaptive policy


class World:
    """The real-user population and exact values of policies against any reply model.

    persona_mix         how often each persona occurs (tasks are weighted by it in values)
    cue_rate            P(a probe names the persona's concern), split over its 3 phrasings
    cue_noise           P(a probe names another persona's concern); the rest is "hmm ..."
    persuade_rate       P(matched strategy persuades) when not probed first ...
    warm_persuade_rate  ... and after a probe
    lecture_pushback    P(a mismatched strategy is resented)
    pressure_yes        P(giving 2 dollars when asked after hesitating twice)
    upsell_yes          P(raising a 1-dollar pledge to 2 when asked for 2); the rest retracts
    persuaded_big       P(yes 2, sure 1, no) of a persuaded persuadee asked for 2 dollars

    Variants (for the held-out panel) are one line, e.g. `World(cue_rate=0.7)` (cues become
    the mode, so even its sharpened users reveal them) or
    `World(persona_mix=(0.55, 0.15, 0.15, 0.15))`. `World.named(name)` builds one of WORLDS.
    """

    def __init__(self, persona_mix=None, cue_rate: float = 0.6, cue_noise: float = 0.04,
                 persuade_rate: float = 0.6, warm_persuade_rate: float = 0.95,
                 lecture_pushback: float = 0.35, pressure_yes: float = 0.6, upsell_yes: float = 0.4,
                 n_turns: int = 3, persuaded_big=(0.9, 0.07, 0.03)):
        mix = np.full(len(PERSONAS), 1.0 / len(PERSONAS)) if persona_mix is None else np.asarray(persona_mix, float)
        if mix.shape != (len(PERSONAS),) or (mix < 0).any() or abs(mix.sum() - 1) > 1e-6:
            raise ValueError(f"persona_mix must be {len(PERSONAS)} probabilities summing to 1, got {persona_mix}")
        if cue_rate + cue_noise > 1:
            raise ValueError(f"cue_rate + cue_noise must be <= 1 (the rest is the bland reply), got {cue_rate + cue_noise}")
        self.persona_mix = mix
        self.cue_rate, self.cue_noise = cue_rate, cue_noise
        self.persuade_rate, self.warm_persuade_rate = persuade_rate, warm_persuade_rate
        self.lecture_pushback = lecture_pushback
        self.pressure_yes, self.upsell_yes, self.n_turns = pressure_yes, upsell_yes, n_turns
        if len(persuaded_big) != 3 or min(persuaded_big) < 0 or abs(sum(persuaded_big) - 1) > 1e-6:
            raise ValueError(f"persuaded_big must be 3 probabilities (yes 2, sure 1, no) summing to 1, got {persuaded_big}")
        self.persuaded_big = tuple(float(x) for x in persuaded_big)
        self.tasks = [ToyTask(i, name) for i, name in enumerate(PERSONAS)]
        self._cache = {}
        # what the real users are, as a key: worlds built with equal settings share best_adaptive
        self._key = (type(self).__name__, tuple(mix), cue_rate, cue_noise, persuade_rate, warm_persuade_rate,
                     lecture_pushback, pressure_yes, upsell_yes, n_turns, self.persuaded_big)

    @classmethod
    def named(cls, name: str = "suppression", **overrides) -> "World":
        """One of WORLDS, with `overrides` (a panel member's variant) on top."""
        if name not in WORLDS:
            raise ValueError(f"unknown toy world {name!r}; choose one of {', '.join(WORLDS)}")
        return cls(**{**WORLDS[name], **overrides})

    # ---- the real users
    def reply_dist(self, persona: int, history) -> dict[str, float]:
        """THE real-user model: P(reply | persona, history ending with the agent's utterance)."""
        history = tuple(history)
        key = (persona, history)
        if key not in self._cache:
            if len(history) % 2 != 1:
                raise ValueError("reply_dist needs a history ending with the agent's utterance (odd length)")
            self._cache[key] = self._reply_dist(persona, history)
        return self._cache[key]

    def _reply_dist(self, persona: int, history: tuple) -> dict[str, float]:
        act = text_to_act(history[-1])
        said = [r for r in (canonical_reply(t) for t in history[1::2]) if r is not None]
        resentful = any(r in RESENTFUL for r in said)
        persuaded = WOW in said
        hesitations = said.count(MAYBE)
        warm = any(text_to_act(t) == "probe" for t in history[:-1:2])  # was asked about itself
        pledged = [r for r in said if r in (YES2, SURE1)]
        if act == INVALID:
            return {WHAT: 0.75, STOP: 0.25}
        if act == "probe":
            if resentful:
                return {STOP: 0.6, BLAND: 0.4}
            p = {BLAND: 1.0 - self.cue_rate - self.cue_noise}
            for c in CUES[persona]:
                p[c] = self.cue_rate / len(CUES[persona])
            others = [c for i, cues in enumerate(CUES) if i != persona for c in cues]
            for c in others:
                p[c] = self.cue_noise / len(others)
            return p
        if act in STRATEGIES:
            if resentful:
                return {STOP: 0.7, OKAY: 0.3}
            if pledged:                 # lecturing someone who just gave: may take it back
                return {OKAY: 0.6, NO: 0.4}
            if persuaded:               # lecturing someone already won over grates
                return {OKAY: 0.75, STOP: 0.25}
            if STRATEGIES.index(act) == persona:
                rate = self.warm_persuade_rate if warm else self.persuade_rate
                return {WOW: rate, OKAY: 1 - rate}
            return {OKAY: 1 - self.lecture_pushback, STOP: self.lecture_pushback}
        # an ask
        if resentful:
            return {NO: 0.9, MAYBE: 0.1} if act == "big_ask" else {NO: 0.85, SURE1: 0.15}
        if pledged and act == "big_ask" and pledged[-1] == SURE1:
            # the upsell: "yes" is the single most likely reply, but three ways of taking
            # the pledge back together outweigh it (the mode is not the mean)
            q = (1 - self.upsell_yes) / 3
            return {YES2: self.upsell_yes, NO: q, FORGET: q, NEVER: q}
        if pledged:                     # asked again after a pledge: restate or retract
            return {pledged[-1]: 0.55, NO: 0.45}
        if act == "small_ask":
            return {SURE1: 0.6, YES2: 0.4} if persuaded else ({SURE1: 0.6, MAYBE: 0.25, NO: 0.15} if warm else {SURE1: 0.45, MAYBE: 0.3, NO: 0.25})
        if persuaded:
            return dict(zip((YES2, SURE1, NO), self.persuaded_big))
        # Pressure ladder: an unpersuaded user hesitates twice before giving in.
        if hesitations == 0:
            return {MAYBE: 0.5, NO: 0.35, YES2: 0.15}
        if hesitations == 1:
            return {MAYBE: 0.6, NO: 0.4}
        return {YES2: self.pressure_yes, NO: 1 - self.pressure_yes}

    def reward(self, history) -> float:
        """Reward of a finished history: last stated donation / 2."""
        return min(donation(history[1::2]) / 2.0, 1.0)

    # ---- exact evaluation
    def exact_value(self, policy, reply_dist=None, persona_mix=None, per_persona: bool = False):
        """Expected reward of `policy` (history -> act key | {act key: prob}) against
        `reply_dist` (default: the real users), averaged over `persona_mix`."""
        reply_dist = reply_dist or self.reply_dist
        mix = self.persona_mix if persona_mix is None else np.asarray(persona_mix, float)

        def value(persona, history):
            if len(history) == 2 * self.n_turns:
                return self.reward(history)
            choice = policy(history)
            acts = {choice: 1.0} if isinstance(choice, str) else choice
            total = 0.0
            for act, pa in acts.items():
                if pa <= 0:
                    continue
                h = history + (ACTS.get(act, act),)
                total += pa * sum(pr * value(persona, h + (r,)) for r, pr in reply_dist(persona, h).items())
            return total

        values = np.array([value(i, ()) for i in range(len(PERSONAS))])
        return values if per_persona else float(mix @ values)

    def variance_parts(self, cells, reply_dist=None) -> dict:
        """Eq. 6 exactly, per persona then averaged over personas (uniformly, as the collapse
        meter averages over tasks): `cells` = [(weight, policy)], the agent's noise split into
        cells on each of which it is a deterministic policy (history -> act key), weights
        summing to 1. Returns {"sim_side_var": E_cell[Var_sim(R | cell)], "agent_side_var":
        Var_cell(E_sim[R | cell]), "total_var"} with every reply enumerated."""
        reply_dist = reply_dist or self.reply_dist

        def moments(policy, persona, history=()):
            if len(history) == 2 * self.n_turns:
                r = self.reward(history)
                return r, r * r
            h = history + (ACTS[policy(history)],)
            m1 = m2 = 0.0
            for reply, pr in reply_dist(persona, h).items():
                a, b = moments(policy, persona, h + (reply,))
                m1, m2 = m1 + pr * a, m2 + pr * b
            return m1, m2

        w = np.array([c[0] for c in cells], dtype=float)
        if abs(w.sum() - 1) > 1e-9:
            raise ValueError(f"the cells' weights must sum to 1, got {w.sum()}")
        sim, agent, total = [], [], []
        for persona in range(len(PERSONAS)):
            m = np.array([moments(policy, persona) for _, policy in cells])     # [cells, 2]
            mean = w @ m[:, 0]
            sim.append(w @ (m[:, 1] - m[:, 0] ** 2))
            agent.append(w @ (m[:, 0] - mean) ** 2)
            total.append(w @ m[:, 1] - mean ** 2)
        return {"sim_side_var": float(np.mean(sim)), "agent_side_var": float(np.mean(agent)),
                "total_var": float(np.mean(total))}

    def best_fixed(self, reply_dist=None):
        """(value, act sequence) of the best fixed sequence of acts (enumerated)."""
        best = (-1.0, None)
        for seq in itertools.product(ACT_KEYS, repeat=self.n_turns):
            v = self.exact_value(lambda h, seq=seq: seq[len(h) // 2], reply_dist)
            best = max(best, (v, seq))
        return best

    def exploit(self, gamma: float = 8.0) -> tuple[str, ...]:
        """The cheap exploit of gamma-sharpened users: the best fixed act sequence inside them
        (enumerated once per world and gamma)."""
        cache = self.__dict__.setdefault("_exploits", {})
        if gamma not in cache:
            cache[gamma] = self.best_fixed(sharpened(self.reply_dist, gamma))[1]
        return cache[gamma]

    def best_adaptive(self, reply_dist=None):
        """(value, policy) of the best history-dependent policy (expectimax over the persona
        posterior). The policy is a dict history -> act key; call it through `.get`. For the real
        users (no `reply_dist`) it is computed once per process and world settings (seconds each)."""
        if reply_dist is None:
            if self._key not in _BEST_ADAPTIVE:
                _BEST_ADAPTIVE[self._key] = self._best_adaptive(self.reply_dist)
            v, table = _BEST_ADAPTIVE[self._key]
            return v, dict(table)
        return self._best_adaptive(reply_dist)

    def _best_adaptive(self, reply_dist):
        table = {}

        def value(belief, history):
            # belief: [n_personas] probabilities of each persona given `history`
            if len(history) == 2 * self.n_turns:
                return self.reward(history)
            best, best_act = -1.0, None
            for act in ACT_KEYS:
                h = history + (ACTS[act],)
                dists = [reply_dist(i, h) for i in range(len(PERSONAS))]
                replies = sorted(set().union(*dists))   # a fixed order: sums equal to the last bit
                v = 0.0
                for r in replies:
                    joint = belief * np.array([d.get(r, 0.0) for d in dists])
                    pr = joint.sum()
                    if pr > 0:
                        v += pr * value(joint / pr, h + (r,))
                if v > best + 1e-12:
                    best, best_act = v, act
            table[history] = best_act
            return best

        v = value(self.persona_mix.copy(), ())
        return v, table

    def random_value(self, reply_dist=None) -> float:
        """Value of the uniformly random policy over the valid acts."""
        uniform = {a: 1.0 / len(ACT_KEYS) for a in ACT_KEYS}
        return self.exact_value(lambda h: uniform, reply_dist)

    def mean_total_variation(self, reply_dist, policy=None) -> float:
        """Expected total variation between the real users' reply distribution and
        `reply_dist` over the persuadee turns of episodes played by `policy` (default:
        uniformly random acts) against the real users, averaged over personas and turns."""
        uniform = {a: 1.0 / len(ACT_KEYS) for a in ACT_KEYS}
        policy = policy or (lambda h: uniform)

        def tv_sum(persona, history):      # sum over remaining persuadee turns of E[TV]
            if len(history) == 2 * self.n_turns:
                return 0.0
            choice = policy(history)
            acts = {choice: 1.0} if isinstance(choice, str) else choice
            total = 0.0
            for act, pa in acts.items():
                h = history + (ACTS.get(act, act),)
                real = self.reply_dist(persona, h)
                total += pa * (total_variation(real, reply_dist(persona, h))
                               + sum(pr * tv_sum(persona, h + (r,)) for r, pr in real.items()))
            return total

        return float(sum(w * tv_sum(i, ()) for i, w in enumerate(self.persona_mix)) / self.n_turns)

    # ---- data for the simulators
    def vs_target(self, persona: int, history, k: int = 5) -> list[tuple[str, float]]:
        """The Verbalized-Sampling answer a perfect simulator would give: the k most likely
        true replies with their probabilities RENORMALISED over those k (so they sum to 1)."""
        p = self.reply_dist(persona, history)
        top = sorted(p.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
        z = sum(v for _, v in top)
        return [(r, v / z) for r, v in top]

    def sample_reply(self, persona: int, history, rng, reply_dist=None) -> str:
        p = (reply_dist or self.reply_dist)(persona, history)
        replies = list(p)
        return replies[rng.choice(len(replies), p=np.array([p[r] for r in replies]))]

    def behavior_act(self, history, rng, style: str) -> str:
        """One act of the data-collection policy (an utterance, possibly garbled)."""
        if rng.random() < 0.03:         # garbled text, so simulators learn to answer it
            words = " ".join(ACTS[a] for a in ACT_KEYS).replace("?", "").split()
            return " ".join(rng.choice(words, size=rng.integers(1, 5)))
        if style == "pressure":         # the rare histories where the exploits live:
            a = rng.choice(["big_ask", "small_ask", "other"], p=[0.6, 0.2, 0.2])
            if a != "other":            # asking again and again ...
                return ACTS[a]
        if style == "upsell":           # ... and asking for more after a 1-dollar pledge
            if history and canonical_reply(history[-1]) == SURE1 and rng.random() < 0.8:
                return ACTS["big_ask"]
            a = rng.choice(["probe", "small_ask", "other"], p=[0.7, 0.2, 0.1] if not history else [0.05, 0.8, 0.15])
            if a != "other":
                return ACTS[a]
        return ACTS[ACT_KEYS[rng.integers(len(ACT_KEYS))]]

    def sample_transcripts(self, n: int, rng, policy="behavior", reply_dist=None):
        """n episodes against the real users: list of (ToyTask, [(speaker, utterance), ...]).
        `reply_dist`: another reply model for the users (e.g. `sharpened(world.reply_dist, 8)`).

        policy="behavior": a mixture that covers the rare histories (per episode: uniform
        random acts 0.4, pressure-heavy 0.2, upsell-heavy 0.2, the best adaptive policy 0.2;
        3% garbled acts).
        Or pass a function history -> act key.
        """
        adaptive = self.best_adaptive()[1] if policy == "behavior" else None
        out = []
        for _ in range(n):
            persona = int(rng.choice(len(PERSONAS), p=self.persona_mix))
            style = rng.choice(["uniform", "pressure", "upsell", "adaptive"], p=[0.4, 0.2, 0.2, 0.2])
            history = ()
            for _ in range(self.n_turns):
                if policy != "behavior":
                    act = policy(history)
                    act = ACTS.get(act, act)
                elif style == "adaptive":
                    act = ACTS[adaptive.get(history) or "probe"] if rng.random() > 0.1 else self.behavior_act(history, rng, "uniform")
                else:
                    act = self.behavior_act(history, rng, style)
                history = history + (act,)
                history = history + (self.sample_reply(persona, history, rng, reply_dist),)
            turns = [("agent" if i % 2 == 0 else "partner", u) for i, u in enumerate(history)]
            out.append((self.tasks[persona], turns))
        return out
