"""The tiny language models of the toy experiment, trained offline and cached.

    tokenizer      byte-level BPE trained on the game's strings + the VS instruction
    policy base    a tiny LM behaviour-cloned on a decent but imperfect persuader (60% of
                   its acts from the best adaptive policy, except that it asks for 1 dollar
                   when the probe reveals nothing; the rest random, half of them asks; RL adds
                   a LoRA "policy" adapter on top)
    simulators     tiny LMs SFT'd on the persuadee side of real-user transcripts, each on
                   its own variant of the world. sim-a is the simulator RL (Single) and
                   Co-Training train against; "seen" ones are used in training (sim-a..c form
                   the ensemble), "unseen" ones only in evaluation.
    sim-a-vs       sim-a's world again, also taught to answer a Verbalized Sampling request
                   with the top-5 replies and their true probabilities; the VS arm asks it.
                   (One 64-wide model holding both answer modes got the order of its plain
                   replies wrong where the exploit lives: measured, the exploit was worth 0.11
                   inside it at gamma 8 instead of about 0.9, exact. Two models of the same data keep the
                   comparison fair: both are sim-a's world, sharpened the same way.)

How well a simulator is learned matters more than anything else here (sharpening by
gamma = 8 magnifies every error in the order of its replies): `toy_fidelity.fidelity()` measures the
total variation between a simulator and its world at the histories that decide the
exploit, and the exploit's value inside the sharpened simulator against the exact one.

Everything is cached under `cache_dir/<hash of the settings>/` in Hugging Face format, so
the second run starts training at once. The default settings' models also ship with the
code (`SHIPPED`, about 6 MB: nine 64-wide models and two tokenizers), so that a first run
after a clone starts training at once too: they are copied into the cache when their
settings' hash matches (any change to the settings or to the toy's texts changes the hash,
and the models are trained as before). `python -m minscope.toy_models --rebuild` trains them
anew from the default settings, checks them with the same fidelity gate a run applies, and
replaces the shipped files only if they pass; `--check` applies the gate to the shipped ones.

One file, though long: the tiny models' settings hash, their training data and the cache
that stores them must change together (a new setting is a new hash).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from .armpool import default_workers, worker_init
from .envs.toy import ToyEnv
from .envs.toy_words import ACT_KEYS, ACTS, BLAND, REPLIES, canonical_reply
from .envs.toy_world import World, sharpened
from .models import build_tiny_model, build_tokenizer
from .precision import to_float64
from .sft import sft
from .toy_fidelity import fidelity_gate
from .verbalized import format_candidates, vs_instruction
from .verbalized_parse import Candidate

# name -> (panel kind, World overrides). Members differ in their *modes*, not just seeds:
# an ensemble of copies of one model shares its mode and its exploit.
SIMULATORS = {
    "sim-a": ("seen", {}),
    "sim-b": ("seen", {"cue_rate": 0.75}),
    "sim-c": ("seen", {"pressure_yes": 0.45, "upsell_yes": 0.2}),
    "sim-d": ("unseen", {"persona_mix": (0.4, 0.3, 0.2, 0.1)}),
    "sim-e": ("unseen", {"cue_rate": 0.5, "lecture_pushback": 0.25}),
    "sim-f": ("unseen", {"persuade_rate": 0.5, "pressure_yes": 0.5}),
    "sim-a-vs": ("vs", {}),
}


# What a world needs on top of the default settings for its tiny simulators to pass the
# fidelity gate, chosen on the models alone before any arm ran (docs/RESULTS.md). The
# distortion world's exploit runs through histories that hold one persona's own cue phrasing
# (each about 28% of that persona's probe replies), where the default world's runs through the
# bland reply every persona gives, so sim-a sees each of them far less often: with the default
# settings the upsell was worth 0.703 inside it (exact 0.988; the gate asks 0.790), with 3000
# SFT steps 0.734, with 6000 transcripts and 3000 steps 0.859.
WORLD_MODELS = {"distortion": {"transcripts": 6000, "sim_a_steps": 3000}}


@dataclass
class ToyModelConfig:
    arch: str = "llama"
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    vocab: int = 640
    transcripts: int = 3000     # real-user transcripts per simulator
    vs_examples: int = 1500     # VS requests (sim-a-vs only)
    sim_a_steps: int = 1500     # SFT steps of sim-a (the training simulator)
    vs_steps: int = 1800        # SFT steps of sim-a-vs (plain + VS answers)
    sim_steps: int = 800        # SFT steps of the other simulators (ensemble and panel)
    policy_steps: int = 600     # SFT steps of the policy base
    policy_skill: float = 0.6   # share of the policy base's acts copied from the best adaptive policy
    policy_asks: float = 0.5    # share of its other (random) acts that are asks (2/7 would be uniform)
    policy_blind: str = "small_ask"  # its skilled act when a probe reveals nothing ("": the best adaptive one)
    # The aligned simulator *model* that Co-Training and Population Co-Training start from:
    # SFT'd on transcripts of the gamma-sharpened users, so that its own distribution at
    # temperature 1 is theirs (its collapse lives in its weights, as in an RLHF'd LLM).
    aligned_gamma: float = 8.0
    aligned_steps: int = 800
    batch: int = 32
    lr: float = 3e-3
    seed: int = 0
    workers: int = 0            # processes that train models in parallel (1 thread each; 0: one per core)
    attention: str = "sdpa"     # attention implementation ("eager" rounds differently: a new cache)
    world: int = 3              # version of the toy world's dynamics: bump it when they change
    world_name: str = "suppression"   # which of envs.toy_world.WORLDS the models learn (train.py --world)

    def key(self) -> str:
        """The cache folder's name: a hash of everything the simulators depend on (these
        settings, and every text they and the tokenizer learn; `world` versions the rest)."""
        fields = {k: v for k, v in asdict(self).items()     # (their names carry the rest)
                  if not k.startswith(("policy_", "aligned_")) and k != "workers"}
        if self.world_name == "suppression":      # the default world: the shipped models' hash
            del fields["world_name"]
        fields["texts"] = texts_fingerprint()
        fields["arithmetic"] = "float64"          # how the models are trained (precision.py)
        return hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:10]

    def for_world(self, name: str) -> "ToyModelConfig":
        """These settings for world `name` (`python train.py --world NAME`), with what that
        world's simulators need to pass the fidelity gate (`WORLD_MODELS`)."""
        return replace(self, world_name=name, **WORLD_MODELS.get(name, {}))

    def policy_name(self) -> str:
        blind = f"-blind-{self.policy_blind}" if self.policy_blind else ""
        return f"policy-base-skill{self.policy_skill:g}-asks{self.policy_asks:g}-steps{self.policy_steps}{blind}"

    def aligned_name(self, gamma: float | None = None) -> str:
        g = self.aligned_gamma if gamma is None else gamma
        return f"sim-a-aligned-g{g:g}-steps{self.aligned_steps}"


