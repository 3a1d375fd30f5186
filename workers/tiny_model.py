"""Build a tiny random Qwen3 (dense) or Qwen3.5 (hybrid) with a real byte-level BPE tokenizer and the
Qwen3.5/3.6 family's chat-template conventions, offline.

No model hub is reachable from CI or most dev boxes, yet the whole pipeline (vLLM, capture, the transformers
reference) must run on a real model; this builds one in seconds. The hybrid has the Qwen3.5/3.6 layer mix, in
both released checkpoint shapes. Both render with workers.tiny_chat_template (the family's conventions; the dense
one keeps Qwen3's bare thinking prompt) and tokenize with a small trained BPE (`vocab="small"`) or the family's
real 248K vocabulary (`vocab="qwen3_6"`, workers.tiny_vocab). `regen tiny-model DIR` exposes them; tests build
them once per session. Sizes and shapes, and why: docs/measured-facts.md#the-tiny-test-models.
"""

from __future__ import annotations

import json
import os

from workers.tiny_chat_template import FAMILY_CHAT_TEMPLATE
from workers.tiny_vocab import QWEN3_6, QWEN3_6_MODEL_VOCAB, VOCABS, qwen3_6_tokenizer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>"]

# The dense Qwen3 keeps Qwen3's own thinking generation prompt (a bare `<|im_start|>assistant\n`: the model opens
# the think block itself), so both prompt shapes regen meets stay exercised; everything else is the family's.
QWEN3_CHAT_TEMPLATE = FAMILY_CHAT_TEMPLATE.replace(
    "{%- else %}\n        {{- '<think>\\n' }}\n    {%- endif %}\n{%- endif %}\n", "{%- endif %}\n{%- endif %}\n")


def _make_stub(model, eos_id: int, dim: int = 0) -> None:
    """Every position's final normed state points along `dim`, and only `<|im_end|>` reads that direction.

    A large constant in `dim` of every input embedding dominates the residual stream; the final norm keeps
    only `dim`; the (untied) lm_head is zero except `lm_head[eos, dim]`, so `<|im_end|>` wins every step.
    The decoder layers keep their random weights, so the hidden states stay varied and non-zero.
    """
    import torch

    with torch.no_grad():
        model.model.embed_tokens.weight[:, dim] = 50.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[dim] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[eos_id, dim] = 10.0


_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding trains a small drafter on the target model's own outputs and hidden states.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "def add(a, b):\n    return a + b\n",
    "Let me think step by step about the problem before answering.",
    "Paris, Lyon and Marseille are cities in France; Baroque art fills many museums.",
    "0123456789 + - * / = ( ) [ ] { } < > ! ? , . ; : ' \" ` ~ @ # $ % ^ & | \\",
    "Émile a vu un éléphant. Straße. 東京は日本の首都です。 Привет, мир! 🙂",
]


MASSIVE_CHANNEL = 7


def build_tiny_qwen3(out_dir: str, vocab_size: int = 1024, num_layers: int = 4, seed: int = 0,
                     stub: bool = False, massive: float = 0.0, vocab: str = "small") -> str:
    """Write a tiny random Qwen3 (weights, config, tokenizer, template) to `out_dir`; return the path.

    `stub=True` builds a broken checkpoint that ends every answer at once (its first token is always
    `<|im_end|>`): the empty-stub failure the quality gate exists to catch, made on purpose for its tests.
    `massive` > 0 sets channel MASSIVE_CHANNEL of every token's embedding to that value: the residual stream then
    carries it in every token at every layer (the decoder layers read it through their norms and add small
    updates), as real Qwen models carry "massive activations" in a few channels. The head is tied, so every
    logit moves by the same amount and sampling is unchanged.
    `vocab="qwen3_6"` gives it the Qwen3.5/3.6 family's real tokenizer (workers.tiny_vocab) and 248,320
    embedding rows, as the family's configs have; `vocab_size` then does not apply.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    hf_tok = _tokenizer(out_dir, vocab_size, QWEN3_CHAT_TEMPLATE, vocab=vocab)

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=_model_vocab(hf_tok, vocab),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=4096,
        rope_theta=1_000_000.0,
        tie_word_embeddings=not stub,
        bos_token_id=None,
        eos_token_id=hf_tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=hf_tok.convert_tokens_to_ids("<|endoftext|>"),
        torch_dtype="bfloat16",
    )
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    if stub:
        _make_stub(model, config.eos_token_id)
    if massive:
        with torch.no_grad():
            model.model.embed_tokens.weight[:, MASSIVE_CHANNEL] = massive
    model.save_pretrained(out_dir, safe_serialization=True)
    gen = {"eos_token_id": [config.eos_token_id], "pad_token_id": config.pad_token_id, "do_sample": True}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as fh:
        json.dump(gen, fh, indent=2)
    return out_dir


# The wrapper's vision placeholders (Qwen3-VL numbering is the tokenizer's; regen never sends images).
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def _model_vocab(hf_tok, vocab: str) -> int:
    return QWEN3_6_MODEL_VOCAB if vocab == QWEN3_6 else len(hf_tok)


def _tokenizer(out_dir: str, vocab_size: int, chat_template: str, extra_special: tuple[str, ...] = (),
               vocab: str = "small"):
    """Train the small byte-level BPE on `_CORPUS` and add Qwen's special tokens (`vocab="small"`), or take the
    family's real one (`vocab="qwen3_6"`, which holds the vision tokens already); save it with `chat_template`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab not in VOCABS:
        raise ValueError(f"unknown vocabulary {vocab!r}: expected one of {', '.join(VOCABS)}")
    if vocab == QWEN3_6:
        hf_tok = qwen3_6_tokenizer()
        hf_tok.chat_template = chat_template
        hf_tok.save_pretrained(out_dir)
        return hf_tok

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS) - len(extra_special),
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 50, trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS[:3] + list(extra_special))
    tok.add_tokens(SPECIAL_TOKENS[3:])  # think / tool markers are ordinary added tokens in Qwen3
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                     bos_token=None, unk_token=None)
    hf_tok.chat_template = chat_template
    hf_tok.save_pretrained(out_dir)
    return hf_tok


