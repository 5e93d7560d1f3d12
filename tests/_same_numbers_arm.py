"""A short toy arm run in a process of its own, for tests/test_same_numbers.py: the test sets
ATEN_CPU_CAPABILITY (read by torch at import) and the thread count from outside.

    python tests/_same_numbers_arm.py CACHE_DIR THREADS METHOD...   -> the records, as JSON, on stdout

The tiny models are trained here too (in CACHE_DIR), so their training is compared as well.

One thing is set here that the toy leaves to torch: the initial LoRA A matrices. PEFT draws
them with float32 `uniform_`, whose values differ by one float32 ulp between ATen's plain and
vectorized kernels (ATEN_CPU_CAPABILITY=default vs avx2/avx512: about half the entries of
the first matrix drawn). The toy's records are the same either way (the default run's 21 arms
were identical under both, docs/DESIGN_NOTES.md), but its parameters are not, so this harness
redraws every new adapter's A in float64 from a generator of its own, rounded to float32: the
same on every CPU. The test then checks, bit for bit, what training does from there."""
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from minscope import toy_setup  # noqa: E402
from minscope.experiment import ToyConfig, run_arm  # noqa: E402
from minscope.models import quiet  # noqa: E402
from minscope.toy_models import ToyModelConfig  # noqa: E402
from minscope.toy_setup import Toy  # noqa: E402

MODELS = ToyModelConfig(hidden=32, vocab=640, transcripts=120, vs_examples=40, sim_a_steps=20, vs_steps=20,
                        sim_steps=10, policy_steps=10, aligned_steps=10, batch=8, workers=1)


def same_init(add_adapters):
    """`add_adapters`, then each new adapter's A drawn the same on every CPU (see above)."""
    made = []

    def wrapped(model, names, *args, **kw):
        model = add_adapters(model, names, *args, **kw)
        made.append(names)
        gen = torch.Generator().manual_seed(1000 + len(made))
        with torch.no_grad():
            for key, p in model.named_parameters():
                if "lora_A" in key and any(f".{name}." in key for name in names):
                    draw = (2 * torch.rand(p.shape, generator=gen, dtype=torch.float64) - 1) / math.sqrt(p.shape[1])
                    p.copy_(draw.to(torch.float32))
        return model
    return wrapped


def main():
    cache_dir, threads, methods = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    quiet()
    toy_setup.add_adapters = same_init(toy_setup.add_adapters)
    torch.set_num_threads(threads)
    cfg = ToyConfig(name="same", methods=tuple(methods), seeds=(0,), steps=4, groups=2, group_size=4,
                    eval_every=2, eval_episodes=1, final_episodes=4, meter_every=0, workers=1, pool_every=1,
                    diversity_samples=2, diversity_episodes=4, models=MODELS)
    toy = Toy(cfg, cache_dir, log=lambda *a: None, progress=False)
    out = []
    for method in methods:
        run_dir = Path(cache_dir) / f"run-{method}"
        run_dir.mkdir(parents=True, exist_ok=True)
        run_arm(toy, method, 0, run_dir, out.append, progress=False, alarm_line=None)
    json.dump([{k: v for k, v in r.items() if k not in ("seconds", "rollout_s")} for r in out], sys.stdout)


if __name__ == "__main__":
    main()
