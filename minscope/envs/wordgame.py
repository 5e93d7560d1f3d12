"""A two-turn word game: the smallest environment that exercises the whole loop.

The partner asks for one word ("say river"), the agent answers, and the reward is 1 when
the answer is that word. A tiny policy first SFT'd to say *some* word at random starts at
about 1 / len(WORDS) and learns the task with GRPO in well under a CPU-minute: it is the
end-to-end learning check of the foundations.
"""

from __future__ import annotations

from .base import Environment, Turn

WORDS = ("apple", "river", "stone", "cloud")


class WordGame(Environment):
    name = "wordgame"
    partner_name = "asker"
    max_turns = 2

    def __init__(self, words=WORDS):
        self.words = list(words)

    def tasks(self, split: str = "train"):
        return list(self.words)

    def agent_messages(self, task):
        return [{"role": "system", "content": "answer with one word"}]

    def partner_messages(self, task):
        return [{"role": "system", "content": f"ask for the word {task}"}]

    def first_speaker(self, task):
        return "partner"

    def scripted_partner(self):
        return Asker()

    def score(self, episode):
        answer = episode.texts("agent")[-1].strip() if episode.texts("agent") else ""
        return float(answer == episode.task), {"answer": answer}

    def corpus(self):
        """Text for training a tokenizer that covers the game."""
        return [f"say {w}" for w in self.words] * 4 + list(self.words) * 4 + ["answer with one word", "ask for the word"]

    def sft_conversations(self):
        """Random answers: a policy that knows the words but not the game."""
        return [[{"role": "system", "content": "answer with one word"},
                 {"role": "user", "content": f"say {asked}"},
                 {"role": "assistant", "content": said}]
                for asked in self.words for said in self.words]


class Asker:
    """The scripted partner: asks for the episode's word."""
    name = "asker"

    def assign(self, episodes):
        for ep in episodes:
            ep.partner_name = self.name

    def respond(self, episodes, env):
        return [Turn("partner", f"say {ep.task}") for ep in episodes]
