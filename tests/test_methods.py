"""The SCOPE methods: every simulator strategy, the shared training step, the collapse meter."""

import numpy as np
import pytest
import torch

from minscope.adapters import adapter_state, add_adapters
from minscope.envs.base import Episode, Turn, turn_noise
from minscope.envs.toy import RealUsers, SharpenedUsers, ToyEnv
from minscope.envs.toy_words import ACTS
from minscope.envs.wordgame import Asker, WordGame
from minscope.evaluate import collapse_meter, open_loop_meter
from minscope.methods import METHODS, build_method, train_step
from minscope.models import build_tiny_model
from minscope.rollout import LMSpeaker, rollout
from minscope.simulators import Ensemble, Frozen, PersonaGuided, Population, Verbalized
from minscope.trainer import UpdateConfig
from minscope.verbalized import format_candidates
from minscope.verbalized_parse import Candidate


@pytest.fixture
def parts(tokenizer):
    torch.manual_seed(0)
    policy_model = add_adapters(build_tiny_model(tokenizer, "qwen3", hidden_size=32), ["policy"],
                                init_lora_weights=False)
    sim_model = add_adapters(build_tiny_model(tokenizer, "qwen3", hidden_size=32, seed=1), ["simulator"],
                             init_lora_weights=False)
    policy = LMSpeaker(policy_model, tokenizer, "agent", adapter="policy", max_new_tokens=3)
    frozen = [Frozen(build_tiny_model(tokenizer, "llama", hidden_size=32, seed=s), tokenizer,
                     max_new_tokens=3, name=f"sim{s}") for s in range(3)]
    return policy, frozen, sim_model


class Scripted:
    """A stand-in generator returning canned texts, to test the VS wrapper's logic."""
    def __init__(self, outputs):
        self.outputs, self.calls = list(outputs), 0

    def __call__(self, episodes, env):
        self.calls += 1
        out = [self.outputs.pop(0) for _ in episodes]
        return out, [[1]] * len(episodes), [[0.0]] * len(episodes)


def test_verbalized_draws_one_candidate_and_only_it_enters_the_conversation(parts):
    vs = Verbalized(parts[1][0], k=2, seed=0)
    vs.speaker.generate = Scripted([format_candidates([Candidate("yes", 1.0), Candidate("no", 0.0)])])
    ep = Episode(task="river", group=0)
    turn = vs.respond([ep], WordGame())[0]
    assert turn.text == "yes" and turn.meta["vs_dist"] == [1.0, 0.0]
    assert vs.stats.as_dict()["requests"] == 1 and vs.stats.as_dict()["fallbacks"] == 0


def test_verbalized_retries_then_falls_back_to_raw_text(parts):
    vs = Verbalized(parts[1][0], k=5, retries=2, seed=0)
    vs.speaker.generate = Scripted(["no json here"] * 3)
    ep = Episode(task="river", group=0)
    turn = vs.respond([ep], WordGame())[0]
    stats = vs.stats.as_dict()
    assert turn.text == "no json here" and turn.meta["vs_fallback"]
    assert (stats["requests"], stats["retries"], stats["fallbacks"], stats["parse_failures"]) == (1, 2, 1, 3)


def test_verbalized_instruction_reaches_the_simulator_prompt(parts, tokenizer):
    vs = Verbalized(parts[1][0], k=5)
    text = vs.speaker.render(WordGame(), Episode(task="river", group=0))
    assert '"responses"' in text and "5 different" in text


def test_ensemble_rotates_members_across_groups(parts):
    ens = Ensemble(parts[1])
    eps = [Episode(task=None, group=g) for g in range(7) for _ in range(2)]
    ens.assign(eps)
    names = [e.partner_name for e in eps[::2]]
    first = names[0]
    cycle = ["sim0", "sim1", "sim2"] * 3
    start = cycle.index(first)
    assert names == cycle[start:start + 7]                       # consecutive groups, consecutive members
    assert all(eps[i].partner_name == eps[i + 1].partner_name for i in range(0, 14, 2))   # one per group