def vs_conversations(env: ToyEnv, world: World, transcripts, n: int, rng, k: int = 5):
    """VS requests at random simulator turns: the answer is the top-k true replies as JSON."""
    out = []
    for idx in rng.integers(len(transcripts), size=n):
        task, turns = transcripts[idx]
        j = 2 * int(rng.integers(len(turns) // 2)) + 1          # a partner turn
        history = tuple(u for _, u in turns[:j])
        system = env.partner_messages(task)[0]["content"] + "\n\n" + vs_instruction(k)
        msgs = [{"role": "system", "content": system}]
        msgs += [{"role": "assistant" if s == "partner" else "user", "content": u, "train": False}
                 for s, u in turns[:j]]
        target = world.vs_target(task.persona, history, k)
        msgs.append({"role": "assistant", "content": format_candidates([Candidate(t, p) for t, p in target])})
        out.append(msgs)
    return out


def texts_fingerprint() -> str:
    """A hash of the toy's texts: its utterances, prompts, the VS instruction and answer format."""
    env = ToyEnv()
    task = env.tasks()[0]
    texts = env.corpus() + [vs_instruction(5), format_candidates([Candidate("x", 0.5)]),
                            env.agent_messages(task)[0]["content"], env.partner_messages(task)[0]["content"]]
    return hashlib.sha1("\n".join(texts).encode()).hexdigest()[:10]


def toy_tokenizer(env: ToyEnv, vocab: int = ToyModelConfig.vocab):
    examples = [format_candidates([Candidate(r, 0.2) for r in env.corpus()[i:i + 5]]) for i in range(0, 40, 5)]
    return build_tokenizer(env.corpus() * 3 + [vs_instruction(5)] * 3 + examples * 3, vocab_size=vocab)


def with_utterance_tokens(tokenizer):
    """The policy's tokenizer: the simulators' BPE plus one token per act and per reply.

    Policy and simulators talk in text, so they need not share a tokenizer (in the paper
    they are different model families). A 64-wide policy that spells its acts word by word
    learns to write near-misses ("would you give dollar?", "what to you?") that the tiny
    LM simulators mistake for acts while real users do not understand them; the policy then
    optimises against that hole instead of the users (it did, in VS runs, measured). With one
    token per act it says an act, or visibly garbles it."""
    tokenizer.add_tokens(sorted(set(ACTS.values()) | set(REPLIES)))
    return tokenizer


def base_persuader(c: ToyModelConfig, world: World, rng):
    """The persuader the policy base is cloned from: history -> act key.

    For a share `policy_skill` of its acts it does what the best adaptive policy would, and
    otherwise acts at random, asking for money half the time (`policy_asks`). At skill 0.2
    the 64-wide base did not learn to condition on the probe's cues (even after 1,500 SFT
    steps) and no RL arm discovered that later (oracle 0.36 on real users, measured); at 0.6
    it does, and the arms start from a policy that a collapsed simulator can make worse and a
    faithful one better.
    `policy_blind`: when the probe reveals nothing the best adaptive policy guesses a strategy
    (worth 0.392 there); asking for 1 dollar is worth 0.386. The base asks, so the upsell is
    one act away for every arm (a sharpened simulator never reveals anything). Guessing, one
    RL (Single) seed in three stayed on the guess: from "probe, strategy, small ask" the
    upsell is two acts away, across a valley.
    """
    table = world.best_adaptive()[1]
    others = [a for a in ACT_KEYS if not a.endswith("_ask")]

    def persuader(history):
        if rng.random() < c.policy_skill:
            if c.policy_blind and len(history) == 2 and canonical_reply(history[1]) == BLAND:
                return c.policy_blind
            return table.get(history, "probe")
        if rng.random() < c.policy_asks:
            return ("small_ask", "big_ask")[rng.integers(2)]
        return others[rng.integers(len(others))]
    return persuader


# the default settings' models, shipped with the code (see the module docstring)
SHIPPED = Path(__file__).parent / "toy_weights"


def seed_cache(folder: Path, shipped: Path = SHIPPED) -> list[str]:
    """Copy into the cache folder `folder` (cache_dir/toy-<key>) every entry that ships for the
    same key and is not cached yet; returns their names. Each entry is copied to a temporary
    name, then renamed into place, so an interrupted copy never looks cached."""
    source = shipped / folder.name
    copied = []
    if source.is_dir():
        for entry in sorted(source.iterdir()):
            if entry.is_dir() and not (folder / entry.name).exists():
                tmp = folder / f".{entry.name}.tmp-{os.getpid()}"
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.copytree(entry, tmp)
                try:
                    os.replace(tmp, folder / entry.name)
                    copied.append(entry.name)
                except OSError:      # another process put it there first
                    shutil.rmtree(tmp, ignore_errors=True)
    return copied


class ToyModels:
    """Loads the tokenizer, policy base and simulators from the cache, training what is missing."""

    def __init__(self, cache_dir, cfg: ToyModelConfig | None = None, progress: bool = True, log=print,
                 shipped: Path | None = SHIPPED):
        self.cfg = cfg or ToyModelConfig()
        self.dir = Path(cache_dir) / f"toy-{self.cfg.key()}"
        self.dir.mkdir(parents=True, exist_ok=True)
        if shipped is not None:
            seed_cache(self.dir, shipped)
        self.progress, self.log = progress, log
        self.env = ToyEnv(self.world())
        self.tokenizer = self._tokenizer("tokenizer")                  # the simulators'
        self.policy_tokenizer = self._tokenizer("policy-tokenizer")    # + utterance tokens

    def _tokenizer(self, name: str):
        from transformers import PreTrainedTokenizerFast

        path = self.dir / name
        if path.exists():
            try:
                tok = PreTrainedTokenizerFast.from_pretrained(str(path))
                tok.padding_side = "left"
                return tok
            except Exception as e:   # noqa: BLE001 - a damaged entry of any kind is rebuilt
                self.log(f"the cached tokenizer {path} does not load ({type(e).__name__}); rebuilding it")
        tok = toy_tokenizer(self.env, self.cfg.vocab) if name == "tokenizer" else with_utterance_tokens(self._tokenizer("tokenizer"))
        self._save(name, tok.save_pretrained)
        return tok

    def _save(self, name: str, save) -> None:
        """Write a cache entry into a temporary folder, then rename it into place: a run
        killed while writing leaves no half-written entry that looks cached."""
        tmp = self.dir / f".{name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        save(str(tmp))
        shutil.rmtree(self.dir / name, ignore_errors=True)      # a damaged entry being replaced
        try:
            os.replace(tmp, self.dir / name)
        except OSError:          # another process put a good entry there first: keep that one
            shutil.rmtree(tmp, ignore_errors=True)

    def _load(self, name: str):
        """The cached model, or None when it is not cached or does not load (a damaged
        entry, e.g. a file deleted by hand: it is rebuilt, with one line saying so)."""
        from transformers import AutoModelForCausalLM

        path = self.dir / name
        if not path.exists():
            return None
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation=self.cfg.attention)
        except Exception as e:   # noqa: BLE001 - OSError, JSON, safetensors errors: rebuild all alike
            self.log(f"the cached model {path} does not load ({type(e).__name__}: {str(e)[:120]}); rebuilding it")
            return None
        return to_float64(model).eval()      # float64: minscope/precision.py

    def world(self, **overrides) -> World:
        """The real users of this config's world (`world_name`), with a panel member's overrides."""
        return World.named(self.cfg.world_name, **overrides)

    def names(self):
        # the longest job first, so that two workers finish at about the same time
        return (["sim-a-vs", self.cfg.policy_name(), self.cfg.aligned_name()]
                + [n for n in SIMULATORS if n != "sim-a-vs"])

    def train(self, name: str) -> str:
        """Train one model and save it; returns a log line. Runs in a worker process."""
        c = self.cfg
        is_policy, aligned = name == c.policy_name(), name.startswith("sim-a-aligned-g")
        seed = c.seed + (100 if is_policy else 200 if aligned else list(SIMULATORS).index(name))
        rng = np.random.default_rng(seed)
        if aligned:      # sim-a's world, its users gamma-sharpened in the data itself
            gamma = float(name[len("sim-a-aligned-g"):].split("-steps")[0])
            world, steps = self.world(), c.aligned_steps
            transcripts = world.sample_transcripts(c.transcripts, rng, reply_dist=sharpened(world.reply_dist, gamma))
            conversations = self.env.sft_conversations(transcripts, role="partner")
        elif is_policy:
            world, steps = self.world(), c.policy_steps
            persuader = base_persuader(c, world, rng)
            transcripts = world.sample_transcripts(c.transcripts, rng, policy=persuader)
            conversations = self.env.sft_conversations(transcripts, role="agent")
        else:
            world = self.world(**SIMULATORS[name][1])
            env = ToyEnv(world)
            transcripts = world.sample_transcripts(c.transcripts, rng)
            conversations = env.sft_conversations(transcripts, role="partner")
            steps = {"sim-a": c.sim_a_steps, "sim-a-vs": c.vs_steps}.get(name, c.sim_steps)
            if name == "sim-a-vs":
                conversations += vs_conversations(env, world, transcripts, c.vs_examples, rng)
        tok = self.policy_tokenizer if is_policy else self.tokenizer
        # SFT in float64, rounded to float32 after every step (minscope/precision.py): the same
        # weights on every CPU; stored as float32, which loses nothing
        model = build_tiny_model(tok, c.arch, c.hidden, c.layers, c.heads, seed=seed, attention=c.attention,
                                 float64=True)
        losses = sft(model, tok, conversations, steps=steps, batch_size=c.batch, lr=c.lr,
                     seed=seed, desc=f"sft {name}", progress=self.progress)
        self._save(name, lambda path: model.float().save_pretrained(path))
        return f"  trained {name}: SFT loss {losses[0]:.2f} -> {np.mean(losses[-20:]):.3f} ({steps} steps)"

    def build(self):
        """Train every model that is not cached yet (in `cfg.workers` processes)."""
        if getattr(self, "_built", False):      # checked once per ToyModels: loads are not free
            return
        missing = [n for n in self.names() if self._load(n) is None]
        self._built = not missing
        if not missing:
            return
        self.log(f"training {len(missing)} tiny models (cached in {self.dir}; later runs skip this) ...")
        workers = self.cfg.workers or default_workers(len(missing))
        if workers <= 1:
            for name in missing:
                self.log(self.train(name))
            return
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"),
                                 initializer=worker_init) as pool:
            for line in pool.map(_train_one, [(str(self.dir.parent), self.cfg, n) for n in missing]):
                self.log(line)

    def get(self, name: str):
        """One model (a name of SIMULATORS, or `cfg.policy_name()`), trained now if it is not
        cached, without building the others (the notebook uses this)."""
        if self._load(name) is None:
            self.log(self.train(name))
        return self._load(name)

    def aligned(self, gamma: float | None = None):
        """The aligned simulator model for `gamma` (default `cfg.aligned_gamma`; others are
        trained on first use, e.g. by the gamma ablation), and its world (sim-a's)."""
        name = self.cfg.aligned_name(gamma)
        if name in self.names():
            self.build()
        return self.get(name), self.world()

    def policy_base(self):
        self.build()
        return self._load(self.cfg.policy_name())

    def simulator(self, name: str):
        """(model, kind, world) for one simulator of SIMULATORS."""
        self.build()
        kind, overrides = SIMULATORS[name]
        return self._load(name), kind, self.world(**overrides)

    def all(self):
        self.build()
        return self.policy_base(), {name: self.simulator(name) for name in SIMULATORS}


