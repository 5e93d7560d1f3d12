"""The closed-loop collapse meter (Eq. 6) on cases whose split is known exactly: the cases
of bench/studies/collapse_meter_cases.py, scripted agents and users, exact values enumerated.

Tolerances: the standard deviations of the estimates over 12 seeds of the settings below
(4 tasks x 100 noise seeds x 8 episodes) were at most 0.0022 (xor), 0.0032 / 0.0013
(adaptive: simulator / agent side) and 0.0039 / 0.0041 (noisy adaptive); the bounds are
about five of them."""
import importlib.util
from pathlib import Path

import pytest
import torch

from minscope.envs.base import Episode, turn_noise
from minscope.evaluate import collapse_meter, open_loop_meter

_spec = importlib.util.spec_from_file_location(
    "collapse_meter_cases", Path(__file__).resolve().parents[1] / "bench" / "studies" / "collapse_meter_cases.py")
cases_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases_module)


@pytest.fixture(scope="module")
def cases():
    return cases_module.cases()


def meter(case, **kw):
    env, agent, partner, _ = case
    return collapse_meter(env, agent, partner, env.tasks(), n_ref=100, n_resample=8, n_mode=2, seed=0, **kw)


def test_echo_reads_zero_zero_closed_loop_and_only_open_loop_blames_the_simulator(cases):
    """The agent repeats the simulator's coin: every episode scores 1."""
    m = meter(cases["echo"])
    assert (m["sim_side_var"], m["agent_side_var"], m["total_var"]) == (0.0, 0.0, 0.0)
    env, agent, partner, _ = cases["echo"]
    old = open_loop_meter(env, agent, partner, env.tasks(), n_ref=100, n_resample=8, n_mode=2)
    assert old["sim_side_var"] > 0.2 and old["total_var"] == 0.0


def test_reactive_xor_is_all_agent_side(cases):
    """R = the agent's own coin, whatever the simulator said: no variance within a row."""
    m = meter(cases["reactive xor"])
    assert m["sim_side_var"] == 0.0
    assert m["agent_side_var"] == pytest.approx(0.25, abs=0.012)


def test_independent_xor_is_all_simulator_side(cases):
    m = meter(cases["xor"])
    assert m["sim_side_var"] == pytest.approx(0.25, abs=0.012)
    assert m["agent_side_var"] == pytest.approx(0.0, abs=0.012)


@pytest.mark.parametrize("name, sim_tol, agent_tol", [("adaptive", 0.016, 0.0065), ("noisy adaptive", 0.02, 0.02)])
def test_toy_persuaders_against_the_real_users_match_the_enumerated_split(cases, name, sim_tol, agent_tol):
    """The best adaptive persuader (deterministic: agent-side 0) and a noisy one (a big ask
    with probability 0.3 per turn, 8 noise cells), against the exact real users."""
    m = meter(cases[name])
    exact = cases[name][3]
    assert m["sim_side_var"] == pytest.approx(exact["sim_side_var"], abs=sim_tol)
    assert m["agent_side_var"] == pytest.approx(exact["agent_side_var"], abs=agent_tol)
    assert m["sim_side_var"] + m["agent_side_var"] == pytest.approx(exact["total_var"], abs=0.025)
    assert exact["sim_side_var"] + exact["agent_side_var"] == pytest.approx(exact["total_var"], abs=1e-12)


def test_open_loop_meter_misreads_the_deterministic_adaptive_persuader(cases):
    env, agent, partner, exact = cases["adaptive"]
    old = open_loop_meter(env, agent, partner, env.tasks(), n_ref=100, n_resample=8, n_mode=2)
    assert old["agent_side_var"] > 0.05 and old["sim_side_var"] < exact["sim_side_var"] - 0.05


def test_an_lm_speaker_with_fixed_noise_draws_the_same_tokens_and_reacts(tokenizer):
    """Inverse-CDF sampling from the episode's noise: the same seed and history give the same
    reply; another history (what the simulator said) may change it; no seed: torch's stream."""
    from minscope.envs.wordgame import WordGame
    from minscope.models import build_tiny_model
    from minscope.rollout import LMSpeaker

    torch.manual_seed(0)
    speaker = LMSpeaker(build_tiny_model(tokenizer, "qwen3", hidden_size=32), tokenizer, "agent", max_new_tokens=5)
    env = WordGame()

    def episodes(seed, n=6):
        eps = [Episode(task="river", group=0) for _ in range(n)]
        for ep in eps:
            ep.info["noise"] = {"agent": seed}
        return eps
    a = [t.text for t in speaker.respond(episodes(7), env)]
    torch.manual_seed(123)                       # torch's generator does not matter
    b = [t.text for t in speaker.respond(episodes(7), env)]
    c = [t.text for t in speaker.respond(episodes(8), env)]
    assert a == b and len(set(a)) == 1 and a != c
    assert turn_noise(Episode(task="river", group=0), "agent") is None


def test_sampling_with_uniforms_is_the_inverse_cdf(tokenizer):
    """Token = the first whose cumulative probability exceeds u, its log-prob the model's."""
    from minscope.models import build_tiny_model
    from minscope.sampling import sample

    torch.manual_seed(0)
    model = build_tiny_model(tokenizer, "qwen3", hidden_size=32)
    prompt = tokenizer("say river", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)
    cdf = probs.cumsum(-1)
    u = torch.tensor([[0.05], [0.5], [0.95]])
    ids, logps = sample(model, [prompt] * 3, tokenizer.pad_token_id, set(), 1, uniforms=u)
    for (tok,), (lp,), x in zip(ids, logps, u[:, 0]):
        assert (cdf[tok - 1] if tok else 0.0) <= x < cdf[tok]
        assert lp == pytest.approx(float(probs[tok].log()), abs=1e-4)