def test_ensemble_rotates_members_across_rollouts_so_every_task_meets_every_member(parts):
    """The toy batch puts each persona in the same group slots at every step (8 groups, 4
    personas cycled): a pinned `group % K` would keep some personas away from a member."""
    ens = Ensemble(parts[1])
    met = {task: set() for task in range(4)}
    for step in range(30):
        eps = [Episode(task=g % 4, group=g) for g in range(8) for _ in range(2)]
        ens.assign(eps)
        for ep in eps:
            met[ep.task].add(ep.partner_name)
    assert all(names == {"sim0", "sim1", "sim2"} for names in met.values()), met


def test_ensemble_rotation_is_kept_by_evaluations_and_saved_state(parts, tokenizer):
    import copy

    from minscope.evaluate import isolated_rng
    from minscope.experiment import arm_state, load_arm_state

    policy, frozen, _ = parts
    cfg = UpdateConfig(lr=1e-3)

    def draws(ens, n=12):
        out = []
        for _ in range(n):
            eps = [Episode(task=None, group=0)]
            ens.assign(eps)
            out.append(eps[0].partner_name)
        return out

    m = build_method("ensemble", policy, frozen, cfg, seed=3)
    state = arm_state(m, 0, {})
    expected = draws(m.partner)
    assert len(set(expected)) > 1                                 # the rotation moves between rollouts
    # a resumed run (state read back from disk: a copy) rotates the same way
    load_arm_state(m, copy.deepcopy(state))
    assert draws(m.partner) == expected
    load_arm_state(m, copy.deepcopy(state))
    with isolated_rng(7, m.partner):                              # an evaluation in between ...
        draws(m.partner, 5)
    assert draws(m.partner) == expected                           # ... does not move training's rotation


def test_simulator_advantages_follow_the_simulator_reward():
    """Adversarial / cooperative / shared: z-scored within the group, so the adversarial
    simulator's advantages are exactly minus the policy's. Curriculum (one value per group):
    batch-wide; a group-wise curriculum baseline is refused (its advantages are all 0)."""
    from minscope.grpo import group_advantages, simulator_rewards
    from minscope.methods import resolve_sim_baseline, simulator_advantages

    torch.manual_seed(0)
    # groups of different difficulty: a batch-wide baseline would also pay for that
    r = torch.cat([torch.bernoulli(torch.full((8,), p)) for p in (0.2, 0.5, 0.8, 0.9)])
    policy_adv = group_advantages(r, 8)[0]
    adv = simulator_advantages(simulator_rewards(r, 8, "adversarial"), 8, "adversarial")
    torch.testing.assert_close(adv, -policy_adv)
    torch.testing.assert_close(simulator_advantages(simulator_rewards(r, 8, "cooperative"), 8, "cooperative"),
                               policy_adv)
    torch.testing.assert_close(simulator_advantages(simulator_rewards(r, 8, "shared"), 8, "shared"), policy_adv)
    cur = simulator_advantages(simulator_rewards(r, 8, "curriculum"), 8, "curriculum")
    assert cur.abs().sum() > 0 and torch.allclose(cur.view(4, 8), cur.view(4, 8)[:, :1].expand(4, 8))
    assert resolve_sim_baseline("adversarial", "batch") == "batch"      # the ablation stays available
    with pytest.raises(ValueError, match="zero advantages"):
        resolve_sim_baseline("curriculum", "group")


def test_cotraining_with_a_zero_signal_simulator_objective_is_refused(parts, tokenizer):
    policy, frozen, sim_model = parts
    with pytest.raises(ValueError, match="curriculum"):
        build_method("cotrain", policy, frozen, UpdateConfig(), UpdateConfig(), sim_model=sim_model,
                     sim_tokenizer=tokenizer, sim_reward="curriculum", sim_baseline="group")


