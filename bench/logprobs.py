"""Benchmark: per-token log-probs through the LM head at Qwen3's vocabulary (V = 151,936).

minscope's methods, the peers a user would pick instead, and cuBLAS's bounds, in one run,
each in a fresh process. Forward + backward w.r.t. the hidden states, LM head frozen (as in
LoRA training):

  bound-2mm    cuBLAS's two matmuls per chunk of --chunk-size rows, logits (x @ W.T) then
               dx (logits @ W), nothing in between: the bound for any chunked GRPO path
  naive        log_softmax(h @ W.T / T).gather(...), plain autograd (several [N, V] tensors)
  torch        minscope.logprobs.token_logprobs(backend="torch"), chunks of --chunk-size rows
  triton       minscope.logprobs.token_logprobs(backend="triton")                    (CUDA)
  cublas       minscope.logprobs.token_logprobs(backend="cublas")                    (CUDA)
  grpo-torch   minscope.logprobs.fused_grpo_token_loss(backend="torch")
  grpo-triton  minscope.logprobs.fused_grpo_token_loss(backend="triton")             (CUDA)
  grpo-cublas  minscope.logprobs.fused_grpo_token_loss(backend="cublas")             (CUDA)
  trl          TRL's trl.kernels.chunked_logprob.ChunkedLogProbFunction, vocab chunks of
               --trl-vocab-chunk (peer; when trl imports)
  liger-grpo   Liger's liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss, loss_type="bnpo",
               one sequence of --seq-len tokens per chunk (its default); torch.compile on
               CUDA only (peer; when liger_kernel imports)

Forward only (evaluation, reference log-probs), under torch.no_grad():

  bound-logits cuBLAS's logits matmul per chunk, nothing else: the forward bound
  fwd-naive, fwd-torch, fwd-triton, fwd-cublas, fwd-trl   the methods above, no backward

(CUDA): run only on a GPU, or on CPU with TRITON_INTERPRET=1 (the interpreter; slow, for
tests). A peer that does not import is reported in its row with the reason, never dropped.
The log-prob methods backpropagate sum(c * logp) for a fixed random c; the GRPO methods
backpropagate the token-mean GRPO loss (clipping active, beta = 0.04). Columns:

  time        median wall time of --repeats calls after --warmup calls
  x bound     time / bound-2mm's (forward + backward rows) or / bound-logits's (forward rows)
  extra peak  memory the call needed beyond its inputs (see below)
  max|dlogp|  max abs error of the log-probs   } against an fp32 reference computed with
  max|dgrad|  max abs error of d loss / d h    } plain autograd, row block by row block
  |dloss|     abs error of the GRPO loss       }

The header says where the Triton kernels' tile and launch settings come from: measured (the
H200 sweep of bench/tiles.py, bf16) or UNMEASURED (fp32, consumer sm_86 / sm_89 GPUs, and the
cublas row pass everywhere).

How memory is measured. Every method runs in a fresh subprocess, so nothing one method
cached can flatter or hurt another.
  CUDA: torch.cuda.max_memory_allocated() during one call minus the memory allocated
        just before it (inputs excluded), after the warm-up calls.
  CPU:  torch's CPU allocator is invisible to tracemalloc, so we read the process's peak
        resident set size (ru_maxrss, from resource.getrusage) after the first call and
        subtract the resident size just before it (/proc/self/statm). The inputs are
        created in place so that nothing freed earlier raised the peak, and workers run
        with MALLOC_MMAP_THRESHOLD_=131072 so that every large block is a fresh mapping
        (by default glibc raises that threshold after the first big free and then serves
        blocks of up to 32 MB from already-resident heap pages, which RSS cannot see).
        RSS counts pages really touched; expect roughly +-10 MB of slack.

Examples:
  python bench/logprobs.py                               # CPU: N=1024, H=1024, fp32, chunk 64
  python bench/logprobs.py --device cuda                 # the two issue shapes in bf16
  python bench/logprobs.py --shapes 4096x1024 --methods naive torch triton --json out.json
  TRITON_INTERPRET=1 python bench/logprobs.py --device cpu --shapes 64x32 --vocab 500 \
      --chunk-size 16 --methods bound-2mm naive grpo-cublas trl     # the script's logic on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))                     # run from anywhere: python bench/logprobs.py
from minscope import grpo, logprobs  # noqa: E402

# In this order by default: each bound before the rows it divides, then what decides the
# trainer's default and the peers, minscope's PyTorch paths last (a run cut short keeps the rest).
METHODS = ["bound-2mm", "grpo-cublas", "grpo-triton", "naive", "trl", "liger-grpo",
           "bound-logits", "fwd-cublas", "fwd-triton", "fwd-trl", "fwd-naive",
           "cublas", "triton", "grpo-torch", "torch", "fwd-torch"]
CUDA_ONLY = {"triton", "cublas", "grpo-triton", "grpo-cublas", "fwd-triton", "fwd-cublas"}   # or the interpreter
FORWARD_ONLY = {m for m in METHODS if m.startswith("fwd-")} | {"bound-logits"}
# The modules each peer needs: TRL's backward imports trl.trainer.utils, which imports datasets
# (and so pyarrow, xxhash, dill, multiprocess); its forward does not.
OPTIONAL = {"trl": ("trl.kernels.chunked_logprob", "trl.trainer.utils"),
            "fwd-trl": ("trl.kernels.chunked_logprob",),
            "liger-grpo": ("liger_kernel.chunked_loss",)}
PEER_WHEELS = ("trl", "liger-kernel", "datasets", "pyarrow")       # versions in the header
EPS_LOW, EPS_HIGH, BETA = 0.2, 0.28, 0.04


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="How it measures: see the top of bench/logprobs.py.")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--shapes", nargs="+", default=None, metavar="NxH",
                   help="token count x hidden size (default: cuda 16384x2048 4096x1024; cpu 1024x1024)")
    p.add_argument("--vocab", type=int, default=151_936, help="V (default: Qwen3's vocabulary)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="rows per chunk for minscope (default: cuda 1024, cpu 64)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sequence for liger-grpo, which chunks by sequence (default: chunk size)")
    p.add_argument("--trl-vocab-chunk", type=int, default=16_384, help="vocab chunk for trl")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default: cuda 2, cpu 0)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls (default: cuda 5, cpu 1)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per method before giving up")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)       # internal
    p.add_argument("--shape", default=None, help=argparse.SUPPRESS)        # internal
    p.add_argument("--reference-file", default=None, help=argparse.SUPPRESS)  # internal
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no CUDA device; use --device cpu")
    cuda = args.device == "cuda"
    args.shapes = args.shapes or (["16384x2048", "4096x1024"] if cuda else ["1024x1024"])
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.chunk_size = args.chunk_size or (1024 if cuda else 64)
    args.seq_len = args.seq_len or args.chunk_size
    args.warmup = args.warmup if args.warmup is not None else (2 if cuda else 0)
    args.repeats = args.repeats or (5 if cuda else 1)
    return args


# ------------------------------------------------------------------------------ inputs
def make_inputs(n, h, v, dtype, device, seq_len, seed=0):
    """Hidden states, frozen LM head, targets and GRPO side inputs, created in place."""
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.empty(n, h, dtype=dtype, device=device).normal_(generator=gen)
    weight = torch.empty(v, h, dtype=dtype, device=device).normal_(generator=gen).mul_(2 / h ** 0.5)
    targets = torch.randint(0, v, (n,), generator=gen, device=device)
    cot = torch.randn(n, generator=gen, device=device)                   # cotangent for sum(c * logp)
    n_seq = -(-n // seq_len)
    adv_seq = torch.randn(n_seq, generator=gen, device=device)           # one advantage per sequence
    advantages = adv_seq.repeat_interleave(seq_len)[:n]
    noise = torch.randn(2, n, generator=gen, device=device)
    return dict(hidden=hidden, weight=weight, targets=targets, cot=cot, adv_seq=adv_seq,
                advantages=advantages, noise=noise)


def grpo_side_inputs(inp, logp_ref):
    """old/ref log-probs near the reference log-probs, so some ratios fall outside the clip."""
    return logp_ref + 0.3 * inp["noise"][0], logp_ref + 0.2 * inp["noise"][1]


def reference(inp, temperature, rows=1024):
    """fp32 log-probs, d(sum c*logp)/dh, GRPO loss and its d/dh, by autograd on row blocks."""
    h32, w32 = inp["hidden"].float(), inp["weight"].float()
    n = h32.shape[0]
    logp = torch.empty(n, device=h32.device)
    dh = torch.empty_like(h32)
    for s in range(0, n, rows):
        x = h32[s:s + rows].clone().requires_grad_(True)
        y = inp["targets"][s:s + rows, None]
        lp = torch.log_softmax(x @ w32.T / temperature, -1).gather(1, y).squeeze(1)
        (dh[s:s + rows],) = torch.autograd.grad((inp["cot"][s:s + rows] * lp).sum(), x)
        logp[s:s + rows] = lp.detach()
    old, ref = grpo_side_inputs(inp, logp)
    loss = torch.zeros((), device=h32.device)
    dh_grpo = torch.empty_like(h32)
    for s in range(0, n, rows):
        x = h32[s:s + rows].clone().requires_grad_(True)
        y = inp["targets"][s:s + rows, None]
        lp = torch.log_softmax(x @ w32.T / temperature, -1).gather(1, y).squeeze(1)
        per_token, _, _ = grpo.token_loss(lp, old[s:s + rows], ref[s:s + rows],
                                          inp["advantages"][s:s + rows], EPS_LOW, EPS_HIGH, BETA)
        chunk_loss = per_token.sum() / n
        (dh_grpo[s:s + rows],) = torch.autograd.grad(chunk_loss, x)
        loss += chunk_loss.detach()
    return dict(logp=logp, dh=dh, old=old, ref=ref, loss=loss, dh_grpo=dh_grpo)


# ----------------------------------------------------------------------------- methods
def build_method(name, inp, ref, args):
    """A closure running forward + backward; returns (logp or None, loss or None, dh)."""
    h, w, y, T = inp["hidden"], inp["weight"], inp["targets"], args.temperature
    n = h.shape[0]
    token_weights = torch.full((n,), 1.0 / n, device=h.device)

    def leaf():
        return h.detach().requires_grad_(True)

    chunks = [slice(s, s + args.chunk_size) for s in range(0, n, args.chunk_size)]
    if name == "bound-2mm":       # cuBLAS alone: logits, then a matmul of the same shape as dx
        def run():
            dh = torch.empty_like(h)
            for rows in chunks:
                dh[rows] = (h[rows] @ w.T) @ w
            return None, None, dh
    elif name == "bound-logits":
        def run():
            with torch.no_grad():
                for rows in chunks:
                    h[rows] @ w.T
            return None, None, None
    elif name == "fwd-naive":
        def run():
            with torch.no_grad():
                return torch.log_softmax(h @ w.T / T, -1).gather(1, y[:, None]).squeeze(1), None, None
    elif name in ("fwd-torch", "fwd-triton", "fwd-cublas"):
        def run():
            with torch.no_grad():
                lp = logprobs.token_logprobs(h, w, y, T, chunk_size=args.chunk_size, backend=name[4:])
            return lp, None, None
    elif name == "fwd-trl":
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction

        def run():
            with torch.no_grad():
                lp = ChunkedLogProbFunction.apply(h, w, None, y, T, args.trl_vocab_chunk, None, 1.0, ())[0]
            return lp, None, None
    elif name == "naive":
        def run():
            x = leaf()
            lp = torch.log_softmax(x @ w.T / T, -1).gather(1, y[:, None]).squeeze(1)
            (dh,) = torch.autograd.grad((inp["cot"] * lp).sum(), x)
            return lp.detach(), None, dh
    elif name in ("torch", "triton", "cublas"):
        def run():
            x = leaf()
            lp = logprobs.token_logprobs(x, w, y, T, chunk_size=args.chunk_size, backend=name)
            (dh,) = torch.autograd.grad((inp["cot"] * lp).sum(), x)
            return lp.detach(), None, dh
    elif name in ("grpo-torch", "grpo-triton", "grpo-cublas"):
        backend = name.split("-")[1]

        def run():
            x = leaf()
            loss, lp, _ = logprobs.fused_grpo_token_loss(
                x, w, y, ref["old"], ref["ref"], inp["advantages"], token_weights, EPS_LOW, EPS_HIGH,
                BETA, T, backend=backend, return_entropy=False, chunk_size=args.chunk_size)
            (dh,) = torch.autograd.grad(loss, x)
            return lp, loss.detach(), dh
    elif name == "trl":
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction

        def run():
            x = leaf()
            lp = ChunkedLogProbFunction.apply(x, w, None, y, T, args.trl_vocab_chunk, None, 1.0, ())[0]
            (dh,) = torch.autograd.grad((inp["cot"] * lp).sum(), x)
            return lp.detach(), None, dh
    elif name == "liger-grpo":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        seq = args.seq_len
        if n % seq:
            raise ValueError(f"liger-grpo needs N divisible by --seq-len ({n} % {seq} != 0)")
        b = n // seq
        loss_fn = LigerFusedLinearGRPOLoss(beta=BETA, compiled=h.is_cuda, use_ref_model=True,
                                           epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH,
                                           loss_type="bnpo", temperature=T)
        mask = torch.ones(b, seq, device=h.device)

        def run():
            x = leaf()
            loss = loss_fn(x.view(b, seq, -1), w, y.view(b, seq), mask, inp["adv_seq"],
                           ref_per_token_logps=ref["ref"].view(b, seq),
                           old_per_token_logps=ref["old"].view(b, seq))[0]
            (dh,) = torch.autograd.grad(loss, x)
            return None, loss.detach(), dh
    else:
        raise ValueError(name)
    return run


# ------------------------------------------------------------------------ measurement
def rss_now_bytes() -> int:
    """Current resident set size (Linux /proc), falling back to the peak so far."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024   # kB on Linux, bytes on macOS


