"""The toy experiment's set-up: its settings (`ToyConfig`) and everything the arms of one run
share (`Toy`: the tiny models, the environment, the evaluation panel), and how each arm's
method is built from them. `experiment` trains and evaluates the arms.
"""

from __future__ import annotations

import copy
import random
import re
from dataclasses import dataclass, field

import numpy as np

from .envs.toy import RealUsers, ToyEnv
from .envs.toy_world import World
from .diversity import member_profile
from .evaluate import isolated_rng
from .methods import Method, build_method
from .adapters import add_adapters
from .monitor import MonitorConfig
from .rollout import LMSpeaker
from .sft import AnchorBatches, encode_chat
from .simulators import Frozen
from .toy_models import ToyModelConfig, ToyModels
from .trainer import UpdateConfig

TOY_METHODS = ("base", "single", "vs", "ensemble", "cotrain", "population", "oracle")
# what may follow the colon of an ablation arm, joined by "+" (see Toy.method)
TOY_VARIANTS = ("adversarial", "cooperative", "curriculum", "anchor", "hardest", "uniform", "group", "batch",
                "g<gamma>")


def is_toy_variant(tweak: str) -> bool:
    """One tweak of an ablation arm: a name of TOY_VARIANTS, or g<gamma> (e.g. g2: the trained
    simulator starts from the aligned model of gamma 2)."""
    return tweak in TOY_VARIANTS[:-1] or bool(re.fullmatch(r"g\d+(\.\d+)?", tweak))


@dataclass
class ToyConfig:
    """Settings of the toy experiment (defaults: the headline run, 21 arms: 13 min cold on 2
    free cores; docs/RESULTS.md, "Runtime of the current code")."""
    name: str = "toy"
    methods: tuple = TOY_METHODS          # "base" = the untrained policy, evaluated only
    seeds: tuple = (0, 1, 2)
    # Co-Training variants (see Toy.method), run for `ablation_seeds` only; none by default (the
    # headline does not need them, and the 3-seed comparison of the variants is
    # bench/studies/cotrain_search.py): e.g. ("cotrain:curriculum", "population:curriculum", "population:hardest")
    ablations: tuple = ()
    ablation_seeds: tuple = (0,)
    steps: int = 50                       # policy updates per arm
    groups: int = 8                       # rollout groups per step (tasks = personas, cycled)
    group_size: int = 8                   # G trajectories per group
    gamma: float = 8.0                    # sharpening of the "aligned" simulators
    policy_lr: float = 2e-3
    sim_lr: float = 1e-3
    lora_r: int = 16
    eps_low: float = 0.2
    eps_high: float = 0.28
    beta: float = 0.04                    # KL to the untrained policy: keeps utterances well-formed
    epochs: int = 2
    # the trained simulator's reward: the paper's for P4G, which the toy stands in for (the
    # best of four Population variants on the search seeds 100-102: bench/studies/cotrain_search.py,
    # docs/ARCHIVE.md "Population Co-Training: the search")
    sim_reward: str = "adversarial"
    # The trained simulator's optimiser (Co-Training, Population Co-Training): the paper's, which
    # trains every model with a KL of 0.005 to its start and weight decay 0.1, one pass per batch
    # (its on-policy REINFORCE). Its learning rate is the toy's own (LoRA on 64-wide models).
    sim_beta: float = 0.005               # KL to the simulator's start
    sim_weight_decay: float = 0.1         # AdamW weight decay
    sim_epochs: int = 1                   # passes per batch
    # What Co-Training and Population Co-Training start from: "aligned" = the aligned simulator
    # model (toy_models: SFT'd on sharpened users, models.aligned_gamma), sampled at the
    # rollout temperature like the paper's; "sharpened" = a copy of sim-a sampled at 1/gamma
    # (the earlier design: a near-greedy sampler that RL barely moves)
    sim_start: str = "aligned"
    sim_baseline: str = "auto"            # group-wise, batch-wide for curriculum (methods.resolve_sim_baseline)
    pool_size: int = 5
    pool_every: int = 4                   # a snapshot (and a pool-diversity measurement) every k steps
    pool_draw: str = "uniform"            # how groups draw from the pool: uniform (the paper) or
                                          # hardest (the pool curator, simulators.Population)
    # pool-diversity measurements every k steps and at the last one (0: at every snapshot, as
    # above); the default is the evaluations' cadence. Fewer measurements cost less and leave
    # training and every evaluation as they are; a Population's members are then profiled at a
    # later step, on other random draws.
    pool_measure_every: int = 10
    diversity_samples: int = 32           # replies per persona and history in pool_diversity
    diversity_episodes: int = 64          # episodes per exploit value in a member's profile
    vs_k: int = 5
    eval_every: int = 10
    eval_episodes: int = 8                # per persona per panel member (real users: x4)
    final_episodes: int = 256             # per persona, real users, last step: the headline number
                                          # (1,024 episodes: standard error ~0.013; ~5 s per arm)
    # The paper evaluates at temperature 0. A 64-wide policy's greedy decode can splice two
    # acts into one invalid utterance (it did, for 2 of 6 runs at the last step, while its
    # samples were valid), so the toy evaluates the policy it trains: sampling at temperature 1.
    eval_temperature: float = 1.0
    meter_every: int = 30                 # collapse meter cadence (0 = off)
    temperature: float = 1.0              # policy sampling temperature in training
    policy_max_new_tokens: int = 6        # an act is one token + end of turn; room to garble
    workers: int = 0                      # arms trained in parallel processes (0: one per available
                                          # core, at most one per arm; armpool.default_workers)
    models: ToyModelConfig = field(default_factory=ToyModelConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)   # the live collapse monitor

    @property
    def world(self) -> str:
        """Which of envs.toy_world.WORLDS the real users (and every simulator trained on them) are:
        `models.world_name`, set by `python train.py --world NAME`."""
        return self.models.world_name

    def arms(self) -> list[tuple[str, int]]:
        """(method, seed) of every arm: the methods x seeds, then the ablations."""
        return ([(m, s) for m in self.methods for s in self.seeds]
                + [(m, s) for m in self.ablations for s in self.ablation_seeds])

    @classmethod
    def quick(cls, **kw):
        """--quick: the same code path, smaller everything (552 CPU-seconds cold; docs/RESULTS.md, "Run times and sizes")."""
        base = dict(name="toy-quick", methods=("base", "single", "vs", "oracle"), seeds=(0,), steps=12, ablations=(),
                    groups=4, eval_every=6, eval_episodes=4, final_episodes=64, meter_every=0,
                    models=ToyModelConfig(transcripts=1000, vs_examples=400, sim_a_steps=200, vs_steps=220,
                                          sim_steps=150, policy_steps=100, aligned_steps=150, batch=32))
        base.update(kw)
        return cls(**base)