def test_cotraining_adversarial_simulator_trains_on_minus_the_policy_advantages(parts, tokenizer, monkeypatch):
    """What train_step hands the simulator's update with the default baseline."""
    import minscope.methods as methods
    from minscope.grpo import group_advantages

    policy, frozen, sim_model = parts
    env = WordGame()
    env.score = lambda ep: (float(len(ep.turns[-1].text) % 2), {})
    m = build_method("cotrain", policy, frozen, UpdateConfig(lr=1e-3), UpdateConfig(lr=1e-3),
                     sim_model=sim_model, sim_tokenizer=tokenizer, sim_reward="adversarial")
    seen = []
    real_update = methods.grpo_update
    monkeypatch.setattr(methods, "grpo_update",
                        lambda *a, **k: seen.append((a[5].clone(), a[3])) or real_update(*a, **k))
    torch.manual_seed(5)
    metrics = train_step(m, env, env.tasks()[:4], 4, step=0)
    rewards = torch.tensor([ep.reward for ep in metrics["_episodes"]])
    (policy_adv, _), (sim_adv, _) = seen[0], seen[-1]
    torch.testing.assert_close(policy_adv, group_advantages(rewards, 4)[0])
    torch.testing.assert_close(sim_adv, -policy_adv)


def test_persona_guided_draws_one_persona_per_group_into_the_prompt(parts, tokenizer):
    frozen = parts[1][0]
    pg = PersonaGuided(frozen.model, tokenizer, ["likes cats", "hates rain"], seed=0)
    eps = [Episode(task="river", group=g) for g in range(20) for _ in range(2)]
    pg.assign(eps)
    assert all(eps[i].info["persona"] == eps[i + 1].info["persona"] for i in range(0, 40, 2))
    assert {e.info["persona"] for e in eps} == {"likes cats", "hates rain"}
    assert "Play this person:\nlikes cats" in pg.render(WordGame(), next(e for e in eps if e.info["persona"] == "likes cats"))


def test_population_pool_is_fifo_and_draws_uniformly(parts, tokenizer):
    _, _, sim_model = parts
    pop = Population(sim_model, tokenizer, size=3, every=1, seed=0)
    for step in range(1, 6):
        with torch.no_grad():
            for p in adapter_state(sim_model, "simulator"):
                pass
            next(p for n, p in sim_model.named_parameters() if "lora_B.simulator" in n).fill_(float(step))
        pop.snapshot(step)
    assert [s for s, _ in pop.pool] == [3, 4, 5]
    for slot, (step, _) in zip(pop.slots, pop.pool):   # slot i holds the i-th oldest snapshot
        b = next(p for n, p in sim_model.named_parameters() if f"lora_B.{slot}" in n)
        assert torch.all(b == float(step))
    eps = [Episode(task=None, group=g) for g in range(3000)]
    pop.assign(eps)
    counts = np.bincount([pop.slots.index(e.partner_name) for e in eps], minlength=3)
    assert np.all(np.abs(counts / 3000 - 1 / 3) < 0.04), counts
    assert pop.pool_nbytes() == 3 * sum(t.numel() * 4 for t in adapter_state(sim_model, "simulator").values())


def test_pool_curator_draws_the_members_the_policy_does_worst_against(parts, tokenizer):
    """draw="hardest": weight (1 - r)^2 + 0.01 from the rewards `observe` records; a member
    not met yet counts as r = 0; the record survives state()/load_state() and follows FIFO."""
    _, _, sim_model = parts
    pop = Population(sim_model, tokenizer, size=3, every=1, seed=0, draw="hardest")
    for step in (1, 2, 3):
        pop.snapshot(step)
    met = [Episode(task=None, group=g, reward=r) for g, r in enumerate((1.0, 0.5, 0.5))]
    for ep, slot in zip(met, pop.slots):
        ep.partner_name = slot
    pop.observe(met[:2])                       # snapshot 3 not met yet
    assert pop.scores == {1: 1.0, 2: 0.5}
    assert pop.weights() == pytest.approx([0.01, 0.26, 1.01])
    pop.observe([met[1]])                      # older groups count half
    met[1].reward = 0.0
    pop.observe([met[1]])
    assert pop.scores[2] == pytest.approx(0.25)
    eps = [Episode(task=None, group=g) for g in range(4000)]
    pop.assign(eps)
    counts = np.bincount([pop.slots.index(e.partner_name) for e in eps], minlength=3) / 4000
    expect = np.array([0.01, 0.75 ** 2 + 0.01, 1.01]) / (0.01 + 0.75 ** 2 + 0.01 + 1.01)
    assert np.all(np.abs(counts - expect) < 0.03), (counts, expect)
    again = Population(sim_model, tokenizer, size=3, every=1, seed=5, draw="hardest")
    again.load_state(pop.state())
    assert again.scores == pop.scores and again.weights() == pop.weights()
    pop.snapshot(4)                            # snapshot 1 leaves the pool, and its record with it
    pop.observe([])
    assert set(pop.scores) == {2} and pop.weights()[-1] == pytest.approx(1.01)
    with pytest.raises(ValueError, match="pool draw"):
        Population(sim_model, tokenizer, draw="worst")


