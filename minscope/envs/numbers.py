"""Say a number greater than 50: the smallest task a real pretrained model learns on a CPU.

A scripted asker (the environment's own partner, `Asker`) makes one request, the agent
answers once, and the reward is 1 when the first number in the answer is above the
threshold, else 0 (no number: 0). SmolLM2-135M-Instruct, asked this way, answers with a
number above 50 about one time in ten; GRPO with a LoRA adapter raises that to 0.7-0.97
within 4 updates on a CPU (docs/REAL_MODELS.md, "A real model learns"). It is the real-model
learning check of `tests/test_learning_smollm2.py` and `python train.py --env numbers
--policy smollm2`.

What the policy learns is also instructive: it learns to open with digits, and, trained
long enough, to write long digit strings. The checker stays satisfied while the text
degenerates: a reward that reads one feature of the text is optimised through that feature.
"""

from __future__ import annotations

import re

from .base import Environment, Turn

# The requests: the training split and a held-out one worded differently.
TRAIN_REQUESTS = ("Say a number greater than 50.", "Name a number above 50.",
                  "Give me a number bigger than 50.", "Pick a number that is more than 50.")
TEST_REQUESTS = ("Tell me a number larger than 50.", "Write down a number over 50.")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def first_number(text: str) -> float | None:
    """The first number written with digits in `text` ("1,000" reads as 1), or None."""
    m = NUMBER.search(text)
    return float(m.group()) if m else None


class Numbers(Environment):
    name = "numbers"
    partner_name = "asker"
    max_turns = 2

    def __init__(self, threshold: float = 50):
        self.threshold = threshold

    def tasks(self, split: str = "train"):
        return list(TEST_REQUESTS if split == "test" else TRAIN_REQUESTS)

    def partner_messages(self, task):
        return [{"role": "system", "content": f"Ask for this: {task}"}]

    def first_speaker(self, task):
        return "partner"

    def scripted_partner(self):
        """The environment's own partner: train.py uses it instead of a simulator LM."""
        return Asker()

    def score(self, episode):
        answers = episode.texts("agent")
        number = first_number(answers[-1]) if answers else None
        return float(number is not None and number > self.threshold), {"number": number}

    def reward_note(self, episode):
        answers = episode.texts("agent")
        number = first_number(answers[-1]) if answers else None
        if number is None:
            return "reward 0: the answer writes no number in digits"
        verdict = "above" if number > self.threshold else "not above"
        return f"the checker reads the first number, {number:g}, {verdict} {self.threshold:g}"


class Asker:
    """The scripted partner: makes the episode's request, word for word."""
    name = "asker"

    def assign(self, episodes):
        for ep in episodes:
            ep.partner_name = self.name

    def respond(self, episodes, env):
        return [Turn("partner", ep.task) for ep in episodes]
