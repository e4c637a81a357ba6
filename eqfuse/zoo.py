"""The model zoo: Hugging Face ``transformers`` families, run the way their users run them.

Each family is one line of ``FAMILIES``: the model class, what kind of inputs it takes,
and the sizes of a published checkpoint (for the GPU benchmark, ``benchmarks/zoo.py``).
Weights are random (no downloads). ``build`` makes any model class at a tiny size (for
the CPU tests) by shrinking its config class's defaults: a new family is one line, and a
user can try a class that is not listed with ``build("SomeModelClass")``.

"The way their users run them" means default arguments: the default attention
implementation (SDPA), the KV cache on (transformers 5's ``DynamicCache``, which starts
each layer as an empty tensor), ``model(**inputs)`` for inference, ``labels=`` and
``loss.backward()`` for a training step, ``model.generate`` for decoders.

``transformers`` is not a dependency of eqfuse (it is in the ``dev`` extra).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# A tiny model: every config field of these names that the config class has is set so
# (a config class that spells them otherwise maps them with its ``attribute_map``).
TINY = {
    "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128,
    "d_ff": 128, "d_kv": 16, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "num_decoder_layers": 2,
    "ffn_dim": 128, "n_inner": 128, "num_local_experts": 4, "num_experts": 4, "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64, "image_size": 32, "patch_size": 8, "num_channels": 3,
    "sliding_window": 8, "type_vocab_size": 2, "relative_attention_num_buckets": 8,
    "relative_attention_max_distance": 16, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    "decoder_start_token_id": 0,
}

DECODER, ENCODER, SEQ2SEQ, VISION = "decoder", "encoder", "seq2seq", "vision"


@dataclass(frozen=True)
class Family:
    name: str
    model: str  # the transformers class run for inference (and generate, for decoders)
    kind: str  # DECODER | ENCODER | SEQ2SEQ | VISION: which inputs it takes
    train: str | None = None  # the class trained with labels=, where it is not ``model``
    published: dict = field(default_factory=dict)  # a published checkpoint's sizes (GPU benchmark)
    tiny: dict = field(default_factory=dict)  # beyond TINY, for this family's CPU tests
    fixed: dict = field(default_factory=dict)  # config fields set at every size (its defaults lack them)

    @property
    def train_model(self) -> str:
        return self.train or self.model


FAMILIES = [
    Family("llama", "LlamaForCausalLM", DECODER, published=dict(  # Llama-3.2-1B
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0)),
    Family("qwen2", "Qwen2ForCausalLM", DECODER, published=dict(  # Qwen2.5-1.5B
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2)),
    Family("mistral", "MistralForCausalLM", DECODER, published=dict(  # Mistral-7B, a few layers
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
        num_attention_heads=32, num_key_value_heads=8, sliding_window=4096)),
    Family("mixtral", "MixtralForCausalLM", DECODER, published=dict(  # Mixtral-8x7B, 2 layers
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2)),
    Family("gpt2", "GPT2LMHeadModel", DECODER, published=dict(  # GPT-2 small
        vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024)),
    Family("phi3", "Phi3ForCausalLM", DECODER, published=dict(  # Phi-3-mini, 8 layers
        vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=8,
        num_attention_heads=32, num_key_value_heads=32)),
    Family("gemma2", "Gemma2ForCausalLM", DECODER, published=dict(  # Gemma-2-2B, 8 layers
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, sliding_window=4096)),
    Family("opt", "OPTForCausalLM", DECODER, published=dict(  # OPT-350m's width, 125m's depth
        vocab_size=50272, hidden_size=768, ffn_dim=3072, num_hidden_layers=12, num_attention_heads=12,
        word_embed_proj_dim=768)),
    Family("gpt_neox", "GPTNeoXForCausalLM", DECODER, published=dict(  # Pythia-410m
        vocab_size=50304, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
        num_attention_heads=16)),
    Family("bert", "BertModel", ENCODER, train="BertForSequenceClassification", published=dict(  # BERT-base
        vocab_size=30522, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
        num_attention_heads=12)),
    Family("roberta", "RobertaModel", ENCODER, train="RobertaForSequenceClassification", published=dict(
        vocab_size=50265, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
        num_attention_heads=12, max_position_embeddings=514, pad_token_id=1)),
    Family("t5", "T5ForConditionalGeneration", SEQ2SEQ, published=dict(  # T5-base
        vocab_size=32128, d_model=768, d_ff=3072, d_kv=64, num_layers=12, num_heads=12),
        tiny=dict(d_model=64, num_layers=2, num_heads=4), fixed=dict(decoder_start_token_id=0)),
    Family("bart", "BartForConditionalGeneration", SEQ2SEQ, published=dict(  # BART-base
        vocab_size=50265, d_model=768, encoder_ffn_dim=3072, decoder_ffn_dim=3072, encoder_layers=6,
        decoder_layers=6, encoder_attention_heads=12, decoder_attention_heads=12),
        tiny=dict(d_model=64)),
    Family("vit", "ViTModel", VISION, train="ViTForImageClassification", published=dict(  # ViT-B/16
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
        image_size=224, patch_size=16)),
]

BY_NAME = {f.name: f for f in FAMILIES}


def _transformers():
    try:
        import transformers
    except ImportError:  # pragma: no cover - the dev extra installs it
        raise ImportError("the model zoo needs transformers: pip install 'eqfuse[dev]'") from None
    return transformers


def config(model_class, sizes: dict | None = None, **overrides):
    """The config of ``model_class`` (a transformers class or its name) at ``sizes`` (TINY
    by default): each size is set where the config class has a field of that name, or
    maps it to one; ``overrides`` are set as given."""
    if isinstance(model_class, str):
        model_class = getattr(_transformers(), model_class)
    config_class = model_class.config_class
    defaults = config_class()
    known = set(defaults.to_dict()) | set(getattr(config_class, "attribute_map", {}))
    chosen = {k: v for k, v in (TINY if sizes is None else sizes).items() if k in known}
    return config_class(**{**chosen, **overrides})


def build(model_class, sizes: dict | None = None, dtype=torch.float32, device="cpu", seed: int = 0,
          dropout: bool = True, **overrides) -> torch.nn.Module:
    """``model_class`` (a transformers class or its name) with random weights at ``sizes``
    (TINY by default), in eval mode. Norm weights and biases are drawn at random too:
    at 1 and 0 they would hide a kernel that drops them. ``dropout=False`` sets every
    dropout probability of the config to 0 (a GPU's fused attention draws its dropout
    masks by its own generator offsets: one backend's training step is not another's)."""
    if isinstance(model_class, str):
        model_class = getattr(_transformers(), model_class)
    torch.manual_seed(seed)
    cfg = config(model_class, sizes, **overrides)
    if not dropout:
        for name, value in cfg.to_dict().items():
            if ("dropout" in name or "pdrop" in name) and isinstance(value, float):
                setattr(cfg, name, 0.0)
    model = model_class(cfg)
    with torch.no_grad():
        for module in model.modules():
            if "Norm" in type(module).__name__:
                for name, p in module.named_parameters(recurse=False):
                    p.copy_((1.0 if name == "weight" else 0.0) + 0.2 * torch.randn_like(p))
    return model.to(device=device, dtype=dtype).eval()


# The config fields that set a model's depth, by family (each family reads its own)
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "encoder_layers",
                "decoder_layers")


def family_model(family: Family, train: bool = False, sizes: dict | None = None, layers: int | None = None,
                 **kw) -> torch.nn.Module:
    """The family's model (its training class with ``train``) at TINY plus its own sizes,
    or at ``sizes``; with ``layers``, that many layers (in each stack)."""
    chosen = {**TINY, **family.tiny} if sizes is None else dict(sizes)
    if layers:
        chosen.update({f: layers for f in LAYER_FIELDS})
    return build(family.train_model if train else family.model, chosen, **family.fixed, **kw)


def inputs(family: Family, model: torch.nn.Module, batch: int = 2, seq: int = 9, labels: bool = False,
           seed: int = 1) -> dict:
    """The keyword arguments a user passes ``model``: token ids (and a padded attention
    mask for encoders: the second sequence is two tokens short), or images; with
    ``labels``, the labels its loss takes."""
    cfg = model.config
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    vocab = getattr(cfg, "vocab_size", None)

    def tokens(s):  # ids above the special tokens
        return torch.randint(3, vocab, (batch, s), generator=g, device="cpu").to(device)

    if family.kind == VISION:
        size = cfg.image_size
        kw = {"pixel_values": torch.randn(batch, cfg.num_channels, size, size, generator=g, device="cpu").to(device,
                                                                                                 model.dtype)}
        if labels:
            kw["labels"] = torch.randint(0, cfg.num_labels, (batch,), generator=g, device="cpu").to(device)
        return kw
    kw = {"input_ids": tokens(seq)}
    if family.kind in (ENCODER, SEQ2SEQ):
        mask = torch.ones(batch, seq, dtype=torch.long, device="cpu")
        mask[-1, seq - 2:] = 0
        kw["attention_mask"] = mask.to(device)
    if family.kind == SEQ2SEQ:
        if labels:
            kw["labels"] = tokens(max(seq // 2, 1))
        else:
            kw["decoder_input_ids"] = tokens(max(seq // 2, 1))
    elif labels and family.kind == DECODER:
        kw["labels"] = kw["input_ids"].clone()
    elif labels:
        kw["labels"] = torch.randint(0, cfg.num_labels, (batch,), generator=g, device="cpu").to(device)
    return kw


def main_output(out) -> torch.Tensor:
    """The tensor a model's output is judged by: its loss if it has one, else its logits,
    else its last hidden state."""
    for name in ("loss", "logits", "last_hidden_state"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError(f"no loss, logits or last hidden state in {type(out).__name__}")


def training_step(model: torch.nn.Module, kwargs: dict, seed: int = 0):
    """One training step's loss and gradients (``labels=`` in ``kwargs``, then
    ``loss.backward()``), with the random stream seeded (dropout draws alike in eager and
    compiled runs): (loss, {parameter name: gradient})."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    loss = model(**kwargs).loss
    loss.backward()
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper names them apart
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def generate(model: torch.nn.Module, input_ids: torch.Tensor, new_tokens: int = 3) -> torch.Tensor:
    """Greedy decoding of ``new_tokens`` tokens (``model.generate``, KV cache on)."""
    pad = getattr(model.generation_config, "pad_token_id", None)
    return model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=pad if pad is not None else model.config.eos_token_id)