def hybrid_layer_types(num_layers: int) -> list[str]:
    """Qwen3.5's mix: every fourth decoder layer full attention, the others Gated DeltaNet linear attention."""
    return ["full_attention" if (k + 1) % 4 == 0 else "linear_attention" for k in range(num_layers)]


def build_tiny_qwen3_5(out_dir: str, vocab_size: int = 1024, num_layers: int = 4, seed: int = 0,
                       multimodal: bool = False, mtp: bool = False, vocab: str = "small") -> str:
    """Write a tiny random hybrid Qwen3.5 to `out_dir`; return the path.

    hidden 128; layers as `hybrid_layer_types` (4 layers: 3 linear + 1 full attention); full attention with 2
    heads of head_dim 64 (vLLM's CPU attention rejects smaller heads), linear attention with 2 key and 2 value
    heads of 64. `multimodal=True` writes the released shape: `Qwen3_5ForConditionalGeneration` with the language
    model under `text_config` and a one-block vision tower. `mtp=True` adds a multi-token-prediction head
    (`add_mtp_head`), what vLLM's speculative method `mtp` runs. `vocab="qwen3_6"`: the family's real tokenizer
    and 248,320 embedding rows (as `build_tiny_qwen3`).
    """
    import torch
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForCausalLM,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5TextConfig,
    )

    os.makedirs(out_dir, exist_ok=True)
    hf_tok = _tokenizer(out_dir, vocab_size, FAMILY_CHAT_TEMPLATE, tuple(VISION_TOKENS) if multimodal else (),
                        vocab=vocab)
    eos, pad = hf_tok.convert_tokens_to_ids("<|im_end|>"), hf_tok.convert_tokens_to_ids("<|endoftext|>")
    text = dict(
        vocab_size=_model_vocab(hf_tok, vocab), hidden_size=128, intermediate_size=256, num_hidden_layers=num_layers,
        layer_types=hybrid_layer_types(num_layers), num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=eos, pad_token_id=pad,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25,
                         **({"mrope_section": [2, 3, 3], "mrope_interleaved": True} if multimodal else {})},
    )
    torch.manual_seed(seed)
    if multimodal:
        ids = {t: hf_tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
        config = Qwen3_5Config(
            text_config=text,
            vision_config=dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=1, out_hidden_size=128,
                               patch_size=16, num_position_embeddings=64, spatial_merge_size=2,
                               temporal_patch_size=2),
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
            tie_word_embeddings=True,
        )
        model = Qwen3_5ForConditionalGeneration(config)
    else:
        config = Qwen3_5TextConfig(**text)
        model = Qwen3_5ForCausalLM(config)
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(out_dir, safe_serialization=True)
    gen = {"eos_token_id": [eos], "pad_token_id": pad, "do_sample": True}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as fh:
        json.dump(gen, fh, indent=2)
    if mtp:
        add_mtp_head(out_dir, seed)
    return out_dir


def add_mtp_head(out_dir: str, seed: int = 0) -> None:
    """Give a saved tiny Qwen3.5 a one-layer MTP head in the released checkpoints' form, which vLLM's
    `qwen3_5_mtp` loads: `mtp_num_hidden_layers: 1` in the language model's config and `mtp.*` weights beside the
    model's: `mtp.fc.weight [H, 2H]` (random), the norms `mtp.pre_fc_norm_hidden`, `mtp.pre_fc_norm_embedding`,
    `mtp.norm` (copies of the final norm) and `mtp.layers.0.*`, a copy of the last full-attention decoder layer
    (vLLM builds the MTP layer as a full-attention one)."""
    import torch
    from safetensors.torch import load_file, save_file

    config_path = os.path.join(out_dir, "config.json")
    with open(config_path, encoding="utf-8") as fh:
        config = json.load(fh)
    text = config.get("text_config") or config
    text["mtp_num_hidden_layers"] = 1
    full = max(i for i, kind in enumerate(text["layer_types"]) if kind == "full_attention")
    weights_path = os.path.join(out_dir, "model.safetensors")
    weights = load_file(weights_path)
    prefix = "model.language_model." if "text_config" in config else "model."
    layer = f"{prefix}layers.{full}."
    hidden = int(text["hidden_size"])
    generator = torch.Generator().manual_seed(seed + 1)
    mtp = {"mtp.fc.weight": (torch.randn(hidden, 2 * hidden, generator=generator) * 0.02).to(torch.bfloat16)}
    for name in ("pre_fc_norm_hidden", "pre_fc_norm_embedding", "norm"):
        mtp[f"mtp.{name}.weight"] = weights[f"{prefix}norm.weight"].clone()
    mtp.update({"mtp.layers.0." + k[len(layer):]: v.clone() for k, v in weights.items() if k.startswith(layer)})
    save_file({**weights, **mtp}, weights_path + ".tmp", metadata={"format": "pt"})
    os.replace(weights_path + ".tmp", weights_path)
    with open(config_path + ".tmp", "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)
    os.replace(config_path + ".tmp", config_path)


