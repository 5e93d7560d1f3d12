"""The rollout engine: views, streams, masks, batching, stopping."""
import pytest
import torch

from minscope.adapters import add_adapters
from minscope.batch import training_batch
from minscope.envs.base import Environment, Episode, Step, Turn
from minscope.rollout import LMSpeaker, rollout
from minscope.sampling import sample
from minscope.stream import view_messages


class Chat(Environment):
    """Agent opens; strict alternation for `max_turns`; one task ends after two turns."""
    max_turns = 4

    def tasks(self, split="train"):
        return ["long", "short"]

    def agent_messages(self, task):
        return [{"role": "system", "content": "you are the agent"}]

    def partner_messages(self, task):
        return [{"role": "system", "content": "you are the user"}]

    def after_turn(self, episode):
        if episode.task == "short" and len(episode.turns) >= 2:
            return Step(None)
        return super().after_turn(episode)

    def score(self, episode):
        return float(len(episode.turns)), {}


def test_views_flip_roles_and_hide_env_turns_from_partner():
    ep = Episode(task="t", group=0, turns=[Turn("agent", "hi"), Turn("partner", "yo"),
                                           Turn("agent", "<tool_call>x</tool_call>", public=False),
                                           Turn("env", "result")])
    env = Chat()
    agent = view_messages(env, ep, "agent")
    partner = view_messages(env, ep, "partner")
    assert [m["role"] for m in agent] == ["system", "assistant", "user", "assistant", "tool"]
    assert [m["role"] for m in partner] == ["system", "user", "assistant"]
    assert partner[0]["content"] == "you are the user"


@pytest.fixture
def speakers(tiny_model, tokenizer):
    model = add_adapters(tiny_model, ["policy", "simulator"], init_lora_weights=False)
    agent = LMSpeaker(model, tokenizer, "agent", adapter="policy", max_new_tokens=5)
    partner = LMSpeaker(model, tokenizer, "partner", adapter="simulator", max_new_tokens=5)
    return agent, partner


def test_rollout_alternates_and_ends_conversations_independently(speakers):
    torch.manual_seed(0)
    episodes = rollout(Chat(), Chat().tasks(), *speakers, group_size=3)
    assert [ep.group for ep in episodes] == [0, 0, 0, 1, 1, 1]
    for ep in episodes:
        roles = [t.role for t in ep.turns]
        want = 4 if ep.task == "long" else 2
        assert roles == ["agent", "partner", "agent", "partner"][:want]
        assert ep.reward == want and ep.done


def test_streams_hold_exact_sampled_ids_with_complementary_masks(speakers, tokenizer):
    torch.manual_seed(1)
    episodes = rollout(Chat(), ["long"], *speakers, group_size=2)
    for ep in episodes:
        agent, partner = ep.info["streams"]["agent"], ep.info["streams"]["partner"]
        sampled_a = [i for i, m in zip(agent.ids, agent.mask) if m]
        sampled_p = [i for i, m in zip(partner.ids, partner.mask) if m]
        # each party's mask covers exactly its own sampled tokens, in order
        assert sampled_a == sum((t.token_ids for t in ep.turns if t.role == "agent"), [])
        assert sampled_p == sum((t.token_ids for t in ep.turns if t.role == "partner"), [])
        # the stream spells the chat-template rendering of the conversation
        assert tokenizer.decode(agent.ids) == agent.text
        assert agent.exact and partner.exact


def test_training_batch_shifts_mask_to_targets(speakers, tokenizer):
    torch.manual_seed(2)
    episodes = rollout(Chat(), ["short"], *speakers, group_size=2)
    batch = training_batch(episodes, "agent", tokenizer.pad_token_id)
    stream = episodes[0].info["streams"]["agent"]
    n = len(stream.ids)
    assert batch.loss_mask[0, :n - 1].tolist() == [float(m) for m in stream.mask[1:]]
    assert batch.loss_mask.shape == (2, batch.input_ids.shape[1] - 1)
    assert batch.old_logp[0][batch.loss_mask[0].bool()].lt(0).all()


def test_batched_greedy_generation_equals_unbatched(tiny_model, tokenizer):
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15]]
    eos = {tokenizer.eos_token_id}
    batched, _ = sample(tiny_model, prompts, tokenizer.pad_token_id, eos, 6, temperature=0)
    for p, got in zip(prompts, batched):
        alone, _ = sample(tiny_model, [p], tokenizer.pad_token_id, eos, 6, temperature=0)
        assert alone[0] == got


def test_generation_stops_at_eos_and_respects_token_cap(tiny_model, tokenizer):
    logits_bias = torch.zeros(len(tokenizer))
    logits_bias[tokenizer.eos_token_id] = 100.0
    head = tiny_model.get_output_embeddings()
    hook = head.register_forward_hook(lambda m, i, o: o + logits_bias)
    try:
        ids, _ = sample(tiny_model, [[5, 6]], tokenizer.pad_token_id, {tokenizer.eos_token_id}, 9, temperature=1.0)
    finally:
        hook.remove()
    assert ids == [[tokenizer.eos_token_id]]
    ids, logp = sample(tiny_model, [[5, 6]], tokenizer.pad_token_id, {-1}, 7, temperature=1.0)
    assert len(ids[0]) == 7 and len(logp[0]) == 7


def test_population_rows_use_their_own_adapter_in_one_batch(tiny_model, tokenizer):
    model = add_adapters(tiny_model, ["one", "two"], init_lora_weights=False)
    prompts = [[5, 6, 7], [5, 6, 7]]
    eos = {tokenizer.eos_token_id}
    mixed, _ = sample(model, prompts, tokenizer.pad_token_id, eos, 5, 0, adapter_names=["one", "two"])
    from minscope.adapters import use_adapter
    for row, name in enumerate(["one", "two"]):
        with use_adapter(model, name):
            alone, _ = sample(model, [prompts[row]], tokenizer.pad_token_id, eos, 5, 0)
        assert alone[0] == mixed[row]
