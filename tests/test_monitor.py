"""The live collapse monitor and the pool-diversity measurements (scripted speakers: exact)."""
import pytest

from minscope.diversity import exploit_value, member_profile, pool_diversity
from minscope.envs.toy import RealUsers, SharpenedUsers
from minscope.envs.toy_world import World, sharpened
from minscope.monitor import CollapseMonitor, MonitorConfig, first_alarms


def train(step, reward=0.5, entropy=1.0, zero_var=0.0):
    return {"kind": "train", "step": step, "train_reward": reward, "policy_entropy": entropy, "zero_var_frac": zero_var}


def evaluation(step, panel, real=None, mode=None):
    """An eval record; `panel` is the held-out simulators' mean (the toy's "unseen")."""
    rec = {"kind": "eval", "step": step, "unseen": panel, "real_users": real}
    if mode is not None:
        rec["meter"] = {"mode_prob": mode}
    return rec


# the thresholds these synthetic curves are written for (the defaults were chosen on the toy's)
SYNTH = MonitorConfig(entropy_frac=0.5, zero_var=0.5, mode_prob=0.9)


def run(records, cfg=SYNTH):
    mon, alarms = CollapseMonitor(cfg), []
    for r in records:
        alarms += mon.on_record(r)
    return mon, alarms


def collapsing_run():
    """Training reward climbs, entropy falls to a quarter, the groups go zero-variance, the
    panel score falls: every signal of the signature."""
    recs = [evaluation(0, 0.5, 0.4, mode=0.7)]
    for s in range(30):
        f = s / 29
        recs.append(train(s, reward=0.3 + 0.6 * f, entropy=1.0 - 0.75 * f, zero_var=0.8 * f))
        if (s + 1) % 10 == 0:
            recs.append(evaluation(s + 1, 0.5 - 0.05 * (s + 1) / 10, 0.4 - 0.04 * (s + 1) / 10, mode=0.95))
    return recs


def healthy_run():
    """Training and held-out rewards rise together; entropy and zero-variance stay put."""
    recs = [evaluation(0, 0.4, 0.3, mode=0.6)]
    for s in range(30):
        recs.append(train(s, reward=0.3 + 0.01 * s, entropy=1.0 - 0.005 * s, zero_var=0.1))
        if (s + 1) % 10 == 0:
            recs.append(evaluation(s + 1, 0.4 + 0.02 * (s + 1) / 10, 0.3 + 0.03 * (s + 1) / 10, mode=0.6))
    return recs


def test_the_collapse_signature_raises_every_alarm_once():
    mon, alarms = run(collapsing_run())
    assert sorted(a["signal"] for a in alarms) == sorted(["divergence", "divergence_real", "entropy", "zero_var",
                                                         "mode_prob"])
    steps = first_alarms(alarms)
    assert steps["mode_prob"] == 10            # the first metered evaluation above 0.9
    assert steps["divergence"] == 30           # needs `window` = 3 evaluations with training behind them
    # the mean of the last 5 steps: entropy 1 - 0.75 (s - 2) / 29 below half the first window's
    # mean (0.948) from step 23; zero-variance 0.8 (s - 2) / 29 above 0.5 from step 21
    assert steps["entropy"] == 23 and steps["zero_var"] == 21
    assert all(f"alarm_{a['signal']}" in a for a in alarms)


def test_a_healthy_run_raises_none():
    assert run(healthy_run())[1] == []


def test_thresholds_are_settings():
    recs = healthy_run()
    assert run(recs, MonitorConfig(entropy_frac=0.5, zero_var=0.5, mode_prob=0.5))[1][0]["signal"] == "mode_prob"
    assert {a["signal"] for a in run(collapsing_run(), MonitorConfig(entropy_frac=0.1, zero_var=0.95,
                                                                       mode_prob=0.99))[1]} == {"divergence",
                                                                                                "divergence_real"}


