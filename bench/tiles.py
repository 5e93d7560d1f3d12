"""Tile sizes of the fused GRPO kernels: time a few candidate configs on one chunk.

The fused GRPO path runs two Triton kernels per chunk of tokens (`minscope.triton_logprobs`):
the statistics kernel (logits tiles + online softmax, storing p) and the dx kernel (a GEMM
over the vocabulary fed by p). Their tile sizes come from `tile_config`, chosen by shared
memory, not measured. This script times each kernel alone for a short list of candidate
configs at one chunk of the trainer (default 1,024 tokens, Qwen3-1.7B's head: H = 2,048,
V = 151,936, bf16) next to cuBLAS doing the same matmul, and prints which config was
fastest among those that reproduce the default config's result (max difference relative to
the largest entry: 1e-2 in bf16/fp16, where the accumulation order moves the last bits,
1e-5 in fp32; a config beyond it is marked MISMATCH and never picked). A config that does
not compile or does not fit the GPU is reported, not fatal.

    python bench/tiles.py                                # CUDA, ~2 minutes
    python bench/tiles.py --hidden 1024 --json tiles.json
    TRITON_INTERPRET=1 python bench/tiles.py --device cpu --tokens 8 --hidden 32 --vocab 300 --max-configs 2
        # the script's logic on CPU (times meaningless)
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))                     # run from anywhere: python bench/tiles.py
from minscope import triton_logprobs as tl  # noqa: E402

TOLERANCE = {"bfloat16": 1e-2, "float16": 1e-2, "float32": 1e-5}   # max rel. diff vs the default

STATS_KEYS = ("block_n", "block_v", "block_h", "num_warps", "num_stages")     # statistics kernel
DX_KEYS = ("dx_block_n", "dx_block_v", "dx_block_h", "dx_num_warps", "dx_num_stages")   # dx kernel
# The first of each list is tile_config's choice for Hopper in bf16; the rest sit around it.
STATS = [(128, 128, 64, 8, 4), (128, 128, 64, 8, 3), (128, 128, 64, 8, 5), (128, 128, 64, 4, 4),
         (128, 128, 128, 8, 3), (128, 64, 64, 4, 4), (256, 128, 64, 8, 3), (128, 128, 32, 8, 6)]
DX = [(64, 64, 256, 8, 3), (64, 64, 256, 8, 4), (128, 64, 256, 8, 3), (64, 64, 256, 4, 3),
      (32, 64, 256, 4, 3), (64, 64, 512, 8, 3), (64, 32, 256, 8, 4), (128, 64, 128, 8, 3)]


def timed(fn, device, reps: int = 5, warmup: int = 2) -> float:
    """Median milliseconds of fn() (CUDA events on a GPU, wall clock otherwise)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
    return sorted(times)[len(times) // 2]


def sweep(args) -> dict:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(args.tokens, args.hidden, generator=g) / args.hidden ** 0.5).to(device, dtype)
    w = (torch.randn(args.vocab, args.hidden, generator=g)).to(device, dtype)
    y = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(device)
    dlogp = torch.randn(args.tokens, generator=g).to(device)
    reps = dict(reps=args.reps, warmup=1 if device.type == "cpu" else 2)
    logits = x @ w.T
    out = {"shape": dict(tokens=args.tokens, hidden=args.hidden, vocab=args.vocab, dtype=args.dtype),
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "default": tl.kernel_config(device, dtype),
           "default_source": tl.tile_config_note(
               getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)
               if device.type == "cuda" else 0, dtype),
           "matmul_ms": {"logits (x @ W.T)": timed(lambda: x @ w.T, device, **reps),
                         "dx (G @ W)": timed(lambda g=logits: g @ w, device, **reps)}}
    del logits   # [N, V]: 0.3 GB at the default shape
    # the reference: the default config's results, which every candidate must reproduce
    logp0, lse, _, stored = tl.softmax_stats(x, w, y, store_probs=True)
    dx0 = tl.dx_from_probs(stored, y, lse, dlogp, w).float()
    kernels = {
        "stats": (STATS, STATS_KEYS, lambda cfg: tl.softmax_stats(x, w, y, config=cfg, store_probs=True)[0], logp0),
        "dx": (DX, DX_KEYS, lambda cfg: tl.dx_from_probs(stored, y, lse, dlogp, w, config=cfg), dx0)}
    for kernel, (candidates, keys, run, ref) in kernels.items():
        rows = []
        for cand in candidates[:args.max_configs]:
            cfg = dict(zip(keys, cand))
            try:
                err = ((run(cfg).float() - ref).abs().max() / ref.abs().max()).item()
                rows.append({**cfg, "ms": timed(lambda: run(cfg), device, **reps), "rel_err": err})
            except Exception as exc:   # too much shared memory, a bad tile: report and go on
                rows.append({**cfg, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"})
        ok = [r for r in rows if "ms" in r and r["rel_err"] <= TOLERANCE[args.dtype]]
        out[kernel] = rows
        out[f"best_{kernel}"] = min(ok, key=lambda r: r["ms"]) if ok else None
    return out


def report(res: dict) -> str:
    s = res["shape"]
    lines = [f"{res['device']}: {s['tokens']} tokens x H={s['hidden']} x V={s['vocab']}, {s['dtype']}",
             "default config: " + res["default_source"],
             "cuBLAS: " + ", ".join(f"{k} {v:.3f} ms" for k, v in res["matmul_ms"].items())]
    bound = {"stats": res["matmul_ms"]["logits (x @ W.T)"], "dx": res["matmul_ms"]["dx (G @ W)"]}
    tol = TOLERANCE[s["dtype"]]
    for kernel in ("stats", "dx"):
        lines += ["", f"| {kernel} kernel config | ms | x cuBLAS matmul | max rel. diff vs default |",
                  "|---|---|---|---|"]
        for r in res[kernel]:
            cfg = ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("ms", "error", "rel_err"))
            if "ms" in r:
                flag = "" if r["rel_err"] <= tol else " MISMATCH"
                lines.append(f"| {cfg} | {r['ms']:.3f} | {r['ms'] / bound[kernel]:.2f} | {r['rel_err']:.1e}{flag} |")
            else:
                lines.append(f"| {cfg} | failed: {r['error']} | | |")
        best = res[f"best_{kernel}"]
        lines.append(f"best {kernel}: {best}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=1024, help="rows of one chunk (the trainer's chunk_size)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--reps", type=int, default=5, help="timed runs per config (median)")
    p.add_argument("--max-configs", type=int, default=len(STATS), help="candidates per kernel")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this sweep is for GPUs (see --device cpu with TRITON_INTERPRET=1)")
    print("command: " + shlex.join(["python", "bench/tiles.py", *(sys.argv[1:] if argv is None else argv)]), flush=True)
    res = sweep(args)
    print(report(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
