"""Real-model runs (`train.py --env p4g`) with the real Qwen3 and Llama 3 chat templates, their
memory features (gradient checkpointing, rollouts in chunks) and per-phase timings.

The models are tiny random Qwen3/Llama models saved to folders with a tokenizer carrying
the real template (tests/fixtures/templates), so train.py loads them as downloaded ones.
"""
import copy
import json
import re
from pathlib import Path

import pytest
import torch
from test_chat_templates import Talk, make_tokenizer

import train as train_cli
from minscope.adapters import add_adapters
from minscope.envs.base import Episode
from minscope.envs.p4g import P4GEnv
from minscope.models import build_tiny_model, enable_checkpointing
from minscope.real_models import eval_panel
from minscope.real_tables import training_log
from minscope.rollout import rollout, rollout_batch
from minscope.runfolder import FORMAT_VERSION
from minscope.simulators import Frozen
from minscope.stream import Stream
from minscope.trainer import UpdateConfig, grpo_update, make_optimizer

P4G_CSV = Path(__file__).parent / "fixtures" / "p4g" / "csv"
TINY = ["--groups", "2", "--group-size", "2", "--steps", "2", "--eval-every", "2", "--max-new-tokens", "6"]


@pytest.fixture(scope="module")
def template_models(tmp_path_factory):
    """A tiny model per real template ("qwen3" on a Qwen3 body, "llama3" on a Llama body),
    its tokenizer trained on the P4G prompts."""
    env = P4GEnv(P4G_CSV)
    corpus = [m["content"] for t in env.tasks("all") for m in env.agent_messages(t) + env.partner_messages(t)]
    root = tmp_path_factory.mktemp("template-models")
    out = {}
    for kind, arch in (("qwen3", "qwen3"), ("llama3", "llama"), ("broken", "qwen3")):
        tok = make_tokenizer("qwen3" if kind == "broken" else kind, corpus, vocab_size=800)
        if kind == "broken":   # numbers every message: the history cannot be extended turn by turn
            tok.chat_template = ("{%- for m in messages %}{{ loop.index ~ ' ' ~ m.role ~ ': ' ~ m.content ~ "
                                 "'<|im_end|>' }}{%- endfor %}{%- if add_generation_prompt %}{{ 'assistant: ' }}"
                                 "{%- endif %}")
        build_tiny_model(tok, arch, hidden_size=32, seed=0).save_pretrained(root / kind)
        tok.save_pretrained(root / kind)
        out[kind] = str(root / kind)
    return out


def train(tmp_path, model_dir, *extra, method="population"):
    train_cli.main(["--env", "p4g", "--data", str(P4G_CSV), "--policy", model_dir, "--simulator", model_dir,
                    "--method", method, "--runs-dir", str(tmp_path), "--name", "run", *TINY, *extra])
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(ln) for ln in lines]


