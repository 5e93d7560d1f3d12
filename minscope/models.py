"""Models: build tiny ones offline, and load real causal LMs onto a device.

`build_tokenizer` trains a byte-level BPE tokenizer with a ChatML chat template and
`build_tiny_model` draws a small random model of a real architecture (Qwen3, Llama), with no
download: the toy's models and the tests' take the same chat-template path real models take.
`load_model` loads a Hugging Face causal LM by hub name, local folder, GGUF file or built-in
name (the last two are converted into a folder once: minscope/checkpoints.py), its base in
4 bits if asked. LoRA adapters go on top of either (minscope/adapters.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import torch

from .checkpoints import resolve_checkpoint


# ChatML, the format of Qwen models. Tools are listed in the system turn and tool
# results come back as "tool" turns, which is what Qwen/Hermes-style models expect.
CHATML_TEMPLATE = (
    "{%- if tools -%}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' -%}{{ messages[0].content + '\\n\\n' }}{%- endif -%}"
    "{{ '# Tools\\n\\nYou may call one or more functions. Function signatures:\\n<tools>' }}"
    "{%- for tool in tools -%}{{ '\\n' + (tool | tojson) }}{%- endfor -%}"
    "{{ '\\n</tools>\\n\\nCall a function as <tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if not (tools and loop.first and m.role == 'system') -%}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def quiet():
    """Silence library chatter that says nothing to a minscope user (deprecation notices of
    transformers/peft internals, weight-loading progress bars). Called by train.py/eval.py."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*past_key_values.*")
    # the toy's LoRA on a tied LM head is never merged, which is what this warns about
    warnings.filterwarnings("ignore", message=".*ensure_weight_tying.*")
    # bitsandbytes (imported by peft) offers to download an optional CPU 4-bit kernel
    logging.getLogger("bitsandbytes.backends.cpu").setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


# --------------------------------------------------------------------------- tokenizers
def build_tokenizer(corpus, vocab_size: int = 512):
    """Train a byte-level BPE tokenizer (the kind Qwen/Llama use) on `corpus` offline.

    The result is a `PreTrainedTokenizerFast` with a ChatML chat template, `<|im_end|>` as
    EOS and `<|endoftext|>` as padding: the same chat-template path real models take.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Train on the text as it appears inside chat turns, so role headers merge well.
    tok.train_from_iterator(list(corpus) + ["<|im_start|>system\n", "<|im_start|>user\n",
                                            "<|im_start|>assistant\n", "<|im_start|>tool\n"], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.padding_side = "left"
    return fast


# --------------------------------------------------------------------------- tiny models
def tiny_config(arch: str, vocab_size: int, hidden_size: int = 64, num_layers: int = 2,
                num_heads: int = 4, max_positions: int = 1024):
    """A small config of a real architecture ("llama" or "qwen3")."""
    from transformers import LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 4,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen3":
        return Qwen3Config(head_dim=hidden_size // num_heads, **common)
    raise ValueError(f"unknown tiny architecture {arch!r}; use 'llama' or 'qwen3'")


# The sizes of the real Qwen3-0.6B and Qwen3-1.7B configs (head_dim 128; both tie the LM head
# to the embeddings). The benchmarks build random-weight models of these shapes: no download.
QWEN3_SHAPES = {
    "0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=3072, vocab_size=151_936),
    "1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=6144, vocab_size=151_936),
}


def build_tiny_model(tokenizer, arch: str = "qwen3", hidden_size: int = 64, num_layers: int = 2,
                     num_heads: int = 4, seed: int = 0, attention: str = "sdpa", float64: bool = False):
    """A randomly initialised model of a real architecture, sized to `tokenizer`.

    `attention` is the transformers attention implementation: "sdpa" (PyTorch's fused
    attention) or "eager" (the attention matrix in plain ops). On CPU sdpa is about twice as
    fast on the toy's longest sequences (~300 tokens) and as fast on short ones.
    `float64`: drawn and computed in float64, its weights rounded to float32 values (the toy's
    models: minscope/precision.py; float32's random normal draws differ between CPUs)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, len(tokenizer), hidden_size, num_layers, num_heads)
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention,
                                                 dtype=torch.float64 if float64 else torch.float32)
    if float64:
        from .precision import round_parameters, to_float64

        round_parameters(model.parameters())
        return to_float64(model)
    return model.float()


# --------------------------------------------------------------------------- real models
def pick_device(name: str | None = None) -> str:
    """A device name; None or "auto": cuda if torch sees a GPU, else mps (Apple silicon), else cpu."""
    if name not in (None, "auto"):
        return name
    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    return "mps" if mps is not None and mps.is_available() else "cpu"