def test_a_collapsed_simulator_before_training_is_logged_not_alarmed():
    """An aligned simulator reads ~0.9 before the first step (the toy's sim-a: 0.90-0.92); the
    untrained "base" arm has no training at all; the alarm waits for a reading after training."""
    before = [evaluation(0, 0.5, 0.4, mode=0.95)]
    assert run(before)[1] == []
    after = before + [train(0), train(1), evaluation(2, 0.5, 0.4, mode=0.95)]
    assert [(a["signal"], a["step"]) for a in run(after)[1]] == [("mode_prob", 2)]


def test_thresholds_derived_from_the_arms_that_end_above_the_untrained_policy():
    from minscope.monitor import derive_thresholds, healthy_arms

    def arm(final_real, zero_var, entropy, mode):
        recs = [evaluation(0, 0.5, 0.3, mode=0.99)]           # before training: not a reading
        for s in range(10):
            recs.append(train(s, entropy=entropy if s >= 5 else 1.0, zero_var=zero_var if s >= 5 else 0.0))
        return recs + [evaluation(10, 0.5, final_real, mode=mode)]
    logs = {"base-s0": [evaluation(0, 0.5, 0.3)], "vs-s0": arm(0.45, 0.32, 0.23, 0.76),
            "oracle-s0": arm(0.6, 0.1, 0.5, 0.6), "single-s0": arm(0.2, 0.9, 0.9, 0.97)}
    assert healthy_arms(logs) == ["vs-s0", "oracle-s0"]
    # vs's window means: zero_var up to 0.32, entropy down to 0.23 of its start, mode 0.76
    cfg = derive_thresholds(logs, healthy_arms(logs), MonitorConfig())
    assert (cfg.zero_var, cfg.entropy_frac, cfg.mode_prob) == (0.35, 0.2, 0.8)
    assert cfg.fall_z == MonitorConfig().fall_z                   # the noise-based ones untouched
    with pytest.raises(ValueError, match="base"):
        healthy_arms({"vs-s0": logs["vs-s0"]})


def test_a_resumed_monitor_replays_its_log_and_does_not_repeat_alarms():
    recs = collapsing_run()
    cut = 25
    mon, alarms = run(recs[:cut])
    log = recs[:cut] + alarms
    again = CollapseMonitor(SYNTH)
    again.replay(log)
    rest = [a for r in recs[cut:] for a in again.on_record(r)]
    _, straight = run(recs)
    assert alarms + rest == straight


def noisy_evaluations(means, rng, n=128):
    """Eval records of a policy whose real-user reward has these true means, each measured
    on n episodes (rewards 0 or 0.5: SD 0.245 at mean 0.3, SE 0.022 at n = 128, as the toy's
    real-user evaluations), with the bootstrap interval the toy logs."""
    from minscope.evaluate import bootstrap_ci

    out = []
    for k, m in enumerate(means):
        rewards = 0.5 * (rng.random(n) < 2 * m)
        out.append({"kind": "eval", "step": 10 * k, "unseen": None, "real_users": float(rewards.mean()),
                    "real_users_ci95": bootstrap_ci(rewards, n_boot=500, seed=k)})
    return out


def alarm_rate(means, cfg, runs=150, seed=0):
    """The share of monitors, each fed one rising training curve and one window of noisy
    evaluations, that raise divergence_real."""
    import numpy as np

    rng, fired = np.random.default_rng(seed), 0
    for _ in range(runs):
        mon = CollapseMonitor(cfg)
        for k, rec in enumerate(noisy_evaluations(means, rng)):
            mon.on_record(train(10 * k - 1, reward=0.3 + 0.1 * k))
            fired += any(a["signal"] == "divergence_real" for a in mon.on_record(rec))
    return fired / runs


def test_a_flat_policys_noisy_evaluations_rarely_cross_the_fall_threshold():
    """The same true reward three times: the old fixed 0.02 threshold fires on noise in about a
    quarter of the windows (0.205-0.24 over 3 x 400), the SE-derived one (z = 2) in 2-4%."""
    flat = [0.3, 0.3, 0.3]
    old = alarm_rate(flat, MonitorConfig(fall_z=0.0, min_fall=0.02))
    new = alarm_rate(flat, MonitorConfig())
    assert old > 0.15 and new < 0.07, (old, new)


