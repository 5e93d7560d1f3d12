"""Intervals over seeds (minscope.seedstats) and the report's use of them, on small known inputs."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from minscope import report, report_results, report_tables
from minscope.envs.toy_words import INVALID, act_entropy
from minscope.seedstats import paired, t_cdf, t_interval, t_quantile

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("df,q", [(1, 12.706205), (2, 4.302653), (3, 3.182446), (5, 2.570582),
                                  (9, 2.262157), (30, 2.042272)])
def test_t_quantile_matches_the_printed_table(df, q):
    assert t_quantile(0.975, df) == pytest.approx(q, abs=1e-6)
    assert t_quantile(0.025, df) == pytest.approx(-q, abs=1e-6)
    assert t_cdf(t_quantile(0.975, df), df) == pytest.approx(0.975, abs=1e-12)


def test_t_cdf_is_the_cauchy_and_the_closed_form_at_small_df():
    assert t_cdf(1.0, 1) == pytest.approx(0.75)                       # Cauchy: 1/2 + atan(1)/pi
    assert t_cdf(1.0, 2) == pytest.approx(0.5 + 0.5 / math.sqrt(3))   # df 2: 1/2 + t / (2 sqrt(2 + t^2))
    assert t_cdf(0.0, 7) == 0.5 and t_cdf(-2.0, 4) == pytest.approx(1 - t_cdf(2.0, 4))


def test_three_seed_means_give_the_textbook_interval():
    # mean .365, sd .012124, se .0070 -> +- 4.303 * .0070
    ci = t_interval([0.379, 0.358, 0.358])
    assert ci["mean"] == pytest.approx(0.365)
    assert (ci["lo"], ci["hi"]) == (pytest.approx(0.33488, abs=1e-5), pytest.approx(0.39512, abs=1e-5))
    ci = t_interval([0.241, 0.169, 0.103])
    assert (ci["lo"], ci["hi"]) == (pytest.approx(-0.00046, abs=1e-5), pytest.approx(0.34246, abs=1e-5))
    assert t_interval([0.5])["lo"] is None and t_interval([])["mean"] is None


def test_paired_differences_use_the_shared_seeds_and_say_the_verdict():
    a = {0: 0.45, 1: 0.49, 2: 0.47, 7: 0.9}
    b = {0: 0.24, 1: 0.17, 2: 0.10}
    d = paired(a, b)                       # differences .21 .32 .37 over seeds 0-2 only
    assert d["seeds"] == [0, 1, 2] and d["n"] == 3 and d["wins"] == 3
    assert d["mean"] == pytest.approx(0.3)
    half = 4.302653 * math.sqrt(((0.09) ** 2 + 0.02 ** 2 + 0.07 ** 2) / 2) / math.sqrt(3)
    assert (d["lo"], d["hi"]) == (pytest.approx(0.3 - half, abs=1e-6), pytest.approx(0.3 + half, abs=1e-6))
    assert d["verdict"] == "above"
    assert paired({0: 0.3, 1: 0.1, 2: 0.2}, {0: 0.2, 1: 0.2, 2: 0.2})["verdict"] == "tie"
    assert paired({0: 0.1, 1: 0.11, 2: 0.12}, {0: 0.3, 1: 0.3, 2: 0.31})["verdict"] == "below"


def test_act_entropy_counts_a_garbled_act_as_its_own_category():
    assert act_entropy([["probe", "probe"], ["probe"]]) == 0.0
    assert act_entropy([["probe", INVALID]]) == pytest.approx(math.log(2))
    assert act_entropy([["probe", "emotion", INVALID, INVALID]]) == pytest.approx(1.5 * math.log(2))
    assert act_entropy([]) is None


def records(method, seed, finals, panels, steps=(0, 10), acts=None):
    out = []
    for step, real, panel in zip(steps, finals, panels):
        out.append({"kind": "eval", "method": method, "seed": seed, "step": step, "real_users": real,
                    "panel": panel, "real_users_rewards": [real] * 4, "unseen": 0.5, "seen": 0.5})
        if method != "base":
            out.append({"kind": "train", "method": method, "seed": seed, "step": step, "train_reward": 0.5,
                        "policy_entropy": 0.4, "zero_var_frac": 0.0, "act_entropy": acts})
    return out


def test_the_report_gives_seed_intervals_and_paired_differences_at_both_checkpoints(tmp_path):
    # final: single .24 .17 .10, vs .45 .49 .47; best panel ckpt: single's first evaluation
    recs = []
    for seed, (s0, s1, v1) in enumerate([(0.30, 0.24, 0.45), (0.32, 0.17, 0.49), (0.31, 0.10, 0.47)]):
        recs += records("base", seed, [0.31], [0.5], steps=(0,))
        recs += records("single", seed, [s0, s1], [0.4, 0.9], acts=1.2)      # panel picks the final one
        recs += records("vs", seed, [0.3, v1], [0.6, 0.5], acts=0.3)         # panel picks step 0 (0.3)
    res = report_results.summarize(recs, {})
    h = res["methods"]["single"]["heldout"]["real_users"]
    half = 4.302653 * 0.07 / math.sqrt(3)                  # mean .17, sd .07
    assert h["final_seed_ci95"] == [pytest.approx(0.17 - half, abs=1e-6), pytest.approx(0.17 + half, abs=1e-6)]
    assert h["selected_per_seed"] == [0.24, 0.17, 0.10]
    assert res["methods"]["vs"]["heldout"]["real_users"]["selected_per_seed"] == [0.3, 0.3, 0.3]
    assert res["methods"]["vs"]["act_entropy"]["last"] == pytest.approx(0.3)
    p = res["paired"]
    assert p["vs|single|final"]["mean"] == pytest.approx(0.3) and p["vs|single|final"]["verdict"] == "above"
    assert p["vs|single|selected"]["mean"] == pytest.approx(0.3 - 0.17)
    assert p["single|base|final"]["verdict"] == "tie" and "base|single|final" not in p
    md = "\n".join(report_tables.paired_md(res))
    assert "| Verbalized Sampling | RL (Single) | 0.300 (" in md and "| 3/3 | above |" in md
    json.dumps(res)                                       # results.json stays writable


def test_the_seed_table_pools_run_folders_and_leaves_out_unfinished_arms(tmp_path, capsys):
    def run_folder(name, methods, seeds, finished):
        d = tmp_path / name
        (d / "arms").mkdir(parents=True)
        (d / "config.json").write_text(json.dumps({"methods": methods, "seeds": seeds, "steps": 10, "gamma": 8.0,
                                                   "models": {}}))
        for m in methods:
            for s in seeds:
                steps = (0,) if m == "base" else (0, 10) if (m, s) in finished else (0,)
                real = {"base": [0.31], "single": [0.3, 0.1 + s / 100], "vs": [0.3, 0.4 + s / 50]}[m]
                recs = records(m, s, real[:len(steps)], [0.5] * len(steps), steps=steps, acts=1.0)
                (d / "arms" / f"{m}-s{s}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        return str(d)

    a = run_folder("a", ["base", "single", "vs"], [1, 2], {("single", 1), ("single", 2), ("vs", 1), ("vs", 2)})
    b = run_folder("b", ["base", "single", "vs"], [3], {("single", 3)})          # vs-s3 still running
    report.main(["--seed-table", a, b])
    out = capsys.readouterr().out
    assert "seeds with a finished arm: 1, 2, 3" in out and "(note: b/vs-s3: not finished)" in out
    assert "| RL (Single) | 0.120 (" in out                 # .11 .12 .13 over seeds 1-3
    assert "| Verbalized Sampling | RL (Single) | 0.315 (" in out and "| 2/2 |" in out   # seeds 1, 2 only
    with pytest.raises(SystemExit, match="both"):
        report.main(["--seed-table", a, a])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_seed_that_is_not_finite_makes_the_verdict_undefined_not_a_tie(bad):
    # before: NaN comparisons are false, so the interval (NaN, NaN) read as "tie"
    d = paired({0: 0.4, 1: bad, 2: 0.5}, {0: 0.2, 1: 0.2, 2: 0.1})
    assert d["verdict"] == "undefined (seed 1 is not finite)"
    assert paired({0: 0.4, 1: 0.6, 2: 0.5}, {0: 0.2, 1: 0.1, 2: bad})["verdict"] == "undefined (seed 2 is not finite)"


def test_seed_intervals_prints_undefined_for_a_seed_that_is_not_finite(tmp_path):
    table = tmp_path / "t.md"
    table.write_text("## Runs\n\n| method | per seed |\n|---|---|\n| Base | .2 .2 .2 |\n| RL (Single) | .1 .2 .3 |\n"
                     "| Ensemble | .4 nan .5 |\n")
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "seed_intervals.py"), str(table), "## Runs"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "| Ensemble | RL (Single) |" in run.stdout and "| undefined (seed 1 is not finite) |" in run.stdout
    assert "| tie |" not in run.stdout.split("| Ensemble | RL (Single) |")[1].splitlines()[0]
