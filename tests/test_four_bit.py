"""A 4-bit (bitsandbytes NF4) simulator population on the CPU, with the built-in SmolLM2.

The converted GGUF checkpoint holds de-quantized fp32 weights; `--simulator-4bit` quantizes the
simulators' base to NF4 as it loads (minscope.models.four_bit_kwargs) while the policy stays in
float32, and Population Co-Training trains the pool's LoRA adapters on that one shared NF4 base.
Kept small: 1 group of 2, 2 turns of 4 tokens, 2 steps. P4G's parsed reward is 0 for nearly every
4-token dialogue, so the test scores episodes 1, 0, 1, 0, ... in the order they end: every
group then has a spread, and both updates run (the machinery is tested, not learning).
--no-grad-checkpointing keeps the rollout on the decode path that once sent a 4-bit layer's
packed weight to F.linear (minscope/lean.py now leaves quantized models to their own forward).
"""
import json

import bitsandbytes as bnb
import pytest
import torch
from safetensors.torch import load_file
from test_smollm2 import CACHE, P4G_CSV

import train as train_cli
from minscope import runner
from minscope.envs.p4g import P4GEnv


def linear4bit(model) -> int:
    return sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())


def test_a_4bit_simulator_population_trains_two_steps_of_smollm2_on_the_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MINSCOPE_CACHE", str(CACHE))
    calls, score = [], P4GEnv.score

    def alternating(self, episode):
        calls.append(episode)
        return float(len(calls) % 2), score(self, episode)[1]
    monkeypatch.setattr(P4GEnv, "score", alternating)
    built, build = [], runner.build_real_method
    monkeypatch.setattr(runner, "build_real_method", lambda *a, **k: built.append(build(*a, **k)) or built[-1])
    train_cli.main(["--env", "p4g", "--data", str(P4G_CSV), "--policy", "smollm2", "--simulator", "smollm2",
                    "--method", "population", "--simulator-4bit", "--device", "cpu", "--steps", "2",
                    "--groups", "1", "--group-size", "2", "--max-turns", "2", "--max-new-tokens", "4",
                    "--micro-batch", "2", "--no-grad-checkpointing", "--eval-every", "2", "--lr", "1e-3", "--sim-lr", "1e-3",
                    "--runs-dir", str(tmp_path), "--name", "run"])
    assert "device cpu · policy fp32 + LoRA · simulators NF4" in capsys.readouterr().out
    (models, method), = built
    assert models.sim_model is not models.policy_model
    assert linear4bit(models.sim_model) > 0 and linear4bit(models.policy_model) == 0
    assert {p.device.type for p in models.sim_model.parameters()} == {"cpu"}
    run = tmp_path / "run"
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [0, 1]
    assert not any(r["skipped_update"] or r["sim_skipped_update"] for r in steps)
    for who in ("policy", "simulator"):
        first, last = (load_file(str(run / f"{who}-step{s}" / who / "adapter_model.safetensors")) for s in (0, 2))
        assert any(not torch.equal(first[k], last[k]) for k in first), f"the {who} adapter did not move"
    assert json.loads((run / "config.json").read_text())["simulator_4bit"] is True


def test_load_in_4bit_reads_a_converted_gguf_checkpoint_onto_the_device_asked(monkeypatch):
    """The converted config's GGUF note is dropped (transformers would refuse to merge it with a
    BitsAndBytesConfig), and device_map pins the base to the run's device (no cuda:0 by default)."""

    from minscope.checkpoints import resolve_checkpoint
    from minscope.models import four_bit_kwargs

    monkeypatch.setenv("MINSCOPE_CACHE", str(CACHE))
    kw = four_bit_kwargs(resolve_checkpoint("smollm2"), torch.float32, "cpu", offline=True)
    assert getattr(kw["config"], "quantization_config", None) is None
    assert kw["device_map"] == {"": "cpu"} and kw["quantization_config"].bnb_4bit_quant_type == "nf4"
    assert four_bit_kwargs(resolve_checkpoint("smollm2"), torch.float32, "cuda", True)[
        "quantization_config"].bnb_4bit_compute_dtype == torch.float32        # a card below compute capability 8.0
    assert four_bit_kwargs(resolve_checkpoint("smollm2"), torch.bfloat16, "cuda", True)[
        "quantization_config"].bnb_4bit_compute_dtype == torch.bfloat16


@pytest.mark.parametrize("flag", ["--simulator-4bit"])
def test_the_4bit_flags_are_refused_by_the_toy(tmp_path, capsys, flag):
    with pytest.raises(SystemExit):
        train_cli.main(["--env", "toy", flag, "--runs-dir", str(tmp_path)])
    assert flag in capsys.readouterr().err
