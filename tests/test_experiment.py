"""The toy experiment harness: resumable runs, results.json, report and plots."""
import json
import math

import pytest

from minscope import experiment, report, report_results
from minscope.runfolder import format_fields
from minscope.toy_models import ToyModelConfig

TINY_MODELS = ToyModelConfig(hidden=32, vocab=640, transcripts=120, vs_examples=40, sim_a_steps=10, vs_steps=10,
                             sim_steps=5, policy_steps=5, aligned_steps=10, batch=8, workers=1)


def tiny_config(name, methods=("base", "single", "population"), ablations=()):
    return experiment.ToyConfig(name=name, methods=methods, seeds=(0,), steps=4, groups=2, group_size=2,
                                eval_every=2, eval_episodes=1, final_episodes=6, meter_every=4, workers=1, pool_every=1,
                                diversity_samples=2, diversity_episodes=8,
                                models=TINY_MODELS, ablations=ablations)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def records(run_dir):
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        r.pop("seconds", None)           # wall time differs between runs
        out.append(r)
    return out


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache):
    """One uninterrupted run of base, RL (Single) and Population, shared by the tests below
    (every arm depends only on its method, seed and settings, not on the other arms)."""
    cfg = tiny_config("toy")
    return cfg, experiment.run(cfg, tmp_path_factory.mktemp("straight") / "a", cache, log=lambda *a: None,
                               progress=False)


def of(recs, methods):
    return [r for r in recs if r.get("method") in methods]


@pytest.mark.parametrize("methods, ablations", [
    (("base", "single", "population"), ()),
    (("base",), ("cotrain:anchor",)),          # interrupted in the anchored arm: its batches too
])
def test_interrupted_run_resumes_to_the_same_numbers(tmp_path, cache, straight, methods, ablations):
    cfg = tiny_config("toy", methods=methods, ablations=ablations)
    if cfg == straight[0]:
        straight_run = straight[1]
    else:
        straight_run = experiment.run(cfg, tmp_path / "a", cache, log=lambda *a: None, progress=False)
    with pytest.raises(KeyboardInterrupt):
        experiment.run(cfg, tmp_path / "b", cache, log=lambda *a: None, progress=False, stop_after=2)
    resumed = experiment.run(cfg, tmp_path / "b", cache, resume=True, log=lambda *a: None, progress=False)
    assert records(resumed) == records(straight_run)
    assert json.loads((resumed / "config.json").read_text())["format"] == format_fields()["format"]
    # the compute totals (minscope/compute.py) continue across the interruption: every record's
    # total is the steps' compute so far, from the saved state, not from 0 at the resumed step
    from minscope import compute

    for method, _ in cfg.arms():
        total = compute.totals()
        for r in (r for r in records(resumed) if r["method"] == method and r["kind"] in ("train", "eval")):
            if r["kind"] == "train":
                total = compute.add(total, r["compute"])
            assert r["compute_total"] == total
        assert (total["flops"] > 0) == (method != "base")


def test_evaluation_does_not_change_training(tmp_path, cache, straight):
    # evaluations and the collapse meter draw from their own random streams, so evaluating
    # more often (and metering a Population arm, whose partner draws pool slots) leaves every
    # training step as it was
    import dataclasses

    cfg = tiny_config("toy", methods=("single", "population"))
    often = dataclasses.replace(cfg, eval_every=1, meter_every=1)
    train = lambda recs: [r for r in recs if r["kind"] == "train"]   # noqa: E731
    a = of(records(straight[1]), cfg.methods)          # the same arms, run beside the base arm
    b = records(experiment.run(often, tmp_path / "b", cache, log=lambda *a: None, progress=False))
    assert len(train(a)) == 8 and train(a) == train(b)
    assert len([r for r in b if "meter" in r]) > len([r for r in a if "meter" in r])
    # pool diversity measured every other step: training and evaluations as they were
    rare = experiment.run(dataclasses.replace(cfg, pool_measure_every=2), tmp_path / "c", cache,
                          log=lambda *a: None, progress=False)
    assert [r for r in of(records(rare), cfg.methods) if r["kind"] != "pool"] == [r for r in a if r["kind"] != "pool"]
    assert [r["step"] for r in records(rare) if r["kind"] == "pool"] == [0, 2, cfg.steps - 1]   # and the last