def run_worker(args):
    """One method on one shape, in this (fresh) process; prints one JSON line."""
    n, h = (int(s) for s in args.shape.split("x"))
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    # One call at a tiny shape first: lazy imports, thread pools and kernel caches are
    # set up before the baseline is read, so they do not count as the method's memory.
    tiny = make_inputs(2 * args.seq_len, h, min(1000, args.vocab), dtype, device, args.seq_len)
    tiny_n = 2 * args.seq_len
    zeros = torch.zeros(tiny_n, device=device)
    build_method(args.worker, tiny, dict(old=zeros, ref=zeros), args)()
    del tiny, zeros
    sync()

    inp = make_inputs(n, h, args.vocab, dtype, device, args.seq_len)
    ref = {k: v.to(device) for k, v in torch.load(args.reference_file).items()}
    run = build_method(args.worker, inp, ref, args)
    for _ in range(args.warmup):
        run()
    sync()
    if cuda:
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = rss_now_bytes()
    t0 = time.perf_counter()
    logp, loss, dh = run()
    sync()
    first = time.perf_counter() - t0
    extra_peak = (torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes()) - base
    times = [first] if args.warmup == 0 else []
    while len(times) < args.repeats:
        t0 = time.perf_counter()
        logp, loss, dh = run()
        sync()
        times.append(time.perf_counter() - t0)

    grpo = loss is not None
    bound = args.worker.startswith("bound-")
    what = ("logits matmul only" if args.worker == "bound-logits" else "two matmuls, no softmax" if bound
            else "forward only" if args.worker in FORWARD_ONLY else "grpo loss" if grpo else "sum(c*logp)")
    out = dict(method=args.worker, time_s=statistics.median(times), times_s=times,
               extra_peak_bytes=int(extra_peak),
               err_logp=(logp.float() - ref["logp"]).abs().max().item() if logp is not None else None,
               err_grad=(dh.float() - (ref["dh_grpo"] if grpo else ref["dh"])).abs().max().item()
               if dh is not None and not bound else None,
               err_loss=abs(loss.item() - ref["loss"].item()) if grpo else None,
               grad_of=what)
    print(json.dumps(out))