def test_cotraining_updates_both_adapters_and_nothing_else(parts, tokenizer):
    policy, frozen, sim_model = parts
    env = WordGame()
    m = build_method("cotrain", policy, frozen, UpdateConfig(lr=1e-2), UpdateConfig(lr=1e-2),
                     sim_model=sim_model, sim_tokenizer=tokenizer, sim_reward="cooperative")
    others = {n: p.clone() for n, p in list(policy.model.named_parameters()) + list(sim_model.named_parameters())
              if "lora_" not in n}
    before_policy, before_sim = adapter_state(policy.model, "policy"), adapter_state(sim_model, "simulator")
    torch.manual_seed(3)
    # rewards must vary inside groups for a non-zero update: make the partner ask, reward on length
    env.score = lambda ep: (float(len(ep.turns[-1].text) % 2), {})
    train_step(m, env, env.tasks(), 4, step=0)
    changed = lambda a, b: any(not torch.equal(a[k], b[k]) for k in a)   # noqa: E731
    assert changed(before_policy, adapter_state(policy.model, "policy"))
    assert changed(before_sim, adapter_state(sim_model, "simulator"))
    params = dict(list(policy.model.named_parameters()) + list(sim_model.named_parameters()))
    assert all(torch.equal(v, params[n]) for n, v in others.items())


@pytest.mark.parametrize("name", [m for m in METHODS])
def test_every_method_runs_a_training_step(parts, tokenizer, name):
    policy, frozen, sim_model = parts
    env = WordGame()
    m = build_method(name, policy, frozen, UpdateConfig(lr=1e-3), UpdateConfig(lr=1e-3),
                     sim_model=sim_model, sim_tokenizer=tokenizer, personas=["likes cats"],
                     oracle=Asker(), pool_size=2, pool_every=1)
    metrics = train_step(m, env, env.tasks()[:2], 2, step=1)
    assert 0.0 <= metrics["train_reward"] <= 1.0
    assert sum(metrics["served_by"].values()) == 2


def test_realism_anchor_trains_the_simulator_adapter_when_it_shares_the_policys_base(parts, tokenizer):
    """Policy and simulator as two adapters of one model (the real-model set-up): the anchor's
    SFT step must move the simulator's adapter, and only it, although the model's default
    adapter is the policy's."""
    from minscope.methods import anchor_step
    from minscope.sft import encode_chat, pad_batch

    policy, frozen, _ = parts
    model = add_adapters(policy.model, ["simulator"], init_lora_weights=False)   # default: "policy"
    m = build_method("cotrain", policy, frozen, UpdateConfig(lr=1e-2), UpdateConfig(lr=1e-2),
                     sim_model=model, sim_tokenizer=tokenizer)
    conv = [{"role": "user", "content": "give"}, {"role": "assistant", "content": "no thanks"}]
    m.anchor = lambda: pad_batch([encode_chat(tokenizer, conv)] * 2, tokenizer.pad_token_id)
    before_policy, before_sim = adapter_state(model, "policy"), adapter_state(model, "simulator")
    nll = anchor_step(m)
    assert nll > 0
    after_policy, after_sim = adapter_state(model, "policy"), adapter_state(model, "simulator")
    assert all(torch.equal(before_policy[k], after_policy[k]) for k in before_policy)
    moved = [k for k in before_sim if not torch.equal(before_sim[k], after_sim[k])]
    assert len(moved) == len(before_sim), f"only {len(moved)} of {len(before_sim)} simulator weights moved"



