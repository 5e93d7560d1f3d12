"""The laptop-GPU path, rehearsed on the CPU: the start-up line, a CPU-only torch build, a
failed first attempt, Triton's fallback, dtype choice by card, and a GPU-saved state resumed
on the CPU. The CUDA branches are reached with a monkeypatched `torch.cuda`."""
import json
from types import SimpleNamespace

import pytest
import torch
from test_real_runs import template_models  # noqa: F401 - the fixture
from test_real_runs import TINY

import train as train_cli
from minscope import hardware, logprobs


def numbers_run(tmp_path, model, *extra):
    return ["--env", "numbers", "--policy", model, "--runs-dir", str(tmp_path), "--name", "run", *TINY, *extra]


def fake_cuda(monkeypatch, major=8, name="NVIDIA GeForce RTX 4060 Laptop GPU", gb=8):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 9))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(name=name, total_memory=gb * 2**30))


def test_the_device_line_names_the_card_and_auto_dtype_follows_its_compute_capability(monkeypatch):
    assert hardware.pick_dtype("auto", "cpu") == torch.float32
    fake_cuda(monkeypatch, major=8)
    assert hardware.describe_device("cuda:0") == "cuda (NVIDIA GeForce RTX 4060 Laptop GPU, 8 GB)"
    assert hardware.pick_dtype("auto", "cuda") == torch.bfloat16
    fake_cuda(monkeypatch, major=7, name="Tesla T4", gb=15)      # Turing: bf16 is emulated there
    assert hardware.pick_dtype(None, "cuda") == torch.float32
    assert hardware.pick_dtype("bfloat16", "cuda") == torch.bfloat16
    with pytest.raises(SystemExit, match="without loss scaling"):
        hardware.pick_dtype("float16", "cuda")


def test_a_cpu_only_torch_build_is_named_with_the_way_to_the_cuda_build(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    note = hardware.cpu_build_note("auto")
    assert "CPU-only build" in note and "download.pytorch.org/whl/cu" in note
    assert hardware.cpu_build_note("cpu") is None                 # asked for the CPU: nothing to say
    monkeypatch.setattr(torch.version, "cuda", "12.8")            # a CUDA build without a visible GPU
    assert hardware.cpu_build_note("auto") is None


def test_a_run_starts_with_its_device_precision_and_backend(tmp_path, template_models, capsys):  # noqa: F811
    train_cli.main(numbers_run(tmp_path, template_models["qwen3"], "--steps", "1", "--eval-every", "1"))
    out = capsys.readouterr().out
    assert "device cpu · policy fp32 + LoRA · simulator scripted · log-probs torch" in out
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["dtype"] == "auto" and saved["logprob_backend"] == "auto"


def test_a_failed_first_attempt_does_not_block_the_same_command(tmp_path, template_models, monkeypatch):  # noqa: F811
    import minscope.methods
    import minscope.runner

    cmd = numbers_run(tmp_path, template_models["qwen3"], "--steps", "1", "--eval-every", "1")
    real_build = minscope.runner.build_real_method

    def oom(where):
        def raise_oom(*a, **k):
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated, {where})")
        return raise_oom
    monkeypatch.setattr(minscope.runner, "build_real_method", oom("at model load"))
    with pytest.raises(torch.OutOfMemoryError):
        train_cli.main(cmd)
    assert not (tmp_path / "run" / "config.json").exists()       # nothing written before the models load
    monkeypatch.setattr(minscope.runner, "build_real_method", real_build)
    real_step = minscope.runner.train_step
    monkeypatch.setattr(minscope.runner, "train_step", oom("at step 0"))
    with pytest.raises(torch.OutOfMemoryError):
        train_cli.main(cmd)
    assert (tmp_path / "run" / "config.json").exists() and not (tmp_path / "run" / "state.pt").exists()
    with pytest.raises(SystemExit, match="already exists"):        # other settings: still refused
        train_cli.main([*cmd, "--lr", "1e-3"])
    monkeypatch.setattr(minscope.runner, "train_step", real_step)
    train_cli.main(cmd)                                           # the same command starts again
    assert (tmp_path / "run" / "state.pt").exists()


