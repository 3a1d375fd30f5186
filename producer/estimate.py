"""`regen produce --dry-run`: what a run will cost before anything is enqueued.

Why: hidden states are large (tens of KB per token at the job's size), so a user must see the token and disk
figures before the GPUs start. Prompt tokens are counted with the target's tokenizer and template on a seeded
sample and scaled; response tokens and compression ratios are stated as assumptions, every stored dtype's disk
beside the run's. How each figure is made: docs/configuration.md#what-the-dry-run-estimates.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from app.base.chat_render import load_tokenizer, render_ids
from app.base.states_codec import promised_bound
from app.base.tool_calls import prepare

COMPRESSION_RATIO = 1.45
BYTES_PER_VALUE = 2  # bf16
# Raw bf16 bytes / stored bytes for each `--states-dtype`, measured by bench/bench_hidden_codec.py: the lower of
# its two data sets (states captured from a random-init model, and synthetic ones with outliers), rounded down
# (the lossy ones; bf16 keeps the figure above).
STORED_RATIOS = {"bf16": COMPRESSION_RATIO, "fp8-e4m3": 2.30, "bf16-m3": 2.23, "bf16-m4": 1.96}


def hidden_state_bytes(tokens: int, layers: int, hidden_size: int) -> int:
    """Raw bytes of hidden states for `tokens` context tokens at `layers` layers."""
    return tokens * layers * hidden_size * BYTES_PER_VALUE


def compressed_bytes(raw: int, ratio: float = COMPRESSION_RATIO) -> int:
    return int(raw / ratio)


def human_bytes(n: float) -> str:
    """Decimal units (disks are sold in TB): 140_390_400_000_000 -> '140.4 TB'."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


class Reservoir:
    """A uniform random sample of up to `size` items from a stream of unknown length (Algorithm R)."""

    def __init__(self, size: int, seed: int = 0):
        self.size = size
        self.items: list = []
        self.seen = 0
        self._rng = random.Random(seed)

    def offer(self, item) -> None:
        self.seen += 1
        if len(self.items) < self.size:
            self.items.append(item)
            return
        j = self._rng.randrange(self.seen)
        if j < self.size:
            self.items[j] = item


def turn_prompts(messages: list[dict]) -> list[list[dict]]:
    """The prompt of each response the sample will get: one in `last` mode; in `all` mode one per turn to
    regenerate, the conversation before it with the old answers standing in for the new ones."""
    slots = [i for i, m in enumerate(messages) if "original_content" in m]
    if not slots:
        return [messages]
    stand_in = [{"role": "assistant", "content": m["original_content"] or ""} if "original_content" in m else m
                for m in messages]
    return [stand_in[:slot] for slot in slots]


def count_prompt_tokens(model_path: str, samples: list[dict], thinking: bool,
                        preserve_thinking: bool = False) -> list[int]:
    """Chat-templated prompt lengths, with the generation prompt, as the engine will see them."""
    tokenizer = load_tokenizer(model_path)
    counts = []
    for sample in samples:
        total = 0
        for messages in turn_prompts(sample["messages"]):
            # Rendered and encoded exactly as the worker does (app.base.chat_render, app.base.tool_calls).
            total += len(render_ids(tokenizer, prepare(messages), sample.get("tools"), thinking, preserve_thinking))
        counts.append(total)
    return counts


def count_responses(samples: list[dict]) -> list[int]:
    """Responses (training samples) each sample will give: its turns to regenerate in `all` mode, else 1."""
    return [len(turn_prompts(s["messages"])) for s in samples]


@dataclass
class Estimate:
    samples: int
    sampled: int
    prompt_tokens: int
    response_tokens_assumed: int
    response_tokens_max: int
    layers: int
    hidden_size: int
    responses: int | None = None  # training samples (multi-turn: one per regenerated turn); None: one per sample
    states_dtype: str = "bf16"  # resolved (app.base.states_codec.resolve)

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.response_tokens_assumed

    @property
    def raw_bytes(self) -> int:
        return hidden_state_bytes(self.context_tokens, self.layers, self.hidden_size)

    @property
    def raw_bytes_max(self) -> int:
        return hidden_state_bytes(self.prompt_tokens + self.response_tokens_max, self.layers, self.hidden_size)

    def lines(self) -> list[str]:
        per_token = self.layers * self.hidden_size * BYTES_PER_VALUE
        out = [
            f"prompt tokens: {self.prompt_tokens:,} (estimate from {self.sampled:,} of {self.samples:,} prompts, "
            "tokenised with the model's chat template)",
            f"response tokens: {self.response_tokens_assumed:,} assumed, {self.response_tokens_max:,} at most",
        ]
        if self.responses is not None and self.responses != self.samples:
            out.append(f"responses: {self.responses:,} (every regenerated turn is a sample with its own states)")
        if self.layers == 0:
            out.append("hidden states: capture off, nothing stored")
            return out
        out += [
            f"hidden states: {self.layers} layers x {self.hidden_size} x {BYTES_PER_VALUE} bytes = "
            f"{per_token:,} B per token",
            f"disk, raw: {human_bytes(self.raw_bytes)} (at most {human_bytes(self.raw_bytes_max)})",
            f"disk, compressed: {human_bytes(compressed_bytes(self.raw_bytes))} "
            f"(assumes the {COMPRESSION_RATIO} zstd ratio measured on bf16 activations)",
        ]
        return out + self.stored_lines()

    def stored_lines(self) -> list[str]:
        """The disk for each `--states-dtype`, this run's marked."""
        out = ["disk by --states-dtype (* this run; ratios measured by bench/bench_hidden_codec.py):"]
        for dtype, ratio in STORED_RATIOS.items():
            what = "lossless" if dtype == "bf16" else f"error <= {promised_bound(dtype, self.hidden_size)} x token norm"
            name = dtype + (" *" if dtype == self.states_dtype else "")
            out.append(f"  {name:<11} {human_bytes(compressed_bytes(self.raw_bytes, ratio)):>9} "
                       f"(at most {human_bytes(compressed_bytes(self.raw_bytes_max, ratio))}; {ratio}x, {what})")
        return out


def build_estimate(*, samples: int, token_counts: list[int], max_tokens: int, assumed_response_tokens: int | None,
                   layers: int, hidden_size: int, response_counts: list[int] | None = None,
                   states_dtype: str = "bf16") -> Estimate:
    """`token_counts` and `response_counts` are per sampled sample (all its turns' prompts; its responses)."""
    sampled = len(token_counts)
    prompt_tokens = round(sum(token_counts) * samples / sampled) if sampled else 0
    responses = round(sum(response_counts) * samples / len(response_counts)) if response_counts else samples
    per_response = assumed_response_tokens if assumed_response_tokens is not None else max_tokens // 2
    return Estimate(
        samples=samples,
        sampled=sampled,
        prompt_tokens=prompt_tokens,
        response_tokens_assumed=responses * per_response,
        response_tokens_max=responses * max_tokens,
        layers=layers,
        hidden_size=hidden_size,
        responses=responses,
        states_dtype=states_dtype,
    )