def test_arms_in_this_process_train_on_one_thread_like_the_workers(tmp_path, cache, monkeypatch):
    """A toy arm's numbers depend on the CPU threads summing its matrix products (seed 0's RL
    (Single): 0.241 on one thread, 0.246 on two), so arms train on one thread wherever they
    run: in a pool worker (armpool.worker_init) and in this process (workers=1), which gets
    its own thread count back after."""
    import torch

    seen = []

    def fake_arm(toy, method, seed, run_dir, stop_after, progress):
        seen.append(torch.get_num_threads())
        return method, seed, 0.0

    monkeypatch.setattr(experiment, "_run_logged", fake_arm)
    monkeypatch.setattr(experiment, "merge_metrics", lambda run_dir, cfg: None)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        experiment.run(tiny_config("toy", methods=("base", "single")), tmp_path, cache, log=lambda *a: None,
                       progress=False)
        assert seen == [1, 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_final_checkpoint_reevaluates_to_the_logged_number(cache, straight):
    import torch

    from minscope.adapters import load_adapter_state

    cfg, run_dir = straight
    logged = [r for r in of(records(run_dir), ("single",)) if r["kind"] == "eval"][-1]
    toy = experiment.Toy(cfg, cache, progress=False)
    m = toy.method("single", 0)
    load_adapter_state(m.policy.model, "policy", torch.load(run_dir / "arms" / "single-s0.pt",
                                                            weights_only=False)["policy"])
    again = experiment.eval_record(toy, m, "single", 0, cfg.steps, final=True)
    assert again["real_users_rewards"] == logged["real_users_rewards"]
    assert again["panel"] == logged["panel"]


def test_cotraining_starts_from_the_aligned_model_at_the_rollout_temperature(cache):
    import dataclasses

    import torch

    cfg = tiny_config("toy", methods=("base",))
    toy = experiment.Toy(cfg, cache, progress=False)
    aligned2, _ = toy.models.aligned(2.0)
    m = toy.method("population:g2", 0)
    assert m.partner.temperature == cfg.temperature == 1.0 and m.sim_cfg.temperature == 1.0
    with m.partner.model.disable_adapter():       # the base under the LoRA is the gamma-2 model
        x = torch.tensor([[5, 6, 7]])
        assert torch.equal(m.partner.model(x).logits, aligned2(x).logits)
    old = experiment.Toy(dataclasses.replace(cfg, sim_start="sharpened"), cache, progress=False).method("cotrain", 0)
    assert old.partner.temperature == 1.0 / cfg.gamma


def test_simulator_optimiser_knobs_reach_its_update(cache):
    """sim_beta / sim_weight_decay / sim_epochs: the paper's by default, others on request."""
    import dataclasses

    cfg = tiny_config("toy", methods=("base",))
    default = experiment.Toy(cfg, cache, progress=False).method("cotrain", 0)
    assert (default.sim_cfg.beta, default.sim_cfg.weight_decay, default.sim_cfg.epochs) == (0.005, 0.1, 1)
    assert default.sim_opt.param_groups[0]["weight_decay"] == 0.1
    older = dataclasses.replace(cfg, sim_beta=0.0, sim_weight_decay=0.0, sim_epochs=2)
    m = experiment.Toy(older, cache, progress=False).method("population", 0)
    assert (m.sim_cfg.beta, m.sim_cfg.weight_decay, m.sim_cfg.epochs) == (0.0, 0.0, 2)
    assert m.sim_opt.param_groups[0]["weight_decay"] == 0.0
    assert m.policy_cfg.beta == cfg.beta and m.policy_cfg.epochs == cfg.epochs   # the policy's: untouched


def test_existing_run_is_not_overwritten_without_resume(tmp_path, cache):
    cfg = tiny_config("toy", methods=("base",))
    experiment.run(cfg, tmp_path, cache, log=lambda *a: None, progress=False)
    with pytest.raises(SystemExit, match="--resume"):
        experiment.run(cfg, tmp_path, cache, log=lambda *a: None, progress=False)


def test_report_writes_results_plots_and_markdown(tmp_path, cache):
    cfg = tiny_config("toy", methods=("base", "single", "vs"), ablations=("cotrain:anchor+batch",))
    assert cfg.arms() == [("base", 0), ("single", 0), ("vs", 0), ("cotrain:anchor+batch", 0)]
    logged = []
    run_dir = experiment.run(cfg, tmp_path, cache, log=logged.append, progress=False)
    reference = {"random": 0.1, "best_fixed": 0.3, "best_adaptive": 0.7}
    results = report.write_report(run_dir, reference)
    saved = json.loads((run_dir / "results.json").read_text())
    assert saved["reference"] == reference
    for method in ("base", "single", "vs"):
        r = saved["methods"][method]
        h = r["heldout"]["real_users"]
        assert {"final_mean", "final_ci95", "best_mean"} <= set(h)
        assert h["final_ci95"][0] <= h["final_mean"] <= h["final_ci95"][1]
        assert r["heldout"]["unseen"]["final_mean"] is not None
    for key in ("train_reward", "entropy", "act_entropy", "zero_variance"):
        assert set(saved["methods"]["single"][key]) == {"first", "last"}
    # the act-level entropy (8 categories: 7 acts and 'garbled'), logged per step and evaluation
    assert 0 <= saved["methods"]["single"]["act_entropy"]["last"] <= math.log(8)
    assert saved["methods"]["vs"]["final_act_entropy"] is not None
    assert saved["paired"]["vs|single|final"]["n"] == 1          # one seed: no interval
    assert saved["paired"]["vs|single|final"]["lo"] is None
    # the last evaluation measures the real users with `final_episodes` per persona (4 personas)
    evals = [r for r in records(run_dir) if r["method"] == "single" and r["kind"] == "eval"]
    assert [len(r["real_users_rewards"]) for r in evals] == [4 * 4, 4 * 4, 6 * 4]
    assert (run_dir / "curves.png").stat().st_size > 1000
    md = (run_dir / "report.md").read_text()
    assert "Verbalized Sampling" in md
    # training compute: per arm in results.json and report.md (ratio to RL (Single)), and plotted
    assert (run_dir / "compute.png").stat().st_size > 1000
    comp = {m: saved["methods"][m]["compute"] for m in ("base", "single", "vs")}
    assert comp["single"]["vs_single"] == 1.0 and comp["base"]["flops"] == 0
    assert comp["vs"]["sim_decoded"] > comp["single"]["sim_decoded"]        # k candidates per simulator turn
    assert "## Training compute" in md and "![compute.png](compute.png)" in md
    # ten SFT steps do not make faithful simulators: the run and the report say so
    assert any(line.startswith("warning: the fidelity check fails") for line in logged)
    assert "**The fidelity check fails**" in md
    assert results["methods"]["vs"]["label"] == "Verbalized Sampling"
    # the ablation arm trained its simulator with the anchor, and has its own table
    anchored = [r for r in records(run_dir) if r["method"] == "cotrain:anchor+batch" and r["kind"] == "train"]
    assert len(anchored) == 4 and all("sim_anchor_nll" in r for r in anchored)
    ablation_md = md.split("## Co-Training ablation")[1]
    assert "Co-Training [anchor+batch]" in ablation_md
    assert "Co-Training [anchor+batch]" not in md.split("## Co-Training ablation")[0]
    # the trained simulator's pool diversity, at the evaluations' cadence (10) and the last step; the monitor's table
    pools = [r for r in records(run_dir) if r["kind"] == "pool"]
    assert [r["step"] for r in pools] == [0, cfg.steps - 1] and all(r["method"] == "cotrain:anchor+batch" for r in pools)
    div = saved["methods"]["cotrain:anchor+batch"]["pool_diversity"]
    assert 0.0 <= div["final"]["tv_sim_a"] <= 1.0 and div["final"]["pairwise_tv"] is None   # one live simulator
    assert set(saved["methods"]["single"]["alarms"]) == {"0"}
    assert "## Pool diversity" in md and "## Collapse monitor" in md
    assert (run_dir / "pool_diversity.png").stat().st_size > 1000
    assert "aligned" in json.loads((run_dir / "fidelity.json").read_text())
    check_report_html(run_dir / "report.html", [report_results.label(m) for m, _ in cfg.arms()])
    page = (run_dir / "report.html").read_text()
    single = page.split("RL (Single), seed 0, step 4")[1].split("<h3>")[0]     # the last evaluation's dialogues
    assert "with the real users" in single and "with its training simulator sim-a" in single

    # eval.py: every arm's final and best checkpoints re-evaluated, a section in the report
    import eval as eval_cli
    eval_cli.main([str(run_dir), "--episodes", "1", "--cache-dir", str(cache), "--meter"])
    rows = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert {(r["method"], r["checkpoint"]) for r in rows} == {(m, c) for m, _ in cfg.arms() for c in ("final", "best")}
    assert all(0.0 <= r["real_users"] <= 1.0 for r in rows)
    assert all("meter" in r for r in rows if r["checkpoint"] == "final")
    assert "## Re-evaluation of saved checkpoints" in (run_dir / "report.md").read_text()
    with pytest.raises(SystemExit, match="--report-only"):
        eval_cli.main([str(run_dir), "--report-only", "--meter"])


def check_report_html(path, labels):
    """report.html parses, names every arm, and loads nothing from outside itself."""
    from html.parser import HTMLParser

    refs, text = [], []

    class Page(HTMLParser):
        def handle_starttag(self, tag, attrs):
            refs.extend(v for k, v in attrs if k in ("src", "href") and v)

        def handle_data(self, data):
            text.append(data)
    Page().feed(path.read_text())
    assert refs and all(r.startswith("data:image/png;base64,") for r in refs)      # the plots, inlined
    body = "".join(text)
    assert all(label in body for label in labels)
    assert "Dialogues" in body


def test_atomic_writes_leave_the_old_file_when_interrupted(tmp_path, monkeypatch):
    from minscope import files

    path = tmp_path / "config.json"
    files.write_text_atomic(path, "old")
    files.save_atomic({"step": 1}, tmp_path / "arm.pt")

    def interrupted(src, dst):
        raise KeyboardInterrupt
    monkeypatch.setattr(files.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        files.write_text_atomic(path, "new")
    with pytest.raises(KeyboardInterrupt):
        files.save_atomic({"step": 2}, tmp_path / "arm.pt")
    monkeypatch.undo()
    import torch
    assert path.read_text() == "old" and torch.load(tmp_path / "arm.pt")["step"] == 1
    files.write_text_atomic(path, "new")
    assert path.read_text() == "new"


def test_toy_resume_keeps_the_runs_settings(tmp_path):
    import dataclasses

    import train as train_cli
    run_dir = tmp_path / "toy"
    run_dir.mkdir()
    cfg = tiny_config("toy")
    (run_dir / "config.json").write_text(json.dumps({**dataclasses.asdict(cfg), **format_fields()}, default=list))
    with pytest.raises(SystemExit, match="keeps its settings"):
        train_cli.main(["--resume", str(run_dir), "--steps", str(cfg.steps + 10)])
    with pytest.raises(SystemExit, match="no config.json"):
        train_cli.main(["--resume", str(tmp_path / "elsewhere")])


def test_progress_line_counts_arms_and_estimates_the_time_left(monkeypatch):
    clock = iter([1000.0, 1060.0, 1090.0])
    monkeypatch.setattr(experiment.time, "time", lambda: next(clock))
    jobs = [("vs", 0), ("single", 0), ("single", 1)]
    eta = experiment.ETA(jobs, workers=1)
    assert eta.first().startswith("about ")
    # vs costs ARM_SECONDS["vs"]; after it, the two single arms' share of that pace is left
    expected = 60 * 2 * experiment.arm_cost("single") / experiment.arm_cost("vs")
    assert eta.done("vs") == f"[1/3 arms, 1 min 00 s elapsed, about {experiment._minutes(expected)} left]"
    assert eta.done("single").startswith("[2/3 arms, 1 min 30 s elapsed, about ")
    assert experiment._minutes(59) == "59 s" and experiment._minutes(125) == "2 min 05 s"


def test_workers_default_to_the_available_cores_capped_by_the_arms(monkeypatch):
    from minscope import armpool

    monkeypatch.setattr(armpool.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7}, raising=False)
    assert armpool.cores_available() == 8
    assert armpool.default_workers(16) == 8 and armpool.default_workers(3) == 3 and armpool.default_workers(0) == 1
    assert experiment.ToyConfig().workers == 0      # 0 = the default above, decided when the run starts


def test_shipped_models_are_the_default_settings_and_pass_the_fidelity_gate(tmp_path):
    # what a first run after a clone uses instead of training the models (toy_models.SHIPPED);
    # a change of the settings or of the toy's texts changes the key: rebuild them then
    from minscope import toy_fidelity, toy_models

    cfg = toy_models.ToyModelConfig()
    assert (toy_models.SHIPPED / f"toy-{cfg.key()}").is_dir(), "run: python -m minscope.toy_models --rebuild"
    models = toy_models.ToyModels(tmp_path, cfg, progress=False, log=lambda *a: None)
    missing = [n for n in models.names() if models._load(n) is None]
    assert missing == []                          # everything came from the shipped files
    fid, problems = toy_fidelity.fidelity_gate(models)
    assert problems == [], problems


def test_rebuild_ships_only_models_that_pass_the_fidelity_gate(tmp_path, monkeypatch):
    from minscope import toy_fidelity, toy_models

    shipped = tmp_path / "shipped"
    # ten SFT steps do not make faithful simulators: nothing is shipped
    assert toy_models.rebuild(TINY_MODELS, shipped=shipped, log=lambda *a: None)
    assert not shipped.exists() or not any(shipped.iterdir())
    real_gate = toy_fidelity.fidelity_gate
    monkeypatch.setattr(toy_models, "fidelity_gate", lambda models: (real_gate(models)[0], []))
    assert toy_models.rebuild(TINY_MODELS, shipped=shipped, log=lambda *a: None) == []
    assert [p.name for p in shipped.iterdir()] == [f"toy-{TINY_MODELS.key()}"]
    # a fresh cache is seeded from the shipped files: nothing is trained
    monkeypatch.setattr(toy_models.ToyModels, "train", lambda self, name: pytest.fail(f"trained {name}"))
    models = toy_models.ToyModels(tmp_path / "cache", TINY_MODELS, progress=False, log=lambda *a: None,
                                  shipped=shipped)
    models.build()
    assert models.policy_base() is not None


def test_monitor_rewrites_a_run_folder_without_the_experiment(tmp_path):
    import subprocess
    import sys

    from minscope import monitor

    # the monitor reads run folders through minscope.runfolder: no experiment <-> monitor circle
    code = "import sys, minscope.monitor, minscope.report; sys.exit('minscope.experiment' in sys.modules)"
    from pathlib import Path
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1]).returncode == 0
    run_dir = tmp_path / "toy"
    (run_dir / "arms").mkdir(parents=True)
    cfg = tiny_config("toy", methods=("single", "vs"))
    (run_dir / "config.json").write_text(json.dumps({**experiment.asdict(cfg), **format_fields()}, default=list))
    for method in ("vs", "single"):
        rec = {"kind": "train", "method": method, "seed": 0, "step": 0, "policy_entropy": 1.0, "zero_var_frac": 0.9}
        (run_dir / "arms" / f"{method}-s0.jsonl").write_text(json.dumps(rec) + "\n")
    monitor.main([str(run_dir), "--set", "zero_var=0.5", "--write"])
    merged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["method"] for r in merged if r["kind"] == "train"] == ["single", "vs"]     # the config's order
    assert json.loads((run_dir / "config.json").read_text())["monitor"]["zero_var"] == 0.5