def test_triton_launch_failure_falls_back_to_torch(monkeypatch):
    """auto: one tiny Triton launch per process and device; when it raises (no compiler, no
    Python.h, no libcuda), torch is used, with one note."""
    notes = []
    monkeypatch.setattr(logprobs, "_LAUNCHES", {})
    monkeypatch.setattr(logprobs, "triton_available", lambda: True)

    def launch(device):
        raise RuntimeError("Failed to find Python.h\nmore detail")
    monkeypatch.setattr(logprobs, "_tiny_launch", launch)
    monkeypatch.setattr(logprobs.sys, "stderr", SimpleNamespace(write=notes.append, flush=lambda: None))
    on_cuda = logprobs._OnDevice("cuda:0")
    assert logprobs.resolve_backend("auto", on_cuda) == "torch"
    assert logprobs.resolve_backend("auto", on_cuda) == "torch"    # tried once
    text = "".join(notes)
    assert text.count("note: Triton cannot launch") == 1 and "Python.h" in text and "more detail" not in text
    monkeypatch.setattr(logprobs, "_LAUNCHES", {})
    monkeypatch.setattr(logprobs, "_tiny_launch", lambda device: None)
    assert logprobs.resolve_backend("auto", on_cuda) == "triton"
    assert logprobs.backend_for("auto", "cpu") == "torch"


def test_triton_flag_is_refused_on_the_cpu_and_float16_before_any_model(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    base = ["--env", "numbers", "--policy", "no-such-model", "--runs-dir", str(tmp_path), "--device", "cpu"]
    with pytest.raises(SystemExit, match="--logprob-backend triton: Triton's kernels run on CUDA"):
        train_cli.main([*base, "--logprob-backend", "triton"])
    with pytest.raises(SystemExit, match="--dtype float16: not supported"):
        train_cli.main([*base, "--dtype", "float16"])
    assert not any(tmp_path.iterdir())


def test_a_state_saved_on_a_gpu_resumes_where_torch_sees_none(tmp_path, monkeypatch):
    """state.pt written on cuda:0 (its storages tagged so) loads on a machine without CUDA."""
    import torch.serialization

    from minscope.files import load_state

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    with monkeypatch.context() as m:
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save({"step": 4, "policy": dict(model.state_dict()), "policy_opt": opt.state_dict()}, tmp_path / "state.pt")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA"):          # what a plain torch.load does with it
        torch.load(tmp_path / "state.pt", weights_only=False)
    st = load_state(tmp_path / "state.pt", needs=("step", "policy", "policy_opt"))
    assert st["step"] == 4 and st["policy"]["weight"].device.type == "cpu"
    fresh = torch.optim.AdamW(model.parameters())
    fresh.load_state_dict(st["policy_opt"])
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_a_rollout_batch_below_the_group_size_is_refused_in_one_line(tmp_path):
    base = ["--env", "numbers", "--policy", "no-such-model", "--runs-dir", str(tmp_path), "--group-size", "8"]
    with pytest.raises(SystemExit, match="--rollout-batch 4: below --group-size 8; the rollout plays whole groups"):
        train_cli.main([*base, "--rollout-batch", "4"])
    assert not any(tmp_path.iterdir())


def test_a_rollout_batch_below_the_group_size_is_refused_on_the_cpu_too(tmp_path):
    base = ["--env", "numbers", "--policy", "no-such-model", "--runs-dir", str(tmp_path), "--device", "cpu"]
    with pytest.raises(SystemExit, match="--rollout-batch 2: below --group-size 4"):
        train_cli.main([*base, "--group-size", "4", "--rollout-batch", "2"])
    assert not any(tmp_path.iterdir())


def test_the_ratio_at_an_unchanged_policy_is_1_in_bfloat16():
    """bf16: the rollout's log-probs come from its cached decode in bf16, the update's from its
    own forward pass; the update recomputes the old ones, so the first pass's ratio is 1
    (`ratio_dev_max`). Without the recomputation the same episodes' ratios stray."""
    from test_chat_templates import Talk, make_tokenizer

    from minscope.adapters import add_adapters
    from minscope.models import build_tiny_model
    from minscope.rollout import LMSpeaker, rollout
    from minscope.simulators import Frozen
    from minscope.trainer import UpdateConfig, grpo_update, make_optimizer

    tok = make_tokenizer("chatml")
    model = add_adapters(build_tiny_model(tok, "qwen3", hidden_size=32).to(torch.bfloat16), ["policy"],
                         init_lora_weights=False)
    agent = LMSpeaker(model, tok, "agent", adapter="policy", temperature=1.0, max_new_tokens=12)
    partner = Frozen(model, tok, temperature=1.0, max_new_tokens=6)
    torch.manual_seed(0)
    episodes = rollout(Talk(), ["a", "b"], agent, partner, group_size=4)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5] * 2)

    def dev(recompute):
        cfg = UpdateConfig(lr=0.0, weight_decay=0.0, recompute_old=recompute)
        return grpo_update(model, "policy", make_optimizer(model, "policy", cfg), episodes, "agent", adv, cfg,
                           tok.pad_token_id)["ratio_dev_max"]
    recomputed, rollouts = dev(None), dev(False)
    assert recomputed <= 1e-3                    # auto: recomputed for a bf16 model
    assert rollouts > 1e-3                     # the rollout's own bf16 log-probs


