"""LoRA adapters: many named adapters on one frozen base, and their state.

    base ──┬── "policy"      (trained by GRPO)
           ├── "simulator"   (trained in Co-Training)
           └── "pool0..K-1"  (frozen snapshots of "simulator" for Population Co-Training)

A LoRA adapter on a small model is a few MB, so a population of simulators costs almost
nothing. The reference model for the KL term is the base with adapters disabled
(`use_adapter(model, None)`). What reads PEFT's internals (an adapter's parameters, its
snapshots, the LM head's own adapter in `output_embedding`) is in this file, so an upgrade of
PEFT is checked here.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch


def add_adapters(model, names, r: int = 8, alpha: int = 16, dropout: float = 0.0,
                 target_modules="all-linear", init_lora_weights=True):
    """Wrap `model` with one LoRA adapter per name (all on the same frozen base).

    target_modules: "all-linear" (every linear layer of the body, the usual QLoRA choice)
    or "all-linear+head", which also adapts the LM head: tiny models learn far faster when
    the head can move (`output_embedding` then includes the adapter's update).

    With the default init (B = 0) a new adapter equals the base until trained. Pass
    `init_lora_weights=False` for random, distinct adapters (tests). Returns a PeftModel.
    """
    from peft import LoraConfig, PeftModel, get_peft_model

    if target_modules == "all-linear+head":
        target_modules = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                                 if isinstance(m, torch.nn.Linear)})
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules,
                        init_lora_weights=init_lora_weights, task_type="CAUSAL_LM")
    names = list(names)
    if not isinstance(model, PeftModel):
        model = get_peft_model(model, config, adapter_name=names[0])
        names = names[1:]
    for name in names:
        model.add_adapter(name, config)
    return model


def has_adapter(model, name: str) -> bool:
    return name in getattr(model, "peft_config", {})


def lora_parameters(model, name: str) -> dict[str, torch.nn.Parameter]:
    """The parameters of one adapter, keyed by their name without the adapter name."""
    tag = f".{name}."
    return {k.replace(tag, "."): p for k, p in model.named_parameters() if "lora_" in k and tag in k}


def adapter_state(model, name: str) -> dict[str, torch.Tensor]:
    """A detached CPU copy of one adapter's weights (a snapshot)."""
    return {k: p.detach().to("cpu", copy=True) for k, p in lora_parameters(model, name).items()}


def load_adapter_state(model, name: str, state: dict[str, torch.Tensor]) -> None:
    """Overwrite adapter `name` with a snapshot taken by `adapter_state` (exactly)."""
    params = lora_parameters(model, name)
    missing = set(params) ^ set(state)
    if missing:
        raise KeyError(f"snapshot does not match adapter {name!r}: {sorted(missing)[:3]} ...")
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(state[k].to(p.device, p.dtype))


def adapter_nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def trainable_parameters(model, name: str) -> list[torch.nn.Parameter]:
    """Parameters of adapter `name`, marked trainable; every other parameter frozen."""
    params = lora_parameters(model, name)
    keep = {id(p) for p in params.values()}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)
    return list(params.values())


def save_adapter(model, name: str, path) -> None:
    """Save one adapter in standard PEFT format (adapter_config.json + safetensors)."""
    model.save_pretrained(str(path), selected_adapters=[name])


def load_adapter(model, name: str, path) -> None:
    """Load a PEFT-format adapter saved by `save_adapter` into slot `name`."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    folder = Path(path) / name if (Path(path) / name).exists() else Path(path)
    state = load_file(str(folder / "adapter_model.safetensors"))
    if not has_adapter(model, name):
        from peft import PeftConfig

        model.add_adapter(name, PeftConfig.from_pretrained(str(folder)))
    set_peft_model_state_dict(model, state, adapter_name=name)


@contextlib.contextmanager
def use_adapter(model, name: str | None):
    """Run the block with adapter `name` active, or with adapters disabled when None.

    With name=None this is the reference model (the frozen base) used for the KL term.
    """
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        if name is not None:
            raise ValueError(f"model has no adapters, cannot activate {name!r}")
        yield model
        return
    if name is None:
        with model.disable_adapter():
            yield model
        return
    previous = model.active_adapter
    model.base_model.set_adapter(name)  # peft marks only the active adapter trainable...
    try:
        yield model
    finally:
        model.base_model.set_adapter(previous)



def output_embedding(model) -> torch.Tensor:
    """The effective LM head weight [V, H] for `logprobs.token_logprobs`.

    When the LM head carries a LoRA adapter (tiny models train it: see `add_adapters`), the
    active adapter's low-rank update is added, W + scale * B @ A, differentiably; with
    adapters disabled or inactive this is the plain (frozen, possibly tied) weight.
    """
    head = model.get_output_embeddings()
    base = getattr(head, "base_layer", None)
    if base is None:
        return head.weight
    weight = base.weight
    if getattr(head, "disable_adapters", False):
        return weight
    for name in head.active_adapters:
        if name in head.lora_A:
            delta = head.lora_B[name].weight @ head.lora_A[name].weight          # [V, H]
            weight = weight + head.scaling[name] * delta.to(weight.dtype)
    return weight
