"""The tiny models the tests build offline (no model hub is reachable): random weights, real tokenizer and
chat template, session-scoped because building one takes seconds.

- `tiny_qwen3`: the dense 4-layer Qwen3 every end-to-end run uses, on the family-convention template with the
  small vocabulary: on the real one vLLM-CPU's top-p sort over 248K logits a step made the fault and e2e runs
  several times slower (the suite past an hour on 2 cores).
- `tiny_hybrid`: the text-only Qwen3.5 hybrid (Gated DeltaNet + full attention) of the hybrid worker, with the
  Qwen3.5/3.6 family's real 248K vocabulary (workers.tiny_vocab) and the family's template as it is: every input
  shape (tool calls, multi-turn, both modes) and both trainers' readers run on it (tests/workers/test_family_e2e.py).
- `tiny_hybrid_mm`: the hybrid in the released multimodal checkpoint shape (small vocabulary).
- `tiny_mtp_hybrid`: the text-only hybrid with a one-layer MTP head (`mtp.*` weights), for `--speculative mtp`.
- `tiny_model` / `tiny_config_model`: the producer's: config and tokenizer only (it never runs weights).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.tiny_model import QWEN3_CHAT_TEMPLATE
from workers.tiny_vocab import QWEN3_6

_SENTENCES = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "The smart lights in your living room have been adjusted to provide a cozy ambiance.",
    "Can you guide me through the process of enabling the secondary image hover feature?",
    "Sure, I'd be happy to review the Samsung S22 Ultra and the iPhone 14 Pro Max.",
    "Expresses excitement about an invitation to lecture at a Baroque art conference in Paris.",
    "<tool_call> {\"name\": \"set_smart_light_color\", \"arguments\": {}} </tool_call>",
]

def build_tiny_model(folder: Path, num_layers: int = 4, hidden_size: int = 128) -> Path:
    """A model folder with a Qwen3 config.json and a small trained byte-level BPE tokenizer (offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "num_hidden_layers": num_layers,
        "hidden_size": hidden_size,
        "intermediate_size": 256,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
    }
    (folder / "config.json").write_text(json.dumps(config))
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_SENTENCES * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = QWEN3_CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    from workers.tiny_model import build_tiny_qwen3

    return Path(build_tiny_qwen3(str(tmp_path_factory.mktemp("tiny-qwen3"))))


@pytest.fixture(scope="session")
def tiny_hybrid(tmp_path_factory) -> Path:
    from workers.tiny_model import build_tiny_qwen3_5

    return Path(build_tiny_qwen3_5(str(tmp_path_factory.mktemp("tiny-qwen3_5")), vocab=QWEN3_6))


@pytest.fixture(scope="session")
def tiny_hybrid_mm(tmp_path_factory) -> Path:
    from workers.tiny_model import build_tiny_qwen3_5

    return Path(build_tiny_qwen3_5(str(tmp_path_factory.mktemp("tiny-qwen3_5-mm")), multimodal=True))


@pytest.fixture(scope="session")
def tiny_mtp_hybrid(tmp_path_factory) -> Path:
    from workers.tiny_model import build_tiny_qwen3_5

    return Path(build_tiny_qwen3_5(str(tmp_path_factory.mktemp("tiny-qwen3_5-mtp")), mtp=True))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_config_model(tmp_path_factory) -> Path:
    """config.json only: enough for everything but the dry-run token estimate."""
    folder = tmp_path_factory.mktemp("tiny-config")
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 4, "hidden_size": 128}))
    return folder