def run_subprocess(args, extra, timeout):
    cmd = [sys.executable, str(Path(__file__).resolve()), "--device", args.device, "--vocab", str(args.vocab),
           "--dtype", args.dtype, "--chunk-size", str(args.chunk_size), "--seq-len", str(args.seq_len),
           "--trl-vocab-chunk", str(args.trl_vocab_chunk), "--temperature", str(args.temperature),
           "--warmup", str(args.warmup), "--repeats", str(args.repeats)] + extra
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")   # see "How memory is measured"
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    except subprocess.TimeoutExpired:
        return None, f"timeout after {timeout} s"
    if proc.returncode != 0:
        lines = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()
        oom = any("out of memory" in line.lower() for line in lines)
        return None, "OOM" if oom else lines[-1][:120]
    return json.loads(proc.stdout.strip().splitlines()[-1]), None


def run_reference_worker(args):
    n, h = (int(s) for s in args.shape.split("x"))
    dtype = getattr(torch, args.dtype)
    inp = make_inputs(n, h, args.vocab, dtype, torch.device(args.device), args.seq_len)
    ref = reference(inp, args.temperature)
    torch.save({k: v.cpu() for k, v in ref.items()}, args.reference_file)
    print(json.dumps({"ok": True, "settings": kernel_settings(args.device, dtype)}))