def test_a_real_collapse_still_crosses_it():
    assert alarm_rate([0.3, 0.22, 0.15], MonitorConfig(), runs=60) > 0.9


def test_the_fall_threshold_is_z_standard_errors_of_the_difference():
    mon = CollapseMonitor(MonitorConfig(fall_z=2.0, min_fall=0.02))
    assert mon.fall_threshold(0.03, 0.04) == pytest.approx(0.1)
    assert mon.fall_threshold(0.001, 0.001) == 0.02          # never below min_fall
    assert mon.fall_threshold(None, 0.04) == 0.02            # no SE logged: min_fall alone


# ------------------------------------------------------------------ pool diversity
W, GAMMA = World(), 8.0


def test_exploit_value_inside_exact_users_matches_the_exact_value():
    seq = W.exploit(GAMMA)
    exact_sharp = W.exact_value(lambda h: seq[len(h) // 2], reply_dist=sharpened(W.reply_dist, GAMMA))
    exact_real = W.exact_value(lambda h: seq[len(h) // 2])
    assert exploit_value(SharpenedUsers(GAMMA, seed=1), W, GAMMA, episodes=400) == pytest.approx(exact_sharp, abs=0.05)
    assert exploit_value(RealUsers(seed=1), W, GAMMA, episodes=400) == pytest.approx(exact_real, abs=0.06)
    assert exact_sharp - exact_real > 0.5       # the exploit pays only inside the collapsed users


def test_pool_diversity_tells_copies_from_distinct_members():
    n = 200
    sim_a = member_profile(SharpenedUsers(GAMMA, seed=0), W, GAMMA, n)
    copies = {f"s{i}": member_profile(SharpenedUsers(GAMMA, seed=i + 1), W, GAMMA, n, episodes=16) for i in range(2)}
    mixed = {"s0": copies["s0"], "real": member_profile(RealUsers(seed=7), W, GAMMA, n)}
    same = pool_diversity(copies, sim_a, W, GAMMA)
    diff = pool_diversity(mixed, sim_a, W, GAMMA)
    assert same["pairwise_tv"] < 0.05 and same["tv_sim_a"] < 0.05          # sampling noise only
    assert abs(same["pairwise_tv_excess"]) < 0.02
    assert diff["pairwise_tv_excess"] > 0.2 and diff["excess_by"]["probe"] > 0.4     # the cues
    assert diff["members"]["real"]["cue_rate"] == pytest.approx(W.cue_rate, abs=0.06)
    assert diff["members"]["s0"]["cue_rate"] < 0.03
    assert diff["members"]["real"]["tv_real"] < 0.06 < diff["members"]["real"]["tv_sim_a"]
    assert diff["members"]["real"]["exploit_value"] < diff["members"]["s0"]["exploit_value"] - 0.4
    assert same["sim_a_exploit_value"] == sim_a["exploit_value"]
    one = pool_diversity({"s0": copies["s0"]}, sim_a, W, GAMMA)
    assert one["pairwise_tv"] is None and one["tv_sim_a"] == same["members"]["s0"]["tv_sim_a"]


class Modal:
    """A deterministic member: the real users' most likely reply everywhere, except that a
    revealing one names its persona's first cue when probed."""

    def __init__(self, reveal=False):
        self.reveal = reveal

    def respond(self, episodes, env):
        from minscope.envs.base import Turn
        from minscope.envs.toy import history_from_turns
        from minscope.envs.toy_words import ACTS, CUES

        out = []
        for ep in episodes:
            h = history_from_turns(ep.turns)
            p = W.reply_dist(ep.task.persona, h)
            text = CUES[ep.task.persona][0] if self.reveal and h == (ACTS["probe"],) else max(p, key=p.get)
            out.append(Turn("partner", text))
        return out


def test_deterministic_members_read_their_exact_tv_with_a_zero_floor():
    """Two members that differ only at the probe: the floor is 0, the excess is exactly the
    share of tables that differ, all of it at the probe; the cue rates are 1 and 0."""
    from minscope.diversity import diversity_histories
    from minscope.envs.toy_words import ACTS

    hidden, revealing = (member_profile(Modal(r), W, GAMMA, n=8, episodes=8) for r in (False, True))
    d = pool_diversity({"hidden": hidden, "revealing": revealing}, hidden, W, GAMMA)
    n_hist = len({h for hs in diversity_histories(W, GAMMA).values() for h in hs})
    assert d["pairwise_floor"] == 0.0 and d["pairwise_tv"] == d["pairwise_tv_excess"] == pytest.approx(1 / n_hist)
    probe = (ACTS["probe"],)          # the upsell opens with the probe: a third of its tables differ
    assert d["excess_by"] == {g: pytest.approx(hs.count(probe) / len(hs)) for g, hs in diversity_histories(W, GAMMA).items()}
    assert d["excess_by"]["probe"] == 1.0 and d["excess_by"]["upsell"] == pytest.approx(1 / 3)
    assert d["members"]["revealing"]["cue_rate"] == 1.0 and d["members"]["hidden"]["cue_rate"] == 0.0
    assert d["real_cue_rate"] == pytest.approx(W.cue_rate) and set(d["exploit_values"]) >= {"upsell", "big_small_big"}


def test_identical_members_read_no_diversity_above_the_floor():
    """Copies of the gamma-2 users at 32 replies: raw pairwise TV ~0.12, all of it noise.
    Over 8 pairs the excess had mean -0.005..+0.005 and SD <= 0.010 at gamma 1-8."""
    copies = {f"s{i}": member_profile(SharpenedUsers(2.0, seed=i + 1), W, GAMMA, n=32, episodes=16) for i in range(3)}
    d = pool_diversity(copies, copies["s0"], W, GAMMA)
    assert d["pairwise_tv"] > 0.08                            # what the uncorrected TV shows
    assert abs(d["pairwise_tv_excess"]) < 0.04
    assert d["pairwise_floor"] == pytest.approx(d["pairwise_tv"], abs=0.04)


def test_relog_reproduces_the_live_log_and_applies_other_thresholds():
    from minscope.monitor import relog

    recs = collapsing_run()
    mon, live = CollapseMonitor(SYNTH), []
    for r in recs:
        live.append(r)
        live += mon.on_record(r)
    assert relog(live, SYNTH) == live                    # old alarms dropped, the same ones again
    strict = relog(live, MonitorConfig(entropy_frac=0.1, zero_var=0.95, mode_prob=0.99))
    assert {r["signal"] for r in strict if r["kind"] == "alarm"} == {"divergence", "divergence_real"}
    assert [r for r in strict if r["kind"] != "alarm"] == recs


def test_the_batched_exploit_values_read_what_one_rollout_per_sequence_reads():
    """member_profile plays every exploit in one rollout: for a deterministic member each
    value is the one a rollout of its own reads."""
    from minscope.diversity import exploits, sequence_value, sequence_values

    member = Modal(reveal=True)
    seqs = {**exploits(W, GAMMA), "probe_x3": ("probe",) * 3, "small_x3": ("small_ask",) * 3}
    values = sequence_values(member, W, seqs, episodes=8)
    assert values == {name: sequence_value(member, W, seq, episodes=8) for name, seq in seqs.items()}
    assert len(set(values.values())) > 1           # the sequences differ: a mix-up would show


def test_steps_with_a_skipped_update_still_count_for_zero_variance():
    """A skipped update (UpdateConfig.skip_zero_signal) logs no entropy; its zero-variance share
    still enters the window, and the entropy alarm reads the steps that measured one."""
    recs = [train(s, reward=0.5, entropy=1.0, zero_var=0.2) for s in range(3)]
    recs += [dict(train(s, reward=0.5, entropy=1.0, zero_var=1.0), policy_entropy=None) for s in range(3, 8)]
    mon, alarms = run(recs)
    assert [a["signal"] for a in alarms] == ["zero_var"]
    recs = [train(s, reward=0.5, entropy=1.0, zero_var=0.0) for s in range(5)]
    recs += [dict(train(s, reward=0.5, entropy=0.1, zero_var=0.0), policy_entropy=None if s % 2 else 0.1)
             for s in range(5, 15)]
    mon, alarms = run(recs)
    assert [a["signal"] for a in alarms] == ["entropy"]
