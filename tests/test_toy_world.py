"""The toy persuasion world: its real-user model, exact values, data and environment hooks."""

import numpy as np
import pytest

from minscope.envs.base import Episode, Turn
from minscope.envs.toy import RealUsers, SharpenedUsers, ToyEnv
from minscope.envs.toy_words import (ACT_KEYS, ACTS, CUES, FORGET, INVALID, NEVER, NO, PERSONAS, REPLIES, STRATEGIES,
                                     SURE1, WHAT, YES2, text_to_act)
from minscope.envs.toy_world import World, sharpened, total_variation


@pytest.fixture(scope="module")
def world():
    return World()


def all_histories(world, depth):
    """Every history of `depth` complete exchanges reachable under the real users."""
    frontier = [((), p) for p in range(len(PERSONAS))]
    for _ in range(depth):
        nxt = []
        for h, p in frontier:
            for a in ACT_KEYS:
                ha = h + (ACTS[a],)
                nxt += [(ha + (r,), p) for r in world.reply_dist(p, ha)]
        frontier = nxt
    return frontier


def fixed(seq):
    return lambda h: seq[len(h) // 2]


def play(env, partner, policy, task):
    """One episode through the environment hooks, the way the rollout engine drives them."""
    ep = Episode(task=task, group=0)
    speaker = env.first_speaker(task)
    while speaker is not None:
        if speaker == "agent":
            ep.turns.append(Turn("agent", ACTS[policy(tuple(t.text for t in ep.turns))]))
        else:
            ep.turns += partner.respond([ep], env)
        speaker = env.after_turn(ep).next_speaker
    return ep


def test_reply_distributions_sum_to_one(world):
    for h, p in all_histories(world, 2):
        for a in ACT_KEYS:
            dist = world.reply_dist(p, h + (ACTS[a],))
            assert abs(sum(dist.values()) - 1) < 1e-9
            assert set(dist) <= set(REPLIES)


def test_reply_first_words_are_unique():
    first = [r.split()[0] for r in REPLIES]
    assert len(set(first)) == len(first)
    assert not any(a != b and b.startswith(a) for a in first for b in first)


def test_text_to_act_normalises_and_rejects_garbled_text():
    assert text_to_act("  What matters to you ") == "probe"
    assert text_to_act("WOULD YOU GIVE 2 DOLLARS") == "big_ask"
    assert text_to_act("give 2 dollars please") == INVALID
    assert text_to_act("") == INVALID


def test_invalid_act_gets_a_confused_reply(world):
    dist = world.reply_dist(0, ("blah blah",))
    assert max(dist, key=dist.get) == WHAT
    assert world.exact_value(lambda h: "invalid") == 0.0


def test_exact_value_matches_monte_carlo_with_real_users(world):
    env, users = ToyEnv(world), RealUsers(world, seed=1)
    policy = fixed(("probe", "emotion", "big_ask"))
    rewards = [env.score(play(env, users, policy, task))[0]
               for task in world.tasks for _ in range(1000)]
    assert abs(np.mean(rewards) - world.exact_value(policy)) < 0.03


def test_reference_values_are_ordered_with_headroom(world):
    v_random = world.random_value()
    v_fixed, _ = world.best_fixed()
    v_adaptive, table = world.best_adaptive()
    assert v_adaptive > v_fixed + 0.15 > v_random + 0.15
    assert table[()] == "probe"


def test_best_adaptive_answers_each_cue_with_its_strategy(world):
    _, table = world.best_adaptive()
    for persona, cues in enumerate(CUES):
        for cue in cues:
            assert table[(ACTS["probe"], cue)] == STRATEGIES[persona]


def test_exploit_wins_inside_sharpened_users_but_loses_on_real_users(world):
    sharp = sharpened(world.reply_dist, 8.0)
    _, adaptive_table = world.best_adaptive()
    adaptive = lambda h: adaptive_table[h]  # noqa: E731
    assert world.exploit(8.0) == ("probe", "small_ask", "big_ask")
    exploit = fixed(world.exploit(8.0))
    assert world.exact_value(exploit, sharp) > world.exact_value(adaptive, sharp) + 0.15
    assert world.exact_value(exploit) < world.exact_value(adaptive) - 0.4
    # ... and on real users it is worse than the cautious sequence it grows out of
    assert world.exact_value(exploit) < world.exact_value(fixed(("probe", "small_ask", "probe"))) - 0.05
    # the upsell without the probe, and asking three times, are exploits too
    assert world.exact_value(fixed(("small_ask", "big_ask", "probe")), sharp) > 0.9
    assert world.exact_value(fixed(("big_ask",) * 3), sharp) > 0.85


def test_the_exploit_is_a_climb_inside_sharpened_users(world):
    """From a probe-first policy, each step towards the exploit pays inside the sharpened
    users: after a probe the small ask, after its pledge the upsell."""
    sharp = sharpened(world.reply_dist, 8.0)
    best = world.best_adaptive(sharp)[1]
    probed = (ACTS["probe"], max(sharp(0, (ACTS["probe"],)), key=sharp(0, (ACTS["probe"],)).get))
    assert best[probed] == "small_ask"
    assert best[probed + (ACTS["small_ask"], SURE1)] == "big_ask"


def test_pushback_is_a_minority_reply_along_the_exploits(world):
    h = ()
    for _ in range(3):
        h = h + (ACTS["big_ask"],)
        dist = world.reply_dist(0, h)
        assert dist.get(NO, 0.0) < 0.5
        h = h + (max(dist, key=dist.get),)
    upsell = world.reply_dist(0, (ACTS["small_ask"], SURE1, ACTS["big_ask"]))
    assert max(upsell, key=upsell.get) == YES2 and upsell[YES2] < 0.5
    assert sum(upsell[r] for r in (NO, FORGET, NEVER)) > 0.5


def test_sharpening_keeps_the_mode_and_gamma_one_is_identity(world):
    h = (ACTS["probe"],)
    p = world.reply_dist(1, h)
    assert total_variation(sharpened(world.reply_dist, 1.0)(1, h), p) < 1e-12
    s = sharpened(world.reply_dist, 8.0)(1, h)
    assert max(s, key=s.get) == max(p, key=p.get) and max(s.values()) > 0.85


def test_vs_target_is_top_k_renormalised(world):
    h = (ACTS["probe"],)
    cands = world.vs_target(2, h, k=5)
    probs = [q for _, q in cands]
    assert len(cands) == 5 and abs(sum(probs) - 1) < 1e-9 and probs == sorted(probs, reverse=True)
    true = world.reply_dist(2, h)
    top = sorted(true.values(), reverse=True)[:5]
    assert np.allclose(probs, np.array(top) / sum(top))


def test_total_variation():
    assert total_variation({"a": 1.0}, {"b": 1.0}) == 1.0
    assert total_variation({"a": 0.5, "b": 0.5}, {"a": 0.5, "b": 0.5}) == 0.0
    assert abs(total_variation({"a": 0.7, "b": 0.3}, {"a": 0.5, "b": 0.5}) - 0.2) < 1e-12


def test_score_reads_the_last_stated_donation():
    env = ToyEnv()
    task = env.tasks()[0]
    ep = Episode(task, 0, [Turn("agent", "would you give 2 dollars?"), Turn("partner", YES2),
                           Turn("agent", "uh what"), Turn("partner", WHAT),
                           Turn("agent", "would you give 1 dollar"), Turn("partner", SURE1)])
    reward, info = env.score(ep)
    assert reward == 0.5 and info["donation"] == 1.0
    assert info["acts"] == ["big_ask", INVALID, "small_ask"] and info["n_invalid"] == 1
    ep.turns.append(Turn("partner", NO))
    assert env.score(ep)[0] == 0.0
    assert env.score(Episode(task, 0, [Turn("agent", "hi"), Turn("partner", "maybe later")]))[0] == 0.0


def test_episode_ends_after_the_last_act_is_answered():
    env = ToyEnv()
    ep = play(env, RealUsers(seed=0), lambda h: "probe", env.tasks()[0])
    assert [t.role for t in ep.turns] == ["agent", "partner"] * env.world.n_turns


def test_partner_is_told_the_persona_and_agent_is_not():
    env = ToyEnv()
    for task in env.tasks():
        assert task.name in env.partner_messages(task)[0]["content"]
        assert not any(name in env.agent_messages(task)[0]["content"] for name in PERSONAS)


def test_real_users_are_reproducible_by_seed():
    env = ToyEnv()
    eps = [Episode(t, 0, [Turn("agent", ACTS["probe"])]) for t in env.tasks() * 5]
    a = [t.text for t in RealUsers(seed=3).respond(eps, env)]
    b = [t.text for t in RealUsers(seed=3).respond(eps, env)]
    assert a == b and len(set(a)) > 1


def test_sharpened_users_mostly_give_the_modal_reply():
    env = ToyEnv()
    eps = [Episode(env.tasks()[0], 0, [Turn("agent", ACTS["big_ask"])]) for _ in range(200)]
    replies = [t.text for t in SharpenedUsers(8.0, seed=0).respond(eps, env)]
    assert replies.count("maybe later") > 180


def test_transcripts_cover_the_exploit_histories():
    data = World().sample_transcripts(600, np.random.default_rng(0))
    agent = [tuple(u for s, u in turns if s == "agent") for _, turns in data]
    assert sum(a == (ACTS["big_ask"],) * 3 for a in agent) >= 15  # ~4%; uniform acts would give 0.3%
    upsells = sum(any(turns[i][1] == SURE1 and turns[i + 1][1] == ACTS["big_ask"] for i in range(len(turns) - 1))
                  for _, turns in data)
    assert upsells >= 30    # a 1-dollar pledge followed by a big ask
    assert all([s for s, _ in turns] == ["agent", "partner"] * 3 for _, turns in data)
    assert any(text_to_act(u) == INVALID for _, turns in data for s, u in turns if s == "agent")


def test_world_variants_are_one_line_and_validated():
    probe = (ACTS["probe"],)
    assert World(cue_rate=0.7).reply_dist(0, probe)[CUES[0][0]] > World().reply_dist(0, probe)[CUES[0][0]]
    skewed = World(persona_mix=(0.7, 0.1, 0.1, 0.1))
    per_persona = skewed.exact_value(lambda h: "emotion", per_persona=True)
    assert abs(skewed.exact_value(lambda h: "emotion") - per_persona @ skewed.persona_mix) < 1e-12
    with pytest.raises(ValueError, match="persona_mix"):
        World(persona_mix=(0.5, 0.5))


def test_mean_total_variation_is_zero_for_the_real_users_and_grows_with_gamma(world):
    assert world.mean_total_variation(world.reply_dist) < 1e-12
    tv4 = world.mean_total_variation(sharpened(world.reply_dist, 4.0))
    tv8 = world.mean_total_variation(sharpened(world.reply_dist, 8.0))
    assert 0 < tv4 < tv8 < 1


def test_sft_conversations_give_the_simulator_the_persona_and_its_own_replies():
    env = ToyEnv()
    data = env.world.sample_transcripts(3, np.random.default_rng(0))
    convs = env.sft_conversations(data, role="partner")
    for (task, turns), msgs in zip(data, convs):
        assert task.name in msgs[0]["content"] and msgs[0]["role"] == "system"
        assert [m["role"] for m in msgs[1:]] == ["user", "assistant"] * env.world.n_turns
        assert [m["content"] for m in msgs[2::2]] == [u for s, u in turns if s == "partner"]


def test_policy_tokenizer_has_one_token_per_act_and_reply_and_round_trips():
    from minscope.toy_models import toy_tokenizer, with_utterance_tokens

    env = ToyEnv()
    sim_tok = toy_tokenizer(env)
    tok = with_utterance_tokens(toy_tokenizer(env))
    assert len(tok) == len(sim_tok) + len(set(ACTS.values()) | set(REPLIES))
    for text in list(ACTS.values()) + list(REPLIES):
        assert len(tok(text, add_special_tokens=False)["input_ids"]) == 1, text
    # garbled text still has a spelling, and chat turns decode to the same text
    assert len(tok("would you give dollar?", add_special_tokens=False)["input_ids"]) > 1
    msgs = [{"role": "user", "content": NO}, {"role": "assistant", "content": ACTS["probe"] + ACTS["big_ask"]}]
    rendered = tok.apply_chat_template(msgs, tokenize=False)
    assert tok.decode(tok(rendered, add_special_tokens=False)["input_ids"]) == rendered


def test_base_persuader_reads_cues_and_asks_when_the_probe_reveals_nothing(world):
    """The policy base's teacher: the best adaptive act for a share `policy_skill`, except
    a 1-dollar ask after a bland probe reply (which puts the upsell one act away)."""
    from minscope.envs.toy_words import BLAND
    from minscope.toy_models import ToyModelConfig, base_persuader

    rng = np.random.default_rng(0)
    expert = base_persuader(ToyModelConfig(policy_skill=1.0), world, rng)
    assert expert(()) == "probe"
    for i, strategy in enumerate(STRATEGIES):
        assert expert((ACTS["probe"], CUES[i][0])) == strategy
    assert expert((ACTS["probe"], BLAND)) == "small_ask"
    # without the override it guesses a strategy, as the exact best policy does (by 0.006)
    guesser = base_persuader(ToyModelConfig(policy_skill=1.0, policy_blind=""), world, rng)
    assert guesser((ACTS["probe"], BLAND)) in STRATEGIES
    # the unskilled part asks for money in a share `policy_asks` of its acts
    pushy = base_persuader(ToyModelConfig(policy_skill=0.0, policy_asks=0.5), world, rng)
    acts = [pushy(()) for _ in range(4000)]
    assert abs(np.mean([a.endswith("_ask") for a in acts]) - 0.5) < 0.03
    assert set(acts) == set(ACT_KEYS)
    # the base's name (its cache folder) changes with its settings, the simulators' key does not
    a, b = ToyModelConfig(), ToyModelConfig(policy_blind="", policy_skill=0.2, policy_steps=300)
    assert a.policy_name() != b.policy_name() and a.key() == b.key()


def test_fidelity_check_passes_a_faithful_build_and_names_what_fails():
    from minscope.toy_fidelity import fidelity_problems

    good = {"exploit_lm": 0.891, "exploit_exact": 0.988, "tv": 0.135, "vs_tv": 0.013}
    assert fidelity_problems(good) == []
    bad = fidelity_problems({**good, "exploit_lm": 0.50, "vs_tv": float("nan")})
    assert len(bad) == 2 and "0.500" in bad[0] and "nan" in bad[1]


def test_sampling_tv_floor_is_the_noise_of_a_perfect_sampler():
    from minscope.toy_fidelity import sampling_tv_floor

    assert sampling_tv_floor([{"a": 1.0}], 64) == 0.0                    # nothing to miss
    # fair coin, 64 flips: E|k/64 - 1/2| = 0.0497 (exact binomial), the TV of two outcomes
    assert abs(sampling_tv_floor([{"a": 0.5, "b": 0.5}], 64, reps=4000) - 0.0497) < 0.003
    assert sampling_tv_floor([{"a": 0.5, "b": 0.5}], 1024) < 0.015       # shrinks as 1/sqrt(n)


def cue_rate(reply_dist, persona=0):
    """P(a probe, first thing, names the persona's own concern) under `reply_dist`."""
    return sum(p for r, p in reply_dist(persona, (ACTS["probe"],)).items() if r in CUES[persona])


def test_the_two_worlds_collapse_differently_under_sharpening():
    # suppression (the default): the upsell pays inside the sharpened users AND their cues vanish
    sup = World.named("suppression")
    sup_sharp = sharpened(sup.reply_dist, 8.0)
    assert cue_rate(sup.reply_dist) == pytest.approx(0.6) and cue_rate(sup_sharp) < 0.05
    # distortion: the upsell still pays, the cues are stated at least as often as by real users
    dis = World.named("distortion")
    dis_sharp = sharpened(dis.reply_dist, 8.0)
    assert cue_rate(dis.reply_dist) == pytest.approx(0.85) and cue_rate(dis_sharp) > 0.99
    upsell = fixed(("probe", "small_ask", "big_ask"))
    assert dis.exploit(8.0) == ("probe", "small_ask", "big_ask")
    assert dis.exact_value(upsell, dis_sharp) == pytest.approx(sup.exact_value(upsell, sup_sharp))
    assert dis.exact_value(upsell) == pytest.approx(0.240, abs=1e-3)
    # ... and the real users' best policy is worth less than the upsell inside them (so a
    # policy trained there collapses), but far more on the real users
    value, best = dis.best_adaptive()
    best_policy = lambda h: best.get(h) or "probe"     # noqa: E731
    inside = dis.exact_value(best_policy, dis_sharp)
    assert 0.6 < value and dis.exact_value(upsell) < value - 0.3
    assert 0.5 < inside < dis.exact_value(upsell, dis_sharp) - 0.1
    assert best[()] == "probe" and best[(ACTS["probe"], CUES[1][0])] == STRATEGIES[1]


def test_worlds_are_named_and_a_panel_variant_goes_on_top():
    assert World.named("distortion", cue_rate=0.75).cue_rate == 0.75
    assert World.named("distortion", cue_rate=0.75).persuaded_big == (0.5, 0.45, 0.05)
    default = World()
    assert World.named().__dict__.keys() == default.__dict__.keys()
    assert default.reply_dist(0, (ACTS["emotion"], "wow that moves me", ACTS["big_ask"])) == {YES2: 0.9, SURE1: 0.07, NO: 0.03}
    with pytest.raises(ValueError, match="unknown toy world"):
        World.named("nowhere")
    with pytest.raises(ValueError, match="persuaded_big"):
        World(persuaded_big=(0.5, 0.5, 0.5))


def test_the_world_flag_reaches_the_config_the_models_and_the_reference_values(capsys):
    import train
    from minscope.toy_models import SHIPPED, ToyModelConfig
    from minscope.toy_setup import ToyConfig, reference_values

    # the default world keeps the shipped models' cache key; another world gets models of its own
    assert (SHIPPED / f"toy-{ToyModelConfig().key()}").is_dir()
    assert ToyModelConfig(world_name="distortion").key() != ToyModelConfig().key()
    assert ToyConfig(models=ToyModelConfig(world_name="distortion")).world == "distortion"
    # the distortion world's simulators train on more data (what its sim-a needs to pass the gate)
    assert ToyModelConfig().for_world("suppression") == ToyModelConfig()
    dis = ToyModelConfig().for_world("distortion")
    assert (dis.world_name, dis.transcripts, dis.sim_a_steps) == ("distortion", 6000, 3000)
    assert ToyConfig().world == "suppression"
    ref = reference_values(8.0, "distortion")
    assert ref["best_adaptive"] == pytest.approx(0.650, abs=1e-3) and ref["exploit_sharpened"] > 0.98
    assert train.parse_args(["--world", "distortion"]).world == "distortion"
    with pytest.raises(SystemExit):
        train.parse_args(["--env", "p4g", "--world", "distortion"])
    assert "for the toy experiment" in capsys.readouterr().err