def test_a_non_finite_anchor_step_is_skipped_and_counted(parts, tokenizer, monkeypatch):
    """The realism anchor's SFT step takes the same guard as the GRPO update: a NaN loss
    leaves the simulator's weights as they were."""
    import minscope.sft as sft
    from minscope.methods import anchor_step
    from minscope.sft import encode_chat, pad_batch

    policy, frozen, _ = parts
    model = add_adapters(policy.model, ["simulator"], init_lora_weights=False)
    m = build_method("cotrain", policy, frozen, UpdateConfig(lr=1e-2), UpdateConfig(lr=1e-2),
                     sim_model=model, sim_tokenizer=tokenizer)
    conv = [{"role": "user", "content": "give"}, {"role": "assistant", "content": "no thanks"}]
    m.anchor = lambda: pad_batch([encode_chat(tokenizer, conv)] * 2, tokenizer.pad_token_id)
    real_nll = sft.nll
    monkeypatch.setattr(sft, "nll", lambda *a: real_nll(*a) * float("nan"))
    before = adapter_state(model, "simulator")
    anchor_step(m)
    after = adapter_state(model, "simulator")
    assert m.anchor_skipped == 1 and all(torch.equal(before[k], after[k]) for k in before)

class FixedActs:
    name = "fixed"
    holds_noise = True          # deterministic: nothing to hold

    def __init__(self, acts):
        self.acts = acts

    def respond(self, episodes, env):
        return [Turn("agent", ACTS[self.acts[sum(t.role == "agent" for t in e.turns)]]) for e in episodes]


def test_collapse_meter_sees_no_simulator_variance_in_a_deterministic_simulator():
    env = ToyEnv()
    agent = FixedActs(["big_ask", "big_ask", "big_ask"])
    greedy = collapse_meter(env, agent, SharpenedUsers(gamma=500.0, seed=0), env.tasks(), n_ref=2, n_resample=8)
    sampling = collapse_meter(env, agent, RealUsers(seed=0), env.tasks(), n_ref=2, n_resample=8)
    assert greedy["sim_side_var"] < 1e-3 and greedy["mode_prob"] > 0.99
    assert sampling["sim_side_var"] > 0.02 and sampling["mode_prob"] < 0.9
    assert greedy["agent_side_var"] == 0.0      # a scripted agent has no randomness
    assert sampling["total_var"] > 0.0
    # total_var is within-task: 0 for a deterministic pair, though here tasks (personas) differ
    matching = collapse_meter(env, FixedActs(["probe", "emotion", "big_ask"]), SharpenedUsers(gamma=500.0, seed=0),
                              env.tasks(), n_ref=2, n_resample=2)
    assert matching["total_var"] == 0.0


@pytest.mark.parametrize("adapter", ["policy", "simulator"])
def test_grpo_update_with_activation_checkpointing_trains_the_right_adapter(tokenizer, adapter):
    """With checkpointing, the backward pass re-runs the layers: it must see the adapter
    being trained, whichever adapter the model falls back to outside `use_adapter`."""
    from minscope.adapters import load_adapter_state, trainable_parameters
    from minscope.trainer import grpo_update

    torch.manual_seed(0)
    model = add_adapters(build_tiny_model(tokenizer, "qwen3", hidden_size=32), ["policy", "simulator"],
                         init_lora_weights=False)
    speaker = LMSpeaker(model, tokenizer, "agent", adapter=adapter, max_new_tokens=3)
    episodes = rollout(WordGame(), ["river", "cloud"], speaker, Asker(), group_size=2)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    start = adapter_state(model, adapter)

    def one_step(checkpointing):
        load_adapter_state(model, adapter, start)    # same starting point each time
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        opt = torch.optim.SGD(trainable_parameters(model, adapter), lr=1.0)
        stats = grpo_update(model, adapter, opt, episodes, "agent", advantages,
                            UpdateConfig(grad_clip=1e9), tokenizer.pad_token_id)
        return adapter_state(model, adapter), stats

    plain, plain_stats = one_step(checkpointing=False)
    ckpt, ckpt_stats = one_step(checkpointing=True)
    assert plain_stats["grad_norm"] > 0
    assert ckpt_stats["grad_norm"] == pytest.approx(plain_stats["grad_norm"], rel=1e-4)
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=1e-4, atol=1e-6)


