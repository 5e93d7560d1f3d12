"""What a real run runs on, said in its first lines: the device, each model's dtype and
quantization, and the log-prob backend; and the choices that depend on the card.

    device cuda (NVIDIA RTX 4060, 8 GB) · policy bf16 + LoRA · simulators NF4 ×4 adapters · log-probs triton

`pick_dtype` chooses the models' precision for `--dtype auto`: bfloat16 on a CUDA card of
compute capability 8.0 or more (Ampere, Ada, Hopper), float32 below (on Turing, RTX 20xx /
GTX 16xx / T4, bf16 is emulated, although `torch.cuda.is_bf16_supported()` says True) and on
the CPU. float16 is refused: its range zeroes most of a small model's logit gradient, and
minscope has no loss scaling. `cpu_build_note` says when the installed torch is a CPU-only
build, the usual reason a laptop with a GPU trains on its CPU.
"""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
CUDA_INSTALL = ("pip install torch --index-url https://download.pytorch.org/whl/cu128 "
                "(https://pytorch.org/get-started/locally/ picks the index for your driver)")


def cpu_build_note(requested: str | None) -> str | None:
    """One line when `--device auto` runs on the CPU because this torch has no CUDA in it."""
    if requested not in (None, "auto") or torch.cuda.is_available():
        return None
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return None
    if torch.version.cuda is None:
        return ("note: this torch is a CPU-only build (torch.version.cuda is None), so the run uses the CPU "
                f"even if the machine has an NVIDIA GPU; for the CUDA build: {CUDA_INSTALL}")
    return None


def pick_dtype(name: str | None, device: str) -> torch.dtype:
    """The models' dtype for `--dtype NAME` (None or "auto": bf16 on CUDA with compute
    capability >= 8.0, float32 otherwise)."""
    if name in (None, "auto"):
        if device.startswith("cuda") and torch.cuda.is_available():
            major, _ = torch.cuda.get_device_capability(torch.device(device))
            return torch.bfloat16 if major >= 8 else torch.float32
        return torch.float32
    if name == "float16":
        raise SystemExit("--dtype float16: not supported; without loss scaling (which minscope lacks) fp16 "
                         "rounds most of a small model's logit gradient to 0. Use bfloat16 (compute capability "
                         "8.0+) or float32")
    if name not in DTYPES:
        raise SystemExit(f"--dtype {name}: choose auto, float32 or bfloat16")
    return DTYPES[name]


def describe_device(device: torch.device | str) -> str:
    """"cuda (NVIDIA RTX 4060, 8 GB)", "cpu", "mps"."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    props = torch.cuda.get_device_properties(device)
    return f"cuda ({props.name}, {props.total_memory / 2**30:.0f} GB)"


def is_4bit(model) -> bool:
    try:
        import bitsandbytes as bnb
    except ImportError:
        return False
    return any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())


def precision(model) -> str:
    """"bf16", "fp32", or "NF4" for a bitsandbytes 4-bit base."""
    if is_4bit(model):
        return "NF4"
    return SHORT.get(next(model.parameters()).dtype, str(next(model.parameters()).dtype))


def adapters_of(model) -> int:
    return len(getattr(model, "peft_config", {}) or {})


def startup_line(models, backend: str) -> str:
    """The run's first line: device, the policy's and the simulators' precision, log-prob backend."""
    policy = models.policy_model
    parts = [f"device {describe_device(next(policy.parameters()).device)}", f"policy {precision(policy)} + LoRA"]
    sim = models.sim_model
    if sim is None:
        parts.append("simulator scripted")
    elif sim is policy:
        parts.append("simulators on the policy's base")
    else:
        n = adapters_of(sim)
        parts.append(f"simulators {precision(sim)}" + (f" ×{n} adapter{'s' * (n != 1)}" if n else ""))
    parts.append(f"log-probs {backend}")
    return " · ".join(parts)