def test_the_laptop_bench_reports_step_times_and_names_the_flag_to_lower_on_oom(tmp_path, monkeypatch, capsys):
    """bench/laptop.py (bash bench/gpu.sh runs it first): one line per README command; a
    command that runs out of GPU memory says which flags lower it, and the next one runs."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("laptop", Path(__file__).parent.parent / "bench" / "laptop.py")
    laptop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(laptop)
    calls = []

    def fake_main(argv):
        calls.append(argv)
        if "--simulator-4bit" in argv:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        run = Path(argv[argv.index("--runs-dir") + 1]) / argv[argv.index("--name") + 1]
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text("".join(json.dumps({"kind": "train", "seconds": s}) + "\n"
                                                   for s in (2.0, 3.0, 10.0)))
    monkeypatch.setattr(train_cli, "main", fake_main)
    assert laptop.main(["--runs-dir", str(tmp_path), "--policy", "tiny", "--json", str(tmp_path / "r.json")]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("numbers: step 3.0 s median, 10.0 s max (3 steps)")
    assert out[1].startswith("p4g-4bit: ") and "FAILED: out of GPU memory" in out[1] and "--rollout-batch" in out[1]
    assert [a[a.index("--policy") + 1] for a in calls] == ["tiny", "tiny"]
    assert len(json.loads((tmp_path / "r.json").read_text())) == 2
    for command in laptop.COMMANDS.values():                 # every command is one train.py accepts
        train_cli.parse_args(command.format(policy="smollm2").split())


def test_recomputed_old_logprobs_use_the_adapter_that_sampled_each_row():
    """A population's simulator trains on turns its pool snapshots played: in bf16 their old
    log-probs are recomputed under the snapshot, so the off-policy ratio stays (not 1)."""
    from test_chat_templates import Talk, make_tokenizer

    from minscope.adapters import add_adapters
    from minscope.models import build_tiny_model
    from minscope.rollout import LMSpeaker, rollout
    from minscope.simulators import Frozen
    from minscope.trainer import UpdateConfig, grpo_update, make_optimizer

    tok = make_tokenizer("chatml")
    model = add_adapters(build_tiny_model(tok, "qwen3", hidden_size=32).to(torch.bfloat16),
                         ["simulator", "pool0"], init_lora_weights=False)
    agent = LMSpeaker(model, tok, "agent", adapter="simulator", temperature=1.0, max_new_tokens=6)
    snapshot = Frozen(model, tok, adapter="pool0", temperature=1.0, max_new_tokens=12, name="pool0")
    torch.manual_seed(0)
    episodes = rollout(Talk(), ["a", "b"], agent, snapshot, group_size=4)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5] * 2)
    cfg = UpdateConfig(lr=0.0, weight_decay=0.0)

    def dev(**kw):
        return grpo_update(model, "simulator", make_optimizer(model, "simulator", cfg), episodes, "partner", adv,
                           cfg, tok.pad_token_id, **kw)["ratio_dev_max"]
    assert dev(sampled_by=lambda ep: "pool0") > 0.05        # the snapshot's log-probs: off-policy
    assert dev() == 0.0                                      # (as if the live adapter had sampled)