def load_config(path) -> ToyConfig:
    """The ToyConfig saved in a run's config.json, or one message naming the file."""
    from .files import RunFileError, read_json

    saved = read_json(path)
    for key in ("format", "format_covers"):      # the run folder's format (runfolder.check_format)
        saved.pop(key, None)
    try:
        models = ToyModelConfig(**saved.pop("models"))
        monitor = MonitorConfig(**saved.pop("monitor", {}))
        return ToyConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()},
                         models=models, monitor=monitor)
    except (KeyError, TypeError) as e:
        raise RunFileError(f"{path} is not the config.json of a toy run ({e})") from None


def reference_values(gamma: float, world: str = "suppression") -> dict:
    """Exact values on the real users that every report shows (see minscope.envs.toy_world)."""
    from .envs.toy_world import sharpened

    world = World.named(world)
    seq = world.exploit(gamma)            # the cheap exploit of collapsed simulators
    exploit = lambda history: seq[len(history) // 2]   # noqa: E731
    return {"random": world.random_value(), "best_fixed": world.best_fixed()[0],
            "best_adaptive": world.best_adaptive()[0], "exploit": list(seq),
            "exploit_real": world.exact_value(exploit),
            "exploit_sharpened": world.exact_value(exploit, reply_dist=sharpened(world.reply_dist, gamma))}


# --------------------------------------------------------------------------- set-up
class Toy:
    """Everything shared by the arms of one run: models, environment, evaluation panel."""

    def __init__(self, cfg: ToyConfig, cache_dir, log=print, progress=True):
        self.cfg, self.log = cfg, log
        self.models = ToyModels(cache_dir, cfg.models, progress=progress, log=log)
        self.tokenizer = self.models.tokenizer
        self.world = World.named(cfg.world)           # the real users' world, sim-a's too
        self.env = ToyEnv(self.world)
        self.base_model, self.sims = self.models.all()
        t = 1.0 / cfg.gamma
        self.frozen = {name: Frozen(model, self.tokenizer, temperature=t, max_new_tokens=12, name=name)
                       for name, (model, kind, world) in self.sims.items()}
        self.vs_simulator = self.frozen.pop("sim-a-vs")

    def sim_a_profile(self) -> dict:
        """sim-a as the frozen arms meet it (temperature 1/gamma), profiled for pool_diversity
        once per process, on a stream of its own."""
        if not hasattr(self, "_sim_a_profile"):
            with isolated_rng(4242):
                self._sim_a_profile = member_profile(self.frozen["sim-a"], self.world, self.cfg.gamma,
                                                     self.cfg.diversity_samples, self.cfg.diversity_episodes)
        return self._sim_a_profile

    def panel(self, seed: int):
        # the evaluation's real users draw from a stream apart from the oracle arm's training
        # users (RealUsers(seed)); `seed` differs per evaluation (see _eval_record)
        p = {"real_users": (RealUsers(self.world, seed=10_000 + seed), "real")}
        for name, (_, kind, _) in self.sims.items():
            if kind in ("seen", "unseen"):
                p[name] = (self.frozen[name], kind)
        return p

    def policy(self):
        # tiny models learn far faster when the LoRA also adapts the LM head
        model = add_adapters(copy.deepcopy(self.base_model), ["policy"], r=self.cfg.lora_r,
                             alpha=2 * self.cfg.lora_r, target_modules="all-linear+head")
        return LMSpeaker(model, self.models.policy_tokenizer, "agent", adapter="policy",
                         temperature=self.cfg.temperature, max_new_tokens=self.cfg.policy_max_new_tokens,
                         name="policy")

    def anchor_batches(self, seed: int, batch: int = 32):
        """Real-user transcripts (persuadee side) for the realism anchor, as SFT batches
        (freshly sampled: a stream of their own, apart from the simulators' SFT data)."""
        rng = np.random.default_rng(seed + 777)
        convs = self.env.sft_conversations(World.named(self.cfg.world).sample_transcripts(2000, rng), role="partner")
        encoded = [encode_chat(self.tokenizer, c) for c in convs]
        return AnchorBatches(encoded, batch, self.tokenizer.pad_token_id, random.Random(seed))

    def method(self, name: str, seed: int) -> Method:
        """Build an arm. Variants after a colon tweak the simulator objective, e.g.
        "cotrain:adversarial", "population:anchor", "cotrain:adversarial+batch" (batch baseline)."""
        c = self.cfg
        name, _, variant = name.partition(":")
        tweaks = set(filter(None, variant.split("+")))
        sim_reward = next((t for t in tweaks if t in ("adversarial", "cooperative", "curriculum")), c.sim_reward)
        sim_baseline = next((t for t in tweaks if t in ("group", "batch")), c.sim_baseline)
        gamma = next((float(t[1:]) for t in tweaks if re.fullmatch(r"g\d+(\.\d+)?", t)), c.models.aligned_gamma)
        pcfg = UpdateConfig(lr=c.policy_lr, eps_low=c.eps_low, eps_high=c.eps_high, beta=c.beta,
                            epochs=c.epochs, temperature=c.temperature, weight_decay=0.0)
        scfg = UpdateConfig(lr=c.sim_lr, eps_low=c.eps_low, eps_high=c.eps_high, epochs=c.sim_epochs,
                            temperature=c.temperature if c.sim_start == "aligned" else 1.0 / c.gamma,
                            weight_decay=c.sim_weight_decay, beta=c.sim_beta)
        seen = [n for n, (_, kind, _) in self.sims.items() if kind == "seen"]
        frozen = [self.frozen[seen[0]]] if name != "ensemble" else [self.frozen[n] for n in seen]
        if name == "vs":
            frozen = [self.vs_simulator]
        sim_model, sim_temperature = None, None
        if name in ("cotrain", "population"):
            if c.sim_start == "aligned":    # the aligned model, sampled at the rollout temperature
                start, sim_temperature = self.models.aligned(gamma)[0], c.temperature
            elif c.sim_start == "sharpened":
                start = self.sims[seen[0]][0]   # sim-a, sampled at 1/gamma like the frozen arms
            else:
                raise ValueError(f"sim_start {c.sim_start!r}: use 'aligned' or 'sharpened'")
            sim_model = add_adapters(copy.deepcopy(start), ["simulator"], r=c.lora_r,
                                     alpha=2 * c.lora_r, target_modules="all-linear+head")
        m = build_method(
            "single" if name == "base" else name, self.policy(), frozen, pcfg, scfg,
            sim_model=sim_model, sim_tokenizer=self.tokenizer, sim_reward=sim_reward,
            vs_k=c.vs_k, pool_size=c.pool_size, pool_every=c.pool_every,
            oracle=RealUsers(World.named(c.world), seed=seed), seed=seed, sim_baseline=sim_baseline, sim_temperature=sim_temperature,
            pool_draw=next((t for t in tweaks if t in ("hardest", "uniform")), c.pool_draw))
        if "anchor" in tweaks and m.trains_simulator:
            m.anchor = self.anchor_batches(seed)
        return m