class CoinGame:
    """One agent turn, then one partner turn, each a fair coin "0"/"1"; R = rule(a, s)."""
    max_turns = 2

    def __init__(self, rule):
        self.rule = rule

    def tasks(self, split="train"):
        return list(range(4))

    def first_speaker(self, task):
        return "agent"

    def after_turn(self, ep):
        from minscope.envs.base import Step
        return Step(None if len(ep.turns) == 2 else "partner")

    def score(self, ep):
        a, s = (int(t.text) for t in ep.turns)
        return float(self.rule(a, s)), {}


class Coin:
    holds_noise = True

    def __init__(self, role, seed):
        self.role, self.name, self.rng = role, f"coin-{role}", np.random.default_rng(seed)

    def respond(self, episodes, env):
        return [Turn(self.role, str((turn_noise(ep, self.role) or self.rng).integers(2))) for ep in episodes]


@pytest.mark.parametrize("rule, sim_side, agent_side", [
    (lambda a, s: a ^ s, 0.25, 0.0),       # the agent's coin alone says nothing about R
    (lambda a, s: a, 0.0, 0.25),           # the simulator's coin does not matter
    (lambda a, s: a & s, 0.125, 0.0625),   # Var_s(R | a) = a/4, E_s[R | a] = a/2
])
def test_collapse_meter_splits_the_variance_as_eq6(rule, sim_side, agent_side):
    """Var(R) = E_a[Var_s(R | a)] + Var_a(E_s[R | a]) with fair coins a and s. Over 20 seeds
    of this setting (4 tasks x 100 references x 20 resamples) the estimates' standard
    deviations are at most ~0.006 (AND's simulator side), ~0.004 for the rest: 0.025 is
    four standard deviations or more."""
    env = CoinGame(rule)
    meter = collapse_meter(env, Coin("agent", 0), Coin("partner", 1), env.tasks(), n_ref=100, n_resample=20,
                           n_mode=2)
    assert meter["sim_side_var"] == pytest.approx(sim_side, abs=0.025)
    assert meter["agent_side_var"] == pytest.approx(agent_side, abs=0.025)
    assert meter["sim_side_var"] + meter["agent_side_var"] == pytest.approx(meter["total_var"], abs=0.05)


class NamedMembers:
    """A partner drawing one of five members per group (like a population); each reply is
    the serving member's name, and every call records (task, member) it served."""
    name = "named"

    def __init__(self):
        self.rng, self.served = np.random.default_rng(0), []

    def assign(self, episodes):
        drawn = {}
        for ep in episodes:
            ep.partner_name = drawn.setdefault(ep.group, f"m{self.rng.integers(5)}")

    def respond(self, episodes, env):
        self.served += [(ep.task, ep.partner_name) for ep in episodes]
        return [Turn("partner", "0" if ep.partner_name == "m0" else "1") for ep in episodes]


def test_collapse_meter_resamples_the_member_and_asks_the_serving_one_for_the_mode():
    """Which member serves an episode is the simulator's randomness: the closed-loop meter
    draws it afresh every episode (R = 1 unless m0 serves: sim-side 0.16, agent-side 0),
    and the open-loop one pins it. The mode probability asks the member that served."""
    env = CoinGame(lambda a, s: s)
    partner = NamedMembers()
    meter = collapse_meter(env, Coin("agent", 0), partner, env.tasks(), n_ref=50, n_resample=8, n_mode=3)
    assert meter["sim_side_var"] == pytest.approx(0.16, abs=0.03) and abs(meter["agent_side_var"]) < 0.02
    assert meter["mode_prob"] == 1.0          # each member always says the same
    partner.served.clear()
    open_loop_meter(env, Coin("agent", 0), partner, env.tasks(), n_ref=3, n_resample=4, n_mode=3)
    members = {task: {name for t, name in partner.served if t == task} for task in env.tasks()}
    assert all(len(names) == 1 for names in members.values()), members


