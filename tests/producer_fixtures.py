"""Shared fixtures for the producer tests: a real Redis db, a tiny model folder, and queue decoding.

Import the fixtures into a test module (`from tests.producer_fixtures import producer_redis, tiny_model`).
Redis: the local server, db 5, flushed before each test; missing Redis fails under CI and skips elsewhere, so
CI can never pass by skipping.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest

from tests.redis_urls import redis_url

FORMATS_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "formats"
REDIS_URL = os.environ.get("REGEN_TEST_PRODUCER_REDIS", redis_url(5))
QUEUE = "regen-test"

_SENTENCES = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "The smart lights in your living room have been adjusted to provide a cozy ambiance.",
    "Can you guide me through the process of enabling the secondary image hover feature?",
    "Sure, I'd be happy to review the Samsung S22 Ultra and the iPhone 14 Pro Max.",
    "Expresses excitement about an invitation to lecture at a Baroque art conference in Paris.",
    "<tool_call> {\"name\": \"set_smart_light_color\", \"arguments\": {}} </tool_call>",
]

# Qwen3-style ChatML; with enable_thinking=False the generation prompt carries an empty think block.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


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
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_config_model(tmp_path_factory) -> Path:
    """config.json only: enough for everything but the dry-run token estimate."""
    folder = tmp_path_factory.mktemp("tiny-config")
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 4, "hidden_size": 128}))
    return folder


@pytest.fixture
def producer_redis():
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.exceptions.ConnectionError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"Redis at {REDIS_URL} is required in CI: {exc}")
        pytest.skip(f"no Redis at {REDIS_URL}: {exc}")
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


def decode_queue(client, queue: str = QUEUE) -> list[dict]:
    """The task messages waiting in a Celery Redis queue, oldest first (kombu LPUSHes and workers BRPOP)."""
    from kombu.compression import decompress
    from kombu.utils.json import loads as kombu_loads

    out = []
    for raw in reversed(client.lrange(queue, 0, -1)):
        envelope = kombu_loads(raw)  # kombu's decoder: it restores {"__type__": "bytes"} bodies
        body = envelope["body"]
        if envelope["properties"].get("body_encoding") == "base64":
            body = base64.b64decode(body)
        compression = envelope["headers"].get("compression")
        if compression:
            body = decompress(body, compression)
        _args, kwargs, _embed = json.loads(body)
        out.append({"task": envelope["headers"]["task"], "id": envelope["headers"]["id"], "kwargs": kwargs,
                    "compression": compression})
    return out


def write_jsonl(path: Path, rows: list) -> Path:
    """Rows as JSON Lines; a `bytes` row is written verbatim (for malformed and non-UTF-8 lines)."""
    with open(path, "wb") as fh:
        for row in rows:
            fh.write(row if isinstance(row, bytes) else json.dumps(row).encode())
            fh.write(b"\n")
    return path


def sharegpt_row(i: int, text: str = "question") -> dict:
    return {"conversations": [{"from": "human", "value": f"{text} {i}"}, {"from": "gpt", "value": f"answer {i}"}],
            "id": f"row-{i}"}