@pytest.mark.parametrize("kind", ["qwen3", "llama3"])
def test_a_real_template_run_keeps_every_stream_exact_and_logs_phase_timings(tmp_path, template_models, kind):
    recs = train(tmp_path, template_models[kind])
    steps = [r for r in recs if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [0, 1]
    for r in steps:
        assert r["exact_stream_frac"] == 1.0
        assert r["rollout_s"] > 0 and r["update_s"] > 0
        assert r["rollout_s"] + r["update_s"] == pytest.approx(r["seconds"])
        if "tokens_generated" in r:    # counted where the speakers count their tokens
            assert r["tokens_generated"] > 0 and r["tokens_prefilled"] > 0
    evals = [r for r in recs if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2]
    assert all(r["eval_s"] > 0 and r["eval_temperature"] == 0.0 for r in evals)
    log = "\n".join(training_log(tmp_path / "run"))
    assert "policy and simulators greedy" in log and "| eval_s" not in log
    assert "Time per training step (mean over 2 steps): rollout " in log
    assert "Exact token streams: 1.00 of the episodes" in log
    # the run wrote its report when it ended: the training log, the curves, and report.html with
    # the dialogues it kept (the first and last evaluation and training step), nothing external
    assert "## Training log" in (tmp_path / "run" / "report.md").read_text()
    page = (tmp_path / "run" / "report.html").read_text()
    assert "data:image/png;base64," in page and not re.search(r'(src|href)="(?!data:)', page)
    for caption in ("evaluation, step 0", "evaluation, step 2", "training, step 0", "training, step 1"):
        assert caption in page
    assert "with train-simulator, task" in page


def test_a_template_that_rewrites_the_history_stops_the_run_with_a_clear_message(tmp_path, template_models):
    with pytest.raises(SystemExit, match="exact_stream_frac 0.00 < 0.9.*chat template"):
        train(tmp_path, template_models["broken"], method="single")


def test_checkpointing_and_prefix_sharing_are_on_by_default_and_turning_them_off_changes_only_the_cost(
        tmp_path, template_models, capsys, monkeypatch):
    """--no-prefix-sharing: the plain path (each episode encodes its group's shared prompt) in
    the rollout and the update: the same episodes and rewards, more prefilled ids. (Equal
    losses and gradients: tests/test_prefix.py; here the tiny model's updates are skipped.)
    --no-grad-checkpointing keeps the activations; it changes no episode either."""
    from minscope import real_models, runner

    built, build = [], runner.build_real_method
    monkeypatch.setattr(runner, "build_real_method", lambda *a, **k: built.append(build(*a, **k)) or built[-1])
    on = [r for r in train(tmp_path / "on", template_models["qwen3"], "--steps", "1", method="single")
          if r["kind"] == "train"]
    out = capsys.readouterr().out
    assert "gradient checkpointing on" in out and "shared prompts encoded once per group" in out
    off = [r for r in train(tmp_path / "off", template_models["qwen3"], "--steps", "1", "--no-prefix-sharing",
                            "--no-grad-checkpointing", method="single") if r["kind"] == "train"]
    out = capsys.readouterr().out
    assert "gradient checkpointing off" in out and "shared prompts encoded once per episode" in out
    (models_on, method_on), (models_off, method_off) = built
    assert method_on.policy_cfg.prefix_sharing and not method_off.policy_cfg.prefix_sharing
    assert all(s.share_prefix for s in real_models.speakers_of(method_on, models_on))
    assert not any(s.share_prefix for s in real_models.speakers_of(method_off, models_off))
    for a, b in zip(on, off, strict=True):
        assert a["train_reward"] == b["train_reward"] and a["tokens_generated"] == b["tokens_generated"]
        assert a["tokens_prefilled"] < b["tokens_prefilled"]


def test_checkpointing_gives_the_same_loss_and_update_with_peft_and_the_fused_loss():
    """Gradient checkpointing only trades memory for recomputation: one GRPO update of a
    LoRA adapter on a tiny Qwen3 (fused log-prob path, micro-batches) gives the same loss
    and the same adapter weights with and without it."""
    tok = make_tokenizer("qwen3")
    torch.manual_seed(0)
    base = build_tiny_model(tok, "qwen3", hidden_size=32, num_layers=2)
    gen = torch.Generator().manual_seed(0)
    episodes = []
    for i in range(4):
        n = 20 + 3 * i
        ids = torch.randint(0, len(tok), (n,), generator=gen).tolist()
        mask = [0] * 8 + [1] * (n - 8)
        logp = [-(1 + 0.1 * j) if m else 0.0 for j, m in enumerate(mask)]
        episodes.append(Episode(task=i, group=i // 2, info={"streams": {"agent": Stream(ids, mask, logp)}}))
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    results = []
    for checkpointing in (False, True):
        model = copy.deepcopy(base)
        layers = enable_checkpointing(model) if checkpointing else 0
        assert layers == (2 if checkpointing else 0)
        torch.manual_seed(1)                      # the same random adapter both times
        model = add_adapters(model, ["policy"], init_lora_weights=False)
        cfg = UpdateConfig(lr=1e-2, beta=0.005, micro_batch=3)
        stats = grpo_update(model, "policy", make_optimizer(model, "policy", cfg), episodes, "agent", adv, cfg,
                            tok.pad_token_id)
        params = {k: v.detach().clone() for k, v in model.named_parameters() if "lora_" in k}
        results.append((stats, params))
    (plain, p0), (ckpt, p1) = results
    assert ckpt["loss"] == pytest.approx(plain["loss"], abs=1e-6)
    assert ckpt["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
    assert p0.keys() == p1.keys() and all(torch.allclose(p0[k], p1[k], atol=1e-6) for k in p0)


def test_rollouts_play_at_most_the_rollout_batch_at_once():
    """--rollout-batch N: whole groups, at most N episodes generated at once; group numbers
    (which simulator serves a group, which reference a replay uses) are the same as in one go."""
    tok = make_tokenizer("chatml")
    torch.manual_seed(0)
    model = build_tiny_model(tok, "qwen3", hidden_size=32)
    seen = []

    class Counting(Frozen):
        def respond(self, episodes, env):
            seen.append(len(episodes))
            return super().respond(episodes, env)

    agent = Counting(model, tok, max_new_tokens=3)
    agent.role = "agent"
    partner = Counting(model, tok, max_new_tokens=3)
    with rollout_batch(4):
        episodes = rollout(Talk(), ["a", "b", "c", "d", "e"], agent, partner, group_size=2)
    assert max(seen) == 4 and len(episodes) == 10
    assert [ep.group for ep in episodes] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert [ep.task for ep in episodes[::2]] == ["a", "b", "c", "d", "e"]
    assert all(ep.info["rollout_s"] == episodes[0].info["rollout_s"] > 0 for ep in episodes)
    seen.clear()
    rollout(Talk(), ["a", "b", "c"], agent, partner, group_size=2)   # no limit: all at once
    assert max(seen) == 6


def test_evaluation_simulators_use_the_evaluation_temperature():
    tok = make_tokenizer("chatml")
    model = build_tiny_model(tok, "qwen3", hidden_size=32)
    sim = Frozen(model, tok, temperature=0.7)
    panel = eval_panel({"sim": (sim, "seen"), "scripted": ("not an LM", "real")}, 0.0)
    assert panel["sim"][0].temperature == 0.0 and sim.temperature == 0.7     # a copy
    assert panel["scripted"] == ("not an LM", "real")



def test_thinking_reaches_every_party_of_a_run_and_of_its_evaluation():
    """--thinking: the policy, the training partner (inside Verbalized / Ensemble too) and
    the panel render with thinking on; eval.py sets it as the run was trained."""
    from types import SimpleNamespace

    from minscope.real_models import models_thinking, set_thinking
    from minscope.rollout import LMSpeaker
    from minscope.simulators import Ensemble, Verbalized

    tok = make_tokenizer("qwen3")
    model = build_tiny_model(tok, "qwen3", hidden_size=32)
    policy = LMSpeaker(model, tok, "agent")
    a, b, c = (Frozen(model, tok, name=n) for n in "abc")
    vs = Verbalized(a)
    models = SimpleNamespace(policy=policy, frozen=[a], panel={"b": (b, "seen"), "c": (c, "unseen")})
    method = SimpleNamespace(policy=policy, partner=Ensemble([vs, b]))
    set_thinking(method, models, True)
    assert all(s.thinking for s in (policy, vs.speaker, a, b, c))
    assert policy.chat.render([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")
    models_thinking(models, False)
    assert not any(s.thinking for s in (policy, b, c))
    assert policy.chat.render([{"role": "user", "content": "hi"}]).endswith("<think>\n\n</think>\n\n")


def test_the_collapse_monitor_watches_real_runs(tmp_path, template_models, monkeypatch, capsys):
    # thresholds that fire at once (every group is "zero-variance" above -1): the alarm is
    # logged with its step, printed once and shown in the report's training log
    from minscope import monitor, runner

    fire = monitor.MonitorConfig(window_steps=1, zero_var=-1.0)
    monkeypatch.setattr(runner, "CollapseMonitor", lambda cfg=None, **kw: monitor.CollapseMonitor(fire, **kw))
    recs = train(tmp_path, template_models["qwen3"], method="single")
    alarms = [r for r in recs if r["kind"] == "alarm"]
    assert [(a["signal"], a["step"]) for a in alarms] == [("zero_var", 0)]
    assert capsys.readouterr().out.count("collapse monitor:") == 1
    assert "Collapse monitor (minscope/monitor.py): step 0: zero-variance groups" in "\n".join(
        training_log(tmp_path / "run"))


# --------------------------------------------------------------------------- run settings
def test_every_option_of_train_py_states_its_default():
    """`python train.py --help` shows every default: each option that takes a value says
    "default" in its help (or lists its choices with the default among them)."""
    parser = train_cli.build_parser()
    quiet = [a.option_strings[0] for a in parser._actions
             if a.option_strings and a.nargs != 0 and "default" not in (a.help or "")]
    # a run folder, a data folder and a model name have no default (run_real asks for them)
    assert quiet == ["--resume", "--data", "--repos", "--policy"]
    text = parser.format_help()
    for needle in ("default 250", "smollm2", "default 0.7", "default 0.005", "default 8", "default 16",
                   "gitlab.com/ucdavisnlp/persuasionforgood", "default 50"):
        assert needle in text


def test_real_run_settings_parse_with_their_defaults_and_refuse_what_does_not_apply():
    base = ["--env", "p4g", "--data", "d", "--policy", "m"]
    args = train_cli.parse_args(base)
    assert (args.seed, args.temperature, args.kl, args.lora_r, args.lora_alpha, args.pool_size, args.pool_every,
            args.vs_k, args.sim_reward, args.device) == (0, 0.7, 0.005, 8, 16, 5, 4, 5, None, "auto")
    args = train_cli.parse_args(base + ["--method", "population", "--seed", "3", "--temperature", "1.2", "--kl", "0",
                                        "--lora-r", "4", "--lora-alpha", "32", "--pool-size", "2", "--pool-every", "1",
                                        "--sim-reward", "curriculum", "--device", "cpu"])
    assert (args.seed, args.temperature, args.kl, args.lora_r, args.lora_alpha, args.pool_size, args.pool_every,
            args.sim_reward, args.device) == (3, 1.2, 0.0, 4, 32, 2, 1, "curriculum", "cpu")
    assert train_cli.parse_args(base + ["--method", "vs", "--vs-k", "3"]).vs_k == 3
    for bad in (["--method", "single", "--pool-size", "3"], ["--method", "vs", "--sim-reward", "adversarial"],
                ["--method", "cotrain", "--vs-k", "3"], ["--kl", "-1"], ["--temperature", "0"], ["--lora-r", "0"],
                ["--device", "tpu"]):
        with pytest.raises(SystemExit) as e:
            train_cli.parse_args(base + bad)
        assert e.value.code == 2, bad
    with pytest.raises(SystemExit):                        # the toy has its own settings
        train_cli.parse_args(["--seed", "1"])


def test_a_run_saved_before_the_settings_were_flags_resumes_with_the_values_it_ran_with(tmp_path):
    import argparse

    from minscope import real_args

    (tmp_path / "config.json").write_text(json.dumps({"format": FORMAT_VERSION,
                                                      "env": "p4g", "method": "single", "steps": 4, "lr": 1e-5}))
    args = real_args.restore_args(argparse.Namespace(resume=str(tmp_path), env="toy", steps=None, device=None,
                                                     seed=None, kl=None))
    assert (args.seed, args.temperature, args.kl, args.lora_r, args.lora_alpha, args.pool_size, args.pool_every,
            args.vs_k, args.device) == (0, 0.7, 0.005, 8, 16, 5, 4, 5, "auto")
    assert real_args.setting(argparse.Namespace(), "temperature") == 0.7


def test_real_models_run_on_cuda_then_mps_then_cpu_unless_told(monkeypatch):
    from minscope.models import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert pick_device("auto") == pick_device(None) == "cpu"
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert pick_device("auto") == "mps" and pick_device("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_device("auto") == "cuda" and pick_device("mps") == "mps"


def test_the_divergence_alarm_reads_the_unseen_members_and_their_noise():
    from minscope.monitor import CollapseMonitor
    from minscope.runner import panel_means

    res = {"train-simulator": {"kind": "seen", "mean": 0.5, "se": 0.1},
           "b": {"kind": "unseen", "mean": 0.4, "se": 0.1},
           "seen": {"kind": "group", "mean": 0.5, "se": 0.1}, "unseen": {"kind": "group", "mean": 0.4, "se": 0.1}}
    rec = panel_means(res)
    assert rec["unseen"] == 0.4 and rec["unseen_se"] == 0.1 and rec["panel_mean"] == pytest.approx(0.45)
    mon = CollapseMonitor(panel_key="unseen", real_key=None)
    alarms = []
    for step, (train_r, unseen) in enumerate([(0.2, 0.6), (0.5, 0.5), (0.8, 0.2)]):
        mon.on_record({"kind": "train", "step": 2 * step, "train_reward": train_r})
        alarms += mon.on_record({"kind": "eval", "step": 2 * step + 1, "unseen": unseen, "unseen_se": 0.1})
    assert [a["signal"] for a in alarms] == ["divergence"]     # fell 0.4 > 2 x sqrt(2) x 0.1


def test_checkpoint_selection_never_reads_the_unseen_members():
    from minscope.loop import is_better
    from minscope.runner import CHECKPOINT_SCORE, panel_means

    def evaluation(seen, unseen):
        return panel_means({"train-simulator": {"kind": "seen", "mean": seen, "se": 0.0},
                            "gemma3-270m": {"kind": "unseen", "mean": unseen, "se": 0.0},
                            "seen": {"kind": "group", "mean": seen, "se": 0.0},
                            "unseen": {"kind": "group", "mean": unseen, "se": 0.0}})

    first = evaluation(seen=0.5, unseen=0.1)
    best = {"step": 0, CHECKPOINT_SCORE: first[CHECKPOINT_SCORE]}
    # the unseen member improves a lot, the seen one falls a little: the panel mean rises, but
    # the checkpoint kept is still the first; any change of the unseen member alone changes nothing
    later = evaluation(seen=0.45, unseen=0.9)
    assert later["panel_mean"] > first["panel_mean"] and not is_better(later, best, CHECKPOINT_SCORE)
    assert all(evaluation(0.5, u)[CHECKPOINT_SCORE] == first[CHECKPOINT_SCORE] for u in (0.0, 0.3, 1.0))
    assert is_better(evaluation(seen=0.55, unseen=0.0), best, CHECKPOINT_SCORE)


def test_ensemble_needs_two_training_simulators_and_no_unseen_member_turns_the_divergence_alarm_off(
        tmp_path, template_models, capsys):
    model = template_models["qwen3"]
    for panel in ([], ["--panel", f"unseen:{model}"]):
        with pytest.raises(SystemExit, match="--method ensemble trains against the training simulator and every "
                                             "seen --panel member.*--panel B,C"):
            train(tmp_path, model, *panel, method="ensemble")
    train(tmp_path / "a", model, "--steps", "0", method="single")
    assert capsys.readouterr().err.count("divergence alarm is off; turn it on with --panel unseen:MODEL") == 1
    recs = train(tmp_path / "b", model, "--steps", "0", "--panel", f"unseen:{model}", method="single")
    assert "divergence alarm is off" not in capsys.readouterr().err
    assert "unseen" in recs[0] and "unseen_se" in recs[0]


def test_a_real_run_uses_its_settings_the_monitor_reads_it_and_a_resume_keeps_both(tmp_path, template_models,
                                                                                     monkeypatch, capsys):
    from minscope import monitor, real_models

    built = []
    real_build = real_models.build_method

    def spy(name, policy, frozen, policy_cfg, sim_cfg=None, **kw):
        built.append(dict({k: kw[k] for k in ("seed", "pool_size", "pool_every", "sim_reward", "vs_k")},
                          temperature=policy.temperature, beta=(policy_cfg.beta, sim_cfg.beta),
                          policy_temperature=policy_cfg.temperature))
        return real_build(name, policy, frozen, policy_cfg, sim_cfg, **kw)
    monkeypatch.setattr(real_models, "build_method", spy)
    settings = ["--seed", "3", "--temperature", "0.9", "--kl", "0.02", "--lora-r", "4", "--lora-alpha", "8",
                "--pool-size", "2", "--pool-every", "1", "--sim-reward", "cooperative", "--steps", "1", "--eval-every", "1"]
    train(tmp_path, template_models["qwen3"], *settings)
    run = tmp_path / "run"
    saved = json.loads((run / "config.json").read_text())
    assert {k: saved[k] for k in ("seed", "temperature", "kl", "lora_r", "lora_alpha", "pool_size", "pool_every",
                                  "sim_reward")} == dict(seed=3, temperature=0.9, kl=0.02, lora_r=4, lora_alpha=8,
                                                         pool_size=2, pool_every=1, sim_reward="cooperative")
    adapter = json.loads(next((run / "policy-step1").rglob("adapter_config.json")).read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (4, 8)
    first = built[-1]
    assert first["temperature"] == first["policy_temperature"] == 0.9 and first["beta"] == (0.02, 0.02)
    assert (first["seed"], first["pool_size"], first["pool_every"], first["sim_reward"]) == (3, 2, 1, "cooperative")

    # python -m minscope.monitor reads the real run, and --write keeps other thresholds
    capsys.readouterr()
    monitor.main([str(run), "--set", "window_steps=1", "--set", "zero_var=-1", "--write"])
    out = capsys.readouterr().out
    assert "run                          first step of each signal" in out and "zero_var 0" in out
    assert [r["signal"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "alarm"] == ["zero_var"]

    # the resume keeps every setting (and the monitor's thresholds); a changed one is refused
    with pytest.raises(SystemExit) as e:
        train_cli.main(["--env", "p4g", "--resume", str(run), "--kl", "0.1"])
    assert e.value.code == 2
    train_cli.main(["--env", "p4g", "--resume", str(run), "--steps", "2"])
    assert built[-1] == first
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["kind"] == "train"]
    assert [r["pool_size"] for r in steps] == [1, 2]     # K = 2, a snapshot each step (after it)
    # step 1's snapshot joins after step 1 has played: the step-0 snapshot played every group, alone
    assert [r["pool_full"] for r in steps] == [False, False]
    assert all(r["pool_played"] == [0] * sum(r["served_by"].values()) for r in steps)
    log = "\n".join(training_log(run))
    assert "Population pool (K = 2): full while it played at 0 of 2 training steps (0%)." in log
    assert "The step-0 snapshot (the untrained simulator, RL (Single)'s) played 4 of 4 groups" in log
    again = json.loads((run / "config.json").read_text())
    assert {k: again[k] for k in saved if k not in ("steps",)} == {k: saved[k] for k in saved if k != "steps"}
    assert again["monitor"]["zero_var"] == -1 and again["steps"] == 2


def test_an_environment_with_a_scripted_partner_plays_it_and_the_run_prints_its_reward_curve(
        tmp_path, template_models, capsys):
    """`--env numbers` (and wordgame): the environment's own asker is the training partner and
    the whole panel, no simulator model is loaded, and the run ends with its reward curve."""
    run = ["--env", "numbers", "--policy", template_models["qwen3"], "--runs-dir", str(tmp_path), *TINY]
    train_cli.main([*run, "--name", "run"])
    recs = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps, evals = [r for r in recs if r["kind"] == "train"], [r for r in recs if r["kind"] == "eval"]
    assert [r["served_by"] for r in steps] == [{"asker": 2}, {"asker": 2}]
    assert [set(r) & {"asker", "train-simulator"} for r in evals] == [{"asker"}, {"asker"}]
    out = capsys.readouterr().out
    rewards = " ".join(f"{r['train_reward']:.2f}" for r in steps)
    assert f"training reward per step: {rewards}\n" in out and "evaluation (panel mean) at step: 0: " in out
    assert json.loads((tmp_path / "run" / "config.json").read_text())["scripted_partner"] == "asker"
    with pytest.raises(SystemExit, match="plays its own scripted asker: only --method single applies"):
        train_cli.main([*run, "--name", "vs", "--method", "vs"])
    with pytest.raises(SystemExit, match="plays its own scripted asker; --simulator does not apply"):
        train_cli.main([*run, "--name", "sim", "--simulator", template_models["qwen3"]])


def test_the_realism_anchor_trains_the_persuadee_on_real_transcripts_and_its_draws_resume(tmp_path, template_models):
    import torch
    recs = train(tmp_path, template_models["qwen3"], "--steps", "1", "--eval-every", "1", "--sim-anchor", "0.5",
                 method="cotrain")
    steps = [r for r in recs if r["kind"] == "train"]
    assert steps and all(r["sim_anchor_nll"] > 0 for r in steps)
    run = tmp_path / "run"
    assert json.loads((run / "config.json").read_text())["sim_anchor"] == 0.5
    state = torch.load(run / "state.pt", weights_only=False)
    assert "anchor_rng" in state          # a resumed run draws the transcripts an unbroken one would


@pytest.mark.parametrize("every,full_from,full_steps,zeros", [(4, 17, 3, 25), (2, 9, 11, 14)])
def test_the_report_gives_the_share_of_steps_the_pool_played_full(tmp_path, every, full_from, full_steps, zeros):
    """K = 5 over 20 steps: a snapshot every 4 steps fills the pool for 3 steps, every 2 for 11,
    whether the log says so (pool_full, pool_played) or a log from before says only pool_size."""
    from collections import deque

    from minscope.real_tables import pool_lines

    (tmp_path / "config.json").write_text(json.dumps({"pool_size": 5, "pool_every": every}))
    pool, new, old = deque([0], maxlen=5), [], []      # the snapshot steps; the first taken at step 0
    for step in range(20):                             # as methods.train_step logs them
        full, played = len(pool) == 5, [pool[0], pool[-1]]     # two groups: the oldest, the newest
        if step > 0 and step % every == 0:
            pool.append(step)
        old.append({"kind": "train", "step": step, "pool_size": len(pool)})
        new.append(dict(old[-1], pool_full=full, pool_played=played))
    for recs in (old, new):
        line = pool_lines(recs, tmp_path)[-1]
        assert line.startswith(f"Population pool (K = 5): full while it played at {full_steps} of 20 training "
                               f"steps ({100 * full_steps / 20:.0f}%), from step {full_from}.")
    assert f"The step-0 snapshot (the untrained simulator, RL (Single)'s) played {zeros} of 40 groups" in line