def test_collapse_meter_refuses_an_agent_whose_noise_it_cannot_hold():
    class Plain:
        def respond(self, episodes, env):
            return [Turn("agent", "0") for _ in episodes]
    env = CoinGame(lambda a, s: s)
    with pytest.raises(ValueError, match="holds the agent's sampling noise fixed"):
        collapse_meter(env, Plain(), Coin("partner", 1), env.tasks())


def test_grpo_update_kl_statistic_ignores_untrained_positions(tokenizer, monkeypatch):
    """A reference log-prob 200 above the policy's where nothing is trained (the prompt, the
    other party's turns) must leave the loss, the gradient and the logged KL finite."""
    import minscope.trainer as trainer
    from minscope.adapters import trainable_parameters

    torch.manual_seed(0)
    model = add_adapters(build_tiny_model(tokenizer, "qwen3", hidden_size=32), ["policy"], init_lora_weights=False)
    speaker = LMSpeaker(model, tokenizer, "agent", adapter="policy", max_new_tokens=3)
    episodes = rollout(WordGame(), ["river", "cloud"], speaker, Asker(), group_size=2)
    real = trainer.unit_logprobs
    untrained = trainer.training_batch(episodes, "agent", tokenizer.pad_token_id).loss_mask == 0
    calls = []

    def far_reference(model, ids, attn, unit, temperature, adapter, backend="auto", where=None):
        lp = real(model, ids, attn, unit, temperature, adapter, backend)      # every position
        if adapter is not None:
            return lp
        calls.append(unit)
        rows, p, n = unit
        return torch.where(untrained[rows, p:n - 1], lp + 200.0, lp)

    monkeypatch.setattr(trainer, "unit_logprobs", far_reference)
    opt = torch.optim.SGD(trainable_parameters(model, "policy"), lr=0.1)
    stats = trainer.grpo_update(model, "policy", opt, episodes, "agent", torch.tensor([1.0, -1.0, 0.5, -0.5]),
                                UpdateConfig(beta=0.1, grad_clip=1e9), tokenizer.pad_token_id)
    assert calls                        # the reference pass went through the far reference
    assert all(np.isfinite(stats[k]) for k in ("loss", "kl", "grad_norm")), stats
    assert all(torch.isfinite(p).all() for p in trainable_parameters(model, "policy"))


def selfplay_step(parts, tokenizer, monkeypatch, symmetric: bool):
    """One self-play train_step on WordGame (asymmetric unless `symmetric`), recording the
    optimiser steps and what grpo_update was given."""
    import minscope.methods as methods

    policy, frozen, _ = parts
    env = WordGame()
    env.symmetric = symmetric
    env.score = lambda ep: (float(len(ep.turns[-1].text) % 2), {})
    m = build_method("selfplay", policy, frozen, UpdateConfig(lr=1e-3, epochs=1))
    steps, calls = [], []
    real_step, real_update = m.policy_opt.step, methods.grpo_update
    monkeypatch.setattr(m.policy_opt, "step", lambda *a, **k: steps.append(1) or real_step(*a, **k))
    monkeypatch.setattr(methods, "grpo_update", lambda *a, **k: calls.append(a) or real_update(*a, **k))
    torch.manual_seed(11)
    metrics = train_step(m, env, env.tasks()[:4], 4, step=0)
    return metrics["_episodes"], steps, calls


def test_selfplay_takes_one_optimizer_step_on_both_roles_tokens(parts, tokenizer, monkeypatch):
    from minscope.batch import training_batch

    episodes, steps, calls = selfplay_step(parts, tokenizer, monkeypatch, symmetric=False)
    assert len(steps) == 1 and len(calls) == 1                    # as many as RL (Single) takes
    train_eps, key = calls[0][3], calls[0][4]
    assert len(train_eps) == 2 * len(episodes)
    batch = training_batch(train_eps, key, tokenizer.pad_token_id)
    partner_rows = [i - len(episodes) for i in batch.index if i >= len(episodes)]
    assert partner_rows                                           # the partner's turns are trained on
    for i in partner_rows:                                        # ... exactly its own sampled tokens
        assert train_eps[len(episodes) + i].info["streams"]["agent"] is episodes[i].info["streams"]["partner"]