def kernel_settings(device, dtype) -> list:
    """Lines for the header: the GPU, and where each Triton kernel's tile settings come from."""
    if device != "cuda":
        interp = os.environ.get("TRITON_INTERPRET") == "1"
        return ["CPU" + (": Triton kernels in the interpreter (times say nothing about a GPU)" if interp else "")]
    props = torch.cuda.get_device_properties(0)
    lines = [f"{props.name}, sm_{props.major}{props.minor}, torch {torch.__version__}"]
    if logprobs.triton_available():
        import triton

        from minscope import cublas_logprobs, triton_logprobs
        shared = getattr(props, "shared_memory_per_block_optin", 0)
        lines += [f"triton {triton.__version__}; " + triton_logprobs.tile_config_note(shared, dtype),
                  cublas_logprobs.LAUNCH_NOTE]
    return lines


def peer_versions() -> dict:
    """{wheel: version or None} of the peers, without importing them."""
    from importlib import metadata
    out = {}
    for dist in PEER_WHEELS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


_IMPORT_ERRORS: dict = {}


def unavailable(method, args):
    """Why `method` cannot run here, or None. Peers are imported here once to find out."""
    if method in CUDA_ONLY and args.device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "CUDA only (or TRITON_INTERPRET=1 on CPU)"
    for module in OPTIONAL.get(method, ()):
        if module not in _IMPORT_ERRORS:
            import importlib
            try:
                importlib.import_module(module)
                _IMPORT_ERRORS[module] = None
            except Exception as exc:      # not installed, or a dependency missing
                first = (str(exc).splitlines() or [""])[0][:100]
                _IMPORT_ERRORS[module] = (f"cannot import {module} ({type(exc).__name__}: {first}); "
                                          "pip install it, or put the wheels in .whl/ for bench/gpu.sh")
        if _IMPORT_ERRORS[module]:
            return _IMPORT_ERRORS[module]
    return None


