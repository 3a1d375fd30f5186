"""What the producer's tests share: their queue, a reader of the task messages waiting in it, input files."""

from __future__ import annotations

import base64
import json
from pathlib import Path

QUEUE = "regen-test"


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