@pytest.mark.parametrize("symmetric", [False, True])
def test_selfplay_partner_turns_get_the_opponents_reward_on_asymmetric_tasks(parts, tokenizer, monkeypatch,
                                                                          symmetric):
    from minscope.grpo import group_advantages

    episodes, _, calls = selfplay_step(parts, tokenizer, monkeypatch, symmetric=symmetric)
    r = torch.tensor([ep.reward for ep in episodes])
    adv = calls[0][5]
    n = len(episodes)
    assert group_advantages(r, 4)[0].abs().sum() > 0              # some group carries a signal
    torch.testing.assert_close(adv[:n], group_advantages(r, 4)[0])
    want = group_advantages(r if symmetric else 1.0 - r, 4)[0]
    torch.testing.assert_close(adv[n:], want)
    if not symmetric:
        torch.testing.assert_close(adv[n:], -adv[:n])


def test_population_logs_its_simulator_ratios_by_snapshot_age_without_changing_the_update(parts, tokenizer):
    policy, frozen, sim_model = parts
    env = WordGame()
    env.score = lambda ep: (float(len(ep.turns[-1].text) % 2), {})
    m = build_method("population", policy, frozen, UpdateConfig(lr=1e-2), UpdateConfig(lr=1e-2),
                     sim_model=sim_model, sim_tokenizer=tokenizer, sim_reward="adversarial", pool_every=1)
    ages = []
    for step in range(3):
        torch.manual_seed(10 + step)
        metrics = train_step(m, env, env.tasks(), 4, step=step)
        by_age = metrics["sim_ratio_by_age"]
        assert by_age and all(int(a) >= 0 for a in by_age)
        assert all(0.0 <= v["clip_frac"] <= 1.0 and v["abs_log_ratio"] >= 0 and v["tokens"] > 0 for v in by_age.values())
        tokens = sum(v["tokens"] for v in by_age.values())
        assert tokens == metrics["compute"]["sim_trained"]            # every trained token, once
        clipped = sum(v["clip_frac"] * v["tokens"] for v in by_age.values()) / tokens
        assert clipped == pytest.approx(metrics["sim_clip_frac"], abs=1e-6)   # one pass: the same count
        ages += list(by_age)
    assert ages[0] == "0" and any(a != "0" for a in ages)   # the live adapter moves past its snapshots


def test_population_logs_which_snapshot_played_each_group_and_whether_the_pool_was_full(parts, tokenizer):
    policy, frozen, sim_model = parts
    env = WordGame()
    m = build_method("population", policy, frozen, UpdateConfig(lr=1e-3), UpdateConfig(lr=1e-3),
                     sim_model=sim_model, sim_tokenizer=tokenizer, sim_reward="adversarial", pool_size=2,
                     pool_every=1)
    tasks = env.tasks()[:3]
    recs = []
    for step in range(4):
        torch.manual_seed(20 + step)
        recs.append(train_step(m, env, tasks, 2, step=step))
    # the step-0 snapshot plays alone until the step-1 snapshot joins it; full (K = 2) from step 2 on
    assert [r["pool_full"] for r in recs] == [False, False, True, True]
    assert [r["pool_size"] for r in recs] == [1, 2, 2, 2]          # (after each step's snapshot)
    assert recs[0]["pool_played"] == recs[1]["pool_played"] == [0, 0, 0]
    # in group order: at step 3 the pool held the snapshots of steps 1 and 2 in slots pool0, pool1
    groups = recs[3]["_episodes"][::2]
    assert recs[3]["pool_played"] == [{"pool0": 1, "pool1": 2}[ep.partner_name] for ep in groups]
    assert all(len(r["pool_played"]) == sum(r["served_by"].values()) == 3 for r in recs)
