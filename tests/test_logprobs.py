"""Chunked log-probs (torch backend) equal log_softmax + gather, in values and gradients."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minscope import grpo
from minscope.logprobs import fused_grpo_token_loss, resolve_backend, token_logprobs


def make_inputs(n, h, v, dtype=torch.float32, seed=0, weight_grad=False, lead=None):
    gen = torch.Generator().manual_seed(seed)
    lead = lead or (n,)
    hidden = torch.randn(*lead, h, generator=gen).to(dtype).requires_grad_(True)
    # scale so logits span a few units, like a trained LM head
    weight = (torch.randn(v, h, generator=gen) * 2 / h ** 0.5).to(dtype).requires_grad_(weight_grad)
    targets = torch.randint(0, v, lead, generator=gen)
    return hidden, weight, targets


def reference_log_softmax(hidden, weight, temperature=1.0):
    """log_softmax over the full [..., V] logits, in fp32 from the given (maybe bf16) values."""
    return torch.log_softmax(hidden.float() @ weight.float().T / temperature, dim=-1)


def reference_logprobs(hidden, weight, targets, temperature=1.0):
    return reference_log_softmax(hidden, weight, temperature).gather(-1, targets[..., None]).squeeze(-1)


def grads(out, inputs, seed=1):
    """Gradients of sum(c * out) for a fixed random cotangent c (not all ones)."""
    c = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad((c * out).sum(), inputs)


SHAPES = [  # (N, H, V, chunk_size)
    pytest.param(37, 16, 300, 8, id="odd-N-vocab-not-multiple-of-chunk"),
    pytest.param(5, 24, 97, 64, id="chunk-larger-than-N"),
    pytest.param(64, 32, 128, 64, id="N-multiple-of-chunk"),
    pytest.param(13, 8, 50, 1, id="chunk-of-one-row"),
]


@pytest.mark.parametrize("n,h,v,chunk", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_logprobs_equal_log_softmax_gather_fp32(n, h, v, chunk, temperature):
    hidden, weight, targets = make_inputs(n, h, v)
    logp = token_logprobs(hidden, weight, targets, temperature, chunk_size=chunk, backend="torch")
    ref = reference_logprobs(hidden, weight, targets, temperature)
    assert logp.dtype == torch.float32 and logp.shape == (n,)
    torch.testing.assert_close(logp, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n,h,v,chunk", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_hidden_and_weight_gradients_equal_autograd_fp32(n, h, v, chunk, temperature):
    hidden, weight, targets = make_inputs(n, h, v, weight_grad=True)
    ours = grads(token_logprobs(hidden, weight, targets, temperature, chunk_size=chunk, backend="torch"),
                 (hidden, weight))
    ref = grads(reference_logprobs(hidden, weight, targets, temperature), (hidden, weight))
    for got, want in zip(ours, ref):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_frozen_weight_gets_no_gradient():
    hidden, weight, targets = make_inputs(9, 8, 40)
    token_logprobs(hidden, weight, targets, chunk_size=4, backend="torch").sum().backward()
    assert weight.grad is None and hidden.grad is not None


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_bf16_values_and_gradients_close_to_fp32_reference(temperature):
    hidden, weight, targets = make_inputs(37, 32, 300, dtype=torch.bfloat16, weight_grad=True)
    logp = token_logprobs(hidden, weight, targets, temperature, chunk_size=16, backend="torch")
    assert logp.dtype == torch.float32
    ref = reference_logprobs(hidden, weight, targets, temperature)
    # logits are rounded to bf16 by the bf16 matmul: ~3 significant digits
    torch.testing.assert_close(logp, ref, atol=5e-2, rtol=2e-2)
    ours = grads(logp, (hidden, weight))
    want = grads(ref, (hidden, weight))
    for got, w in zip(ours, want):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), w.float(), atol=2e-2, rtol=5e-2)


def test_batch_time_hidden_gives_batch_time_logprobs():
    hidden, weight, targets = make_inputs(0, 16, 70, lead=(3, 7))
    logp = token_logprobs(hidden, weight, targets, chunk_size=5, backend="torch")
    assert logp.shape == (3, 7)
    torch.testing.assert_close(logp, reference_logprobs(hidden, weight, targets), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads(logp, hidden)[0],
                               grads(reference_logprobs(hidden, weight, targets), hidden)[0],
                               atol=1e-5, rtol=1e-4)


def test_non_contiguous_hidden_slice_is_accepted():
    hidden, weight, targets = make_inputs(0, 16, 70, lead=(2, 9))
    sliced, next_tokens = hidden[:, :-1], targets[:, 1:]       # how the trainer calls it
    logp = token_logprobs(sliced, weight, next_tokens, chunk_size=4, backend="torch")
    torch.testing.assert_close(logp, reference_logprobs(sliced, weight, next_tokens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_entropy_equals_reference_entropy_and_is_detached(temperature):
    hidden, weight, targets = make_inputs(37, 16, 300)
    logp, entropy = token_logprobs(hidden, weight, targets, temperature, return_entropy=True,
                                   chunk_size=8, backend="torch")
    log_p = reference_log_softmax(hidden, weight, temperature)
    torch.testing.assert_close(entropy, -(log_p.exp() * log_p).sum(-1), atol=1e-5, rtol=1e-5)
    assert entropy.dtype == torch.float32 and not entropy.requires_grad and logp.requires_grad


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_no_tensor_larger_than_a_chunk_of_logits_is_created():
    n, h, v, chunk = 48, 16, 300, 8
    hidden, weight, targets = make_inputs(n, h, v)
    with LargestTensor() as largest:
        logp, _ = token_logprobs(hidden, weight, targets, return_entropy=True, chunk_size=chunk,
                                 backend="torch")
        logp.sum().backward()
    # views of the weight [V, H] count too; the full logits [N, V] would be 3x larger than that
    assert largest.numel <= max(chunk * v, n * h, v * h)


def fused_setup(n=37, h=16, v=300, dtype=torch.float32, weight_grad=False, temperature=1.0, seed=0):
    """Inputs for the GRPO loss where some ratios fall outside the clip range."""
    hidden, weight, targets = make_inputs(n, h, v, dtype=dtype, weight_grad=weight_grad, seed=seed)
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        logp = reference_logprobs(hidden, weight, targets, temperature)
    old_logp = logp + 0.5 * torch.randn(n, generator=gen)    # |log ratio| up to ~1.5: clipping
    ref_logp = logp + 0.3 * torch.randn(n, generator=gen)
    advantages = torch.randn(n, generator=gen)
    mask = torch.rand(n, generator=gen) > 0.2
    token_weights = mask.float() / mask.sum()
    return hidden, weight, targets, old_logp, ref_logp, advantages, token_weights


def reference_grpo_loss(hidden, weight, targets, old_logp, ref_logp, advantages, token_weights,
                        beta, temperature):
    logp = reference_logprobs(hidden, weight, targets, temperature)
    per_token, _, clipped = grpo.token_loss(logp, old_logp, ref_logp, advantages, 0.2, 0.28, beta)
    return (token_weights * per_token).sum(), clipped


@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("weight_grad", [False, True])
def test_fused_grpo_loss_and_gradients_equal_reference(beta, temperature, weight_grad):
    inputs = fused_setup(weight_grad=weight_grad, temperature=temperature)
    hidden, weight = inputs[:2]
    loss, _, _ = fused_grpo_token_loss(*inputs, beta=beta, temperature=temperature, chunk_size=8,
                                       backend="torch")
    ref_loss, clipped = reference_grpo_loss(*inputs, beta=beta, temperature=temperature)
    assert clipped.any() and not clipped.all()         # both branches of the min are exercised
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-5)
    wrt = (hidden, weight) if weight_grad else (hidden,)
    got = torch.autograd.grad(2.5 * loss, wrt)          # backward scales by grad_output
    want = torch.autograd.grad(2.5 * ref_loss, wrt)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-4)


def test_fused_grpo_returns_detached_logprobs_and_entropy_of_the_plain_path():
    inputs = fused_setup(n=21)
    _, logp, entropy = fused_grpo_token_loss(*inputs, beta=0.05, chunk_size=4, backend="torch")
    want_logp, want_entropy = token_logprobs(*inputs[:3], return_entropy=True, backend="torch")
    assert not logp.requires_grad and not entropy.requires_grad
    torch.testing.assert_close(logp, want_logp.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(entropy, want_entropy, atol=1e-6, rtol=1e-6)
    _, _, none = fused_grpo_token_loss(*inputs, return_entropy=False, backend="torch")
    assert none is None


def test_fused_grpo_accepts_batch_time_inputs():
    inputs = fused_setup(n=12)
    shaped = [inputs[0].detach().view(3, 4, -1).requires_grad_(True), inputs[1]]
    shaped += [t.view(3, 4) for t in inputs[2:]]
    loss, logp, _ = fused_grpo_token_loss(*shaped, beta=0.1, chunk_size=5, backend="torch")
    ref_loss, _ = reference_grpo_loss(*shaped, beta=0.1, temperature=1.0)
    assert logp.shape == (3, 4)
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(torch.autograd.grad(loss, shaped[0])[0],
                               torch.autograd.grad(ref_loss, shaped[0])[0], atol=1e-6, rtol=1e-4)


def test_fused_grpo_bf16_close_to_fp32_reference():
    inputs = fused_setup(dtype=torch.bfloat16, h=32)
    loss, _, _ = fused_grpo_token_loss(*inputs, beta=0.1, chunk_size=16, backend="torch")
    ref_loss, _ = reference_grpo_loss(*inputs, beta=0.1, temperature=1.0)
    torch.testing.assert_close(loss, ref_loss, atol=2e-2, rtol=5e-2)
    got = torch.autograd.grad(loss, inputs[0])[0]
    want = torch.autograd.grad(ref_loss, inputs[0])[0]
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=1e-1)


def test_fused_grpo_without_reference_needs_beta_zero():
    hidden, weight, targets, old_logp, _, advantages, token_weights = fused_setup(n=8)
    with pytest.raises(ValueError, match="ref_logp"):
        fused_grpo_token_loss(hidden, weight, targets, old_logp, None, advantages, token_weights,
                              beta=0.1, backend="torch")
    loss, _, _ = fused_grpo_token_loss(hidden, weight, targets, old_logp, None, advantages,
                                       token_weights, beta=0.0, backend="torch")
    assert torch.isfinite(loss)


def test_fused_grpo_kl_at_untrained_positions_keeps_loss_and_gradients_finite():
    """ref_logp - logp = 200 at a position with weight 0 (prompt, other party, padding)."""
    hidden, weight, targets, old_logp, ref_logp, advantages, token_weights = fused_setup(n=16)
    untrained = token_weights == 0
    assert untrained.any()
    with torch.no_grad():
        logp = reference_logprobs(hidden, weight, targets)
    ref_logp = torch.where(untrained, logp + 200.0, ref_logp)
    loss, _, _ = fused_grpo_token_loss(hidden, weight, targets, old_logp, ref_logp, advantages, token_weights,
                                       beta=0.1, chunk_size=4, backend="torch")
    (grad,) = torch.autograd.grad(loss, hidden)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert (grad[untrained] == 0).all()
    # the trained positions' loss is untouched: the same as with a harmless reference there
    calm, _, _ = fused_grpo_token_loss(hidden, weight, targets, old_logp, torch.where(untrained, logp, ref_logp),
                                       advantages, token_weights, beta=0.1, chunk_size=4, backend="torch")
    torch.testing.assert_close(loss, calm)


def test_unknown_backend_raises_with_the_choices():
    hidden, weight, targets = make_inputs(4, 8, 20)
    with pytest.raises(ValueError, match="auto.*torch.*triton"):
        token_logprobs(hidden, weight, targets, backend="cuda")


def test_auto_backend_is_torch_for_cpu_tensors():
    assert resolve_backend("auto", torch.zeros(2, 3)) == "torch"


def test_triton_backend_on_cpu_without_interpreter_says_what_to_do(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    hidden, weight, targets = make_inputs(4, 8, 20)
    with pytest.raises(ValueError, match="TRITON_INTERPRET|pip install triton"):
        token_logprobs(hidden, weight, targets, backend="triton")


def test_mismatched_shapes_raise():
    hidden, weight, targets = make_inputs(4, 8, 20)
    with pytest.raises(ValueError, match="share H"):
        token_logprobs(hidden, weight[:, :5], targets, backend="torch")
    with pytest.raises(ValueError, match="leading shape"):
        token_logprobs(hidden, weight, targets[:3], backend="torch")


def test_forward_only_logprobs_build_no_autograd_node(monkeypatch):
    """Under no_grad (evaluation, reference log-probs) the chunks run without the autograd
    Function, so nothing is saved for a backward pass; the values are the same."""
    from minscope import logprobs as lp_module

    hidden, weight, targets = make_inputs(37, 16, 300)
    with_grad, entropy = token_logprobs(hidden, weight, targets, 0.7, return_entropy=True, chunk_size=8,
                                        backend="torch")

    def refuse(*args):
        raise AssertionError("the forward-only path went through the autograd Function")

    monkeypatch.setattr(lp_module._ChunkedTokenLogProbs, "apply", refuse)
    with torch.no_grad():
        logp, ent = token_logprobs(hidden, weight, targets, 0.7, return_entropy=True, chunk_size=8,
                                   backend="torch")
    frozen = token_logprobs(hidden.detach(), weight, targets, 0.7, chunk_size=8, backend="torch")
    assert logp.grad_fn is None and frozen.grad_fn is None
    torch.testing.assert_close(logp, with_grad.detach(), atol=0, rtol=0)
    torch.testing.assert_close(frozen, with_grad.detach(), atol=0, rtol=0)
    torch.testing.assert_close(ent, entropy, atol=0, rtol=0)
    with pytest.raises(AssertionError, match="autograd Function"):     # and with a gradient it does
        token_logprobs(hidden, weight, targets, chunk_size=8, backend="torch")