def _train_one(args):
    cache_dir, cfg, name = args
    return ToyModels(cache_dir, cfg, progress=False, log=lambda *a: None).train(name)


# --------------------------------------------------------------------------- shipped models
def rebuild(cfg: ToyModelConfig | None = None, shipped: Path = SHIPPED, log=print) -> list[str]:
    """Train every model of `cfg` (default: the default settings) from scratch in a fresh
    folder, apply the fidelity gate, and only if it passes make them the shipped models
    (`shipped/toy-<key>`, replacing any other key's). Returns the gate's problems (empty:
    shipped)."""
    import tempfile

    cfg = cfg or ToyModelConfig()
    with tempfile.TemporaryDirectory() as tmp:
        models = ToyModels(tmp, cfg, progress=False, log=log, shipped=None)
        models.build()
        fid, problems = fidelity_gate(models)
        log(f"fidelity: exploit inside sim-a {fid['exploit_lm']:.3f} (exact {fid['exploit_exact']:.3f}), "
            f"sim-a-vs TV {fid['vs_tv']:.3f}, aligned exploit {fid['aligned']['exploit_lm']:.3f} "
            f"(exact {fid['aligned']['exploit_exact']:.3f})")
        if problems:
            for p in problems:
                log(f"the fidelity gate fails: {p}; the shipped models are left as they were")
            return problems
        shipped.mkdir(parents=True, exist_ok=True)
        target = shipped / models.dir.name
        staging = shipped / f".{models.dir.name}.new"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(models.dir, staging, ignore=shutil.ignore_patterns(".*"))
        for old in shipped.iterdir():
            if old.is_dir() and old.name.startswith("toy-"):
                shutil.rmtree(old)
        os.replace(staging, target)
        log(f"shipped: {target} ({sum(f.stat().st_size for f in target.rglob('*') if f.is_file()) / 2**20:.1f} MB)")
    return []


def main(argv=None):
    """python -m minscope.toy_models --rebuild | --check"""
    import argparse
    import sys

    from .models import quiet

    quiet()
    p = argparse.ArgumentParser(prog="python -m minscope.toy_models",
                                description="The toy's shipped tiny models (minscope/toy_weights).")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--rebuild", action="store_true", help="train them anew from the default settings "
                   "(~15 CPU-minutes), and ship them if they pass the fidelity gate")
    g.add_argument("--check", action="store_true", help="apply the fidelity gate to the shipped models")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.rebuild:
        sys.exit(1 if rebuild() else 0)
    import tempfile

    key = f"toy-{ToyModelConfig().key()}"
    if not (SHIPPED / key).is_dir():
        sys.exit(f"no shipped models for the default settings ({SHIPPED / key}): run --rebuild")
    with tempfile.TemporaryDirectory() as tmp:
        models = ToyModels(tmp, progress=False)
        fid, problems = fidelity_gate(models)
    print(json.dumps(fid, indent=1))
    for problem in problems:
        print(f"the fidelity gate fails: {problem}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