def write_json(args, results):
    if args.json:
        keep = {k: v for k, v in vars(args).items() if k not in ("worker", "shape", "reference_file")}
        Path(args.json).write_text(json.dumps(dict(config=keep, results=results), indent=2))


def fmt_bytes(b):
    return "-" if b is None else f"{b / 2**30:.2f} GB" if b >= 2**30 else f"{b / 2**20:.0f} MB"


def fmt_err(e):
    return "-" if e is None else f"{e:.1e}"


def bound_of(method):
    return "bound-logits" if method in FORWARD_ONLY else "bound-2mm"


def target_lines(by_method) -> list:
    """The issue's targets, checked on this run's rows (only those that were measured)."""
    lines = []
    peers = [m for m in ("naive", "trl", "liger-grpo") if m in by_method]
    for m in ("grpo-triton", "grpo-cublas"):
        if m not in by_method:
            continue
        r = by_method[m]
        parts = [f"{r['time_s'] * 1e3:.1f} ms", f"extra {fmt_bytes(r['extra_peak_bytes'])}"
                 + (" (<= 1 GB)" if r["extra_peak_bytes"] <= 2**30 else " (> 1 GB)")]
        if "bound-2mm" in by_method:
            parts.append(f"{r['time_s'] / by_method['bound-2mm']['time_s']:.2f}x the two-matmul bound")
        slower = [p for p in peers if by_method[p]["time_s"] <= r["time_s"]]
        if peers:
            parts.append("faster than every peer measured" if not slower else "slower than " + ", ".join(slower))
        lines.append(f"  {m}: " + "; ".join(parts))
    for m in ("fwd-triton", "fwd-cublas"):
        if m in by_method and "bound-logits" in by_method:
            ratio = by_method[m]["time_s"] / by_method["bound-logits"]["time_s"]
            lines.append(f"  {m}: {ratio:.2f}x cuBLAS's logits matmul (target <= 1.1x)")
    return lines