def load_model(name_or_path: str, load_in_4bit: bool = False, dtype: torch.dtype | None = None,
               device: str | None = None):
    """Load a Hugging Face causal LM and its tokenizer by hub name, local path, a GGUF file
    or a built-in name (`checkpoints.BUILTIN_MODELS`: converted once into the model cache).

    `load_in_4bit` uses bitsandbytes NF4 (double quantisation; `four_bit_kwargs`) for the base
    weights; LoRA adapters stay in full precision. device: `pick_device` (default: cuda, else
    mps, else cpu); bfloat16 on cuda, float32 elsewhere (mps untested). Returns (model, tokenizer).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = pick_device(device)
    name_or_path = resolve_checkpoint(name_or_path)
    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    is_local = Path(name_or_path).exists()
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, local_files_only=offline)
        kwargs = {}
        if dtype is None:
            dtype = torch.bfloat16 if device == "cuda" else torch.float32
        if load_in_4bit:
            kwargs = four_bit_kwargs(name_or_path, dtype, device, offline)
        model = AutoModelForCausalLM.from_pretrained(
            name_or_path, dtype=dtype, local_files_only=offline, **kwargs)
    except OSError as err:
        cause = (str(err).strip().splitlines() or [err.__class__.__name__])[0]
        if is_local:
            hint = "A local model directory needs config.json, the weights and the tokenizer files."
        else:
            hint = ("Not a local path, so it was looked up as a Hugging Face hub name. If this machine "
                    "is offline, download the model elsewhere and pass its local directory instead "
                    "(e.g. --policy /models/Qwen3-1.7B).")
        raise SystemExit(f"Could not load model {name_or_path!r}: {cause}\n{hint}") from None
    if not load_in_4bit:
        model.to(device)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    fix_cpu_4bit(model)
    return model, tokenizer


def four_bit_kwargs(checkpoint: str, dtype: torch.dtype, device: str, offline: bool) -> dict:
    """from_pretrained's arguments for an NF4 base (bitsandbytes, double quantisation) on `device`.

    A converted GGUF checkpoint (the built-in `smollm2`) holds de-quantized fp32 weights, but its
    config still names the GGUF quantization, which transformers will not merge with a
    BitsAndBytesConfig: that note is dropped, and the weights are quantized to NF4 as they load.
    device_map puts the base where the run asked (without it a GPU machine loads onto cuda:0).
    Compute runs in bf16, or in float32 where `dtype` is float32 on CUDA (cards below compute
    capability 8.0 emulate bf16)."""
    from transformers import AutoConfig, BitsAndBytesConfig

    config = AutoConfig.from_pretrained(checkpoint, local_files_only=offline)
    quant = getattr(config, "quantization_config", None)
    if isinstance(quant, dict) and quant.get("quant_method") == "gguf":
        del config.quantization_config
    compute = torch.float32 if device.startswith("cuda") and dtype == torch.float32 else torch.bfloat16
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=compute)
    return dict(config=config, quantization_config=bnb, device_map={"": device})


def fix_cpu_4bit(model) -> int:
    """Stop bitsandbytes from repacking 4-bit weights for CPU inference.

    On CPU, after any no-grad forward (e.g. generation) a `Linear4bit` repacks its weights
    into an inference-only layout, after which training silently gets no gradient (or
    raises). Turning the flag off on every `Linear4bit` keeps training working. Returns
    how many layers were patched. Harmless on CUDA.
    """
    try:
        import bitsandbytes as bnb
    except ImportError:
        return 0
    n = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
            n += 1
    return n


def enable_checkpointing(model) -> int:
    """Non-reentrant activation checkpointing of every decoder layer: during training each
    layer keeps only its input and recomputes the rest in the backward pass. At the 1.7B
    shape this took one Population Co-Training update from 18.9 to 2.96 GB (bench/memory.py)
    for about a third more time. Generation (eval mode) is unaffected. Call it on the
    transformers model (before `add_adapters`, or a PeftModel's `get_base_model()`).
    Returns how many layers checkpoint (transformers 5.2x renamed the call; both names work)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    from transformers.modeling_layers import GradientCheckpointingLayer

    return sum(isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing for m in model.modules())


def activation_bytes_per_token(model) -> int | None:
    """About what one token's activations take in a training forward that keeps them (no
    checkpointing): per decoder layer 8 hidden-size and 4 MLP-size vectors. For SmolLM2 that
    is 1.23 MiB per token; the tensors autograd actually saved measured 1.15 MiB
    (docs/BENCHMARKS.md, "The real step against the machine's limits"). None for a config
    without those sizes."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    sizes = [getattr(cfg, k, None) for k in ("num_hidden_layers", "hidden_size", "intermediate_size")]
    if not all(isinstance(v, int) for v in sizes):
        return None
    layers, hidden, mlp = sizes
    return layers * (8 * hidden + 4 * mlp) * model.get_input_embeddings().weight.element_size()


@contextlib.contextmanager
def checkpointing(model, on: bool):
    """Inside the block the layers `enable_checkpointing` set up checkpoint only if `on`
    (a unit small enough to keep its activations skips the recomputation: the same gradients,
    less time; tests/test_prefix.py checks they are the same)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [] if on else [m for m in model.modules()
                            if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    for m in layers:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in layers:
            m.gradient_checkpointing = True


def model_device(model) -> torch.device:
    return next(model.parameters()).device
