"""The tiny language models of the toy experiment, trained offline and cached.

    tokenizer      byte-level BPE trained on the game's strings + the VS instruction
    policy base    a tiny LM behaviour-cloned on the persuader side of transcripts
                   (a mediocre, history-aware starting policy; RL adds a LoRA "policy")
    simulators     tiny LMs SFT'd on the persuadee side of real-user transcripts, each on
                   its own variant of the world, and also taught to answer a Verbalized
                   Sampling request with the top-5 replies and their true probabilities.
                   "seen" ones are used in training (sim-a is the RL (Single) simulator,
                   sim-a..c the ensemble), "unseen" ones only in evaluation.

Everything is cached under `cache_dir/<hash of the settings>/` in Hugging Face format, so
the second run starts training at once.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from .envs.toy import ToyEnv, World
from .models import build_tiny_model, build_tokenizer
from .sft import sft
from .verbalized import Candidate, format_candidates, vs_instruction

# name -> (panel kind, World overrides). Members differ in their *modes*, not just seeds:
# an ensemble of copies of one model shares its mode and its exploit.
SIMULATORS = {
    "sim-a": ("seen", {}),
    "sim-b": ("seen", {"cue_rate": 0.75}),
    "sim-c": ("seen", {"pressure_yes": 0.45}),
    "sim-d": ("unseen", {"persona_mix": (0.4, 0.3, 0.2, 0.1)}),
    "sim-e": ("unseen", {"cue_rate": 0.5, "lecture_pushback": 0.25}),
    "sim-f": ("unseen", {"persuade_rate": 0.5, "pressure_yes": 0.5}),
}


@dataclass
class ToyModelConfig:
    arch: str = "llama"
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    vocab: int = 640
    transcripts: int = 3000     # real-user transcripts per simulator
    vs_examples: int = 1500     # VS requests per simulator
    sft_steps: int = 500
    batch: int = 32
    lr: float = 3e-3
    seed: int = 0

    def key(self) -> str:
        return hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]


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


def toy_tokenizer(env: ToyEnv):
    examples = [format_candidates([Candidate(r, 0.2) for r in env.corpus()[i:i + 5]]) for i in range(0, 40, 5)]
    return build_tokenizer(env.corpus() * 3 + [vs_instruction(5)] * 3 + examples * 3, vocab_size=ToyModelConfig.vocab)


class ToyModels:
    """Loads the tokenizer, policy base and simulators from the cache, training what is missing."""

    def __init__(self, cache_dir, cfg: ToyModelConfig | None = None, progress: bool = True, log=print):
        self.cfg = cfg or ToyModelConfig()
        self.dir = Path(cache_dir) / f"toy-{self.cfg.key()}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.progress, self.log = progress, log
        self.env = ToyEnv()
        self.tokenizer = self._tokenizer()

    def _tokenizer(self):
        from transformers import PreTrainedTokenizerFast

        path = self.dir / "tokenizer"
        if path.exists():
            tok = PreTrainedTokenizerFast.from_pretrained(str(path))
            tok.padding_side = "left"
            return tok
        tok = toy_tokenizer(self.env)
        tok.save_pretrained(str(path))
        return tok

    def _model(self, name: str, conversations_fn, seed: int):
        from transformers import AutoModelForCausalLM

        path = self.dir / name
        if (path / "config.json").exists():
            return AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager").float().eval()
        c = self.cfg
        model = build_tiny_model(self.tokenizer, c.arch, c.hidden, c.layers, c.heads, seed=seed)
        losses = sft(model, self.tokenizer, conversations_fn(), steps=c.sft_steps, batch_size=c.batch,
                     lr=c.lr, seed=seed, desc=f"sft {name}", progress=self.progress)
        self.log(f"  trained {name}: SFT loss {losses[0]:.2f} -> {np.mean(losses[-20:]):.3f}")
        model.save_pretrained(str(path))
        return model.eval()

    def policy_base(self):
        """The policy's starting point: behaviour cloning of the persuader side."""
        def data():
            rng = np.random.default_rng(self.cfg.seed + 100)
            return self.env.sft_conversations(World().sample_transcripts(self.cfg.transcripts, rng), role="agent")
        return self._model("policy-base", data, self.cfg.seed + 100)

    def simulator(self, name: str):
        """(model, kind, world) for one simulator of SIMULATORS."""
        kind, overrides = SIMULATORS[name]
        world = World(**overrides)
        env = ToyEnv(world)
        i = list(SIMULATORS).index(name)

        def data():
            rng = np.random.default_rng(self.cfg.seed + i)
            transcripts = world.sample_transcripts(self.cfg.transcripts, rng)
            return (env.sft_conversations(transcripts, role="partner")
                    + vs_conversations(env, world, transcripts, self.cfg.vs_examples, rng))
        return self._model(name, data, self.cfg.seed + i), kind, world

    def all(self):
        torch.set_num_threads(max(1, torch.get_num_threads()))
        base = self.policy_base()
        sims = {name: self.simulator(name) for name in SIMULATORS}
        return base, sims