def main(argv=None):
    args = parse_args(argv)
    if args.worker == "reference":
        return run_reference_worker(args)
    if args.worker:
        return run_worker(args)
    print("command: " + shlex.join(["python", "bench/logprobs.py", *(sys.argv[1:] if argv is None else argv)]),
          flush=True)

    results = []
    args.peers = peer_versions()
    for shape in args.shapes:
        n, h = (int(s) for s in shape.split("x"))
        print(f"\nLM-head log-probs, forward + backward w.r.t. hidden, head frozen: N={n:,} H={h:,} "
              f"V={args.vocab:,} {args.dtype} on {args.device}; minscope chunk {args.chunk_size} rows")
        with tempfile.TemporaryDirectory() as tmp:
            ref_file = os.path.join(tmp, "reference.pt")
            info, err = run_subprocess(args, ["--worker", "reference", "--shape", shape,
                                              "--reference-file", ref_file], args.timeout)
            if err:
                print(f"reference failed: {err}")
                continue
            for line in info.get("settings", []):
                print(f"  {line}")
            print("  peers: " + ", ".join(f"{k} {v or 'not installed'}" for k, v in peer_versions().items()))
            args.settings = info.get("settings", [])
            print(f"{'method':<12} {'time':>10} {'x bound':>8} {'extra peak':>11} {'max|dlogp|':>11} "
                  f"{'max|dgrad|':>11} {'|dloss|':>8}  what")
            timed = {}
            for method in args.methods:
                why = unavailable(method, args)
                res, err = (None, why) if why else run_subprocess(
                    args, ["--worker", method, "--shape", shape, "--reference-file", ref_file], args.timeout)
                if res is None:
                    label = "unavailable" if why else "failed"
                    print(f"{method:<12} {label}: {err}")
                    results.append(dict(method=method, shape=shape, skipped=err, reason=label))
                    write_json(args, results)
                    continue
                res.update(shape=shape, n=n, h=h, vocab=args.vocab, dtype=args.dtype, device=args.device,
                           chunk_size=args.chunk_size)
                bound = timed.get(bound_of(method))
                res["x_bound"] = res["time_s"] / bound if bound and not method.startswith("bound-") else None
                timed[method] = res["time_s"]
                results.append(res)
                ratio = "-" if res["x_bound"] is None else f"{res['x_bound']:.2f}x"
                print(f"{method:<12} {res['time_s'] * 1e3:>8.1f}ms {ratio:>8} {fmt_bytes(res['extra_peak_bytes']):>11} "
                      f"{fmt_err(res['err_logp']):>11} {fmt_err(res['err_grad']):>11} "
                      f"{fmt_err(res['err_loss']):>8}  {res['grad_of']}")
                write_json(args, results)          # after every method: a killed run keeps what it measured
        by_method = {r["method"]: r for r in results if r.get("shape") == shape and "skipped" not in r}
        if "naive" in by_method and by_method["naive"]["extra_peak_bytes"] > 0:
            naive_peak = by_method["naive"]["extra_peak_bytes"]
            for m in ("torch", "triton", "cublas", "grpo-torch", "grpo-triton", "grpo-cublas"):
                if m in by_method and by_method[m]["extra_peak_bytes"] > 0:
                    print(f"  naive extra peak / {m}: {naive_peak / by_method[m]['extra_peak_bytes']:.1f}x")
        lines = target_lines(by_method)
        if lines:
            print("targets of the fused kernels, on this shape:")
            print("\n".join(lines))
    if args.json:
        write_json(args, results)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
