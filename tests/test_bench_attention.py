"""bench/studies/attention.py on small batches: both attention implementations, the same SFT loss."""
import importlib.util
from pathlib import Path

from minscope.envs.toy import ToyEnv
from minscope.models import build_tiny_model
from minscope.toy_models import toy_tokenizer

PATH = Path(__file__).resolve().parents[1] / "bench" / "studies" / "attention.py"
spec = importlib.util.spec_from_file_location("bench_attention", PATH)
attention = importlib.util.module_from_spec(spec)
spec.loader.exec_module(attention)


def test_vs_batches_are_long_and_both_attentions_give_the_same_loss():
    tokenizer = toy_tokenizer(ToyEnv())
    batches = attention.batches(tokenizer, n=4)
    ids, attn, mask = batches["vs"]
    assert ids.shape[0] == 4 and ids.shape[1] > 2 * batches["plain"][0].shape[1]   # the VS requests are long
    assert (attn == 0).any() and mask.sum() > 0                                        # padded, with targets
    for batch in batches.values():
        losses = [attention.step_time(build_tiny_model(tokenizer, "llama", 32, seed=0, attention=a), batch,
                                      steps=1, warmup=0)[1] for a in ("eager", "sdpa")]
        assert abs(losses[0] - losses[1]) < 1e-5 and losses[0] > 1.0               # untrained: ~log(vocab)

