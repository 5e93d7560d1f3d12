"""Where one decode step of a real model goes, beside its memory-bandwidth floor.

A decode step feeds one token per row through the whole model, so it must read every weight
once: weights bytes / the machine's memory bandwidth is its floor (the bandwidth measured in
the same run, by summing a 1 GiB float32 tensor). This script fills a kept KV cache with a
--context-token prompt per row (minscope's own `sampling.sample` and `KVCache`, as a rollout
does), then times --steps decode steps and profiles them (torch.profiler, self CPU time per op,
grouped: matrix products, attention, sampling, cache bookkeeping, the rest). "Python and
dispatch" is the step's wall time not spent inside any op. Two adapter set-ups, as the methods
decode:

  base        every row through the frozen base, adapters off (a frozen simulator, the reference)
  single      every row through one LoRA adapter (RL (Single)'s policy, a Co-Training simulator)
  per-row     the rows spread over --pool adapters (Population Co-Training's pool snapshots:
              peft's mixed-adapter batch, one sub-batch per adapter in every LoRA layer)

Each set-up runs through the forward paths of `sampling.sample`, side by side in one process:
"general" (transformers + peft's forward), "lean" (minscope/lean.py: the same operations,
bit-identical, without the general path's per-layer Python) and "packed" (lean with its few-row
products on MKL-packed weights, one merged product per LoRA layer for one adapter:
minscope/packed.py, the default for float32 Llamas on an MKL CPU); --paths picks some.

    python bench/decode_profile.py                        # SmolLM2, batch 8 and 32, 2 threads
    python bench/decode_profile.py --batch 8 --threads 1 --steps 16

Figures, not assertions: the machine's load moves them; read the ratios.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GROUPS = {
    "matrix products": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "mkl::_mkl_linear"),
    "attention": ("scaled_dot_product", "flash_attention", "aten::_efficient_attention"),
    "sampling": ("multinomial", "softmax", "exponential", "argmax", "aten::div", "aten::isin", "aten::gather"),
    "cache bookkeeping": ("aten::copy_", "aten::index", "aten::slice", "aten::select", "aten::cat", "aten::fill_",
                          "aten::masked_fill", "aten::zeros", "aten::empty", "aten::clone", "aten::to",
                          "aten::_to_copy", "aten::__and__", "aten::bitwise", "aten::arange", "aten::eq",
                          "aten::le", "aten::lt"),
}


def bandwidth_gbs() -> float:
    x = torch.ones(2**28)            # 1 GiB of float32
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def group_of(name: str) -> str:
    for group, keys in GROUPS.items():
        if any(k in name for k in keys):
            return group
    return "other ops"


def decode(model, tok, batch: int, context: int, steps: int, adapters, profile: bool):
    """ms per decode step (and, with profile, ms per step per group) for one set-up."""
    from minscope.adapters import use_adapter
    from minscope.kvcache import KVCache
    from minscope.sampling import sample

    g = torch.Generator().manual_seed(0)
    vocab = len(tok)
    prompts = [torch.randint(100, vocab, (context,), generator=g).tolist() for _ in range(batch)]
    owners = [object() for _ in range(batch)]
    names = None if len(set(adapters)) == 1 else adapters

    def run(n: int, prof=None) -> float:
        """Prefill a fresh cache with the prompts, then `n` decode forwards of one token per row."""
        kw = dict(pad_id=tok.pad_token_id, eos_ids={-1}, temperature=1.0, cache=KVCache(), owners=owners,
                  adapter_names=names)
        sample(model, prompts, max_new_tokens=1, **kw)                    # the prefill (untimed)
        t = time.perf_counter()
        with prof if prof is not None else torch.no_grad():
            sample(model, [q + [q[-1]] for q in prompts], max_new_tokens=n, **kw)
        return (time.perf_counter() - t) / n * 1e3

    with use_adapter(model, adapters[0]) if names is None else torch.no_grad():
        run(2)                                                              # warm-up
        if profile:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            wall = run(steps, prof)
        else:
            wall = run(steps)
    groups = {}
    if profile:
        for e in prof.key_averages():
            groups[group_of(e.key)] = groups.get(group_of(e.key), 0.0) + e.self_cpu_time_total / 1e3 / steps
    return wall, groups


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="any name minscope.models.load_model takes")
    p.add_argument("--batch", default="8,32", help="rows per decode step, comma-separated")
    p.add_argument("--context", type=int, default=400, help="tokens already in each row's cache")
    p.add_argument("--steps", type=int, default=24, help="decode steps timed")
    p.add_argument("--pool", type=int, default=5, help="adapters of the per-row set-up (Population's K)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--paths", default="general,lean,packed",
                   help="forward paths, comma-separated: general (transformers + peft), lean (minscope/lean.py, "
                        "bit-identical to general), packed (lean with MKL-packed products, minscope/packed.py)")
    args = p.parse_args(argv)
    print("command: " + shlex.join(["python", "bench/decode_profile.py", *(sys.argv[1:] if argv is None else argv)]),
          flush=True)

    from minscope import packed, sampling
    from minscope.adapters import add_adapters
    from minscope.models import load_model, quiet

    quiet()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, device="cpu")
    names = [f"pool{i}" for i in range(args.pool)]
    model = add_adapters(model, names, init_lora_weights=False)
    model.eval()
    base = model.get_base_model()
    weights = sum(t.numel() * t.element_size() for t in {id(t): t for t in base.parameters()}.values())
    gbs = bandwidth_gbs()
    floor = weights / (gbs * 1e9) * 1e3
    print(f"{args.model}: {weights / 2**20:.0f} MiB of weights; bandwidth {gbs:.1f} GB/s "
          f"({args.threads} threads) -> floor {floor:.0f} ms per decode step; context {args.context} tokens, "
          f"{args.steps} steps timed\n")
    cols = ["matrix products", "attention", "sampling", "cache bookkeeping", "other ops"]
    print("| set-up | path | batch | ms / decode step | x floor | " + " | ".join(cols) + " | Python and dispatch |")
    print("|---|---|---|---|---|" + "---|" * (len(cols) + 1))
    for batch in (int(b) for b in args.batch.split(",")):
        for label, adapters in (("base", [None] * batch), ("single", [names[0]] * batch),
                                ("per-row", [names[i % args.pool] for i in range(batch)])):
            for path in args.paths.split(","):
                sampling.LEAN, packed.PACKED = path != "general", path == "packed"
                wall, _ = decode(model, tok, batch, args.context, args.steps, adapters, profile=False)
                _, groups = decode(model, tok, batch, args.context, args.steps, adapters, profile=True)
                inside = sum(groups.values())
                print(f"| {label} | {path} | {batch} | {wall:.0f} | {wall / floor:.1f} | "
                      + " | ".join(f"{groups.get(c, 0.0):.0f}" for c in cols)
                      + f" | {max(wall - inside, 0.0):.0f} |", flush=True)


if __name__ == "__main__":
    main()
