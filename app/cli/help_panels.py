"""How each command's `--help` groups its options: one list of panels per command, declared here only.

Why one table: an option added to a command (here or on another branch) must be placed in a panel, or
tests/cli/test_help.py fails naming it; the panels of every command read side by side, so the same kind of
option sits under the same title everywhere. rich-click renders them (`option_groups`, matched on the command's
path, `regen produce`); its `--help` lists a panel's options in the order given here.
"""

from __future__ import annotations

RUN = "Run"
INPUTS = "Inputs"
GENERATION = "Generation"
CAPTURE = "Model and capture"
ENGINE = "Engine"
FLEET = "Broker, storage and queues"
WORKERS = "Local workers"
QUALITY = "Quality gate"
ESTIMATE = "Estimate (--dry-run)"
OUTPUT = "Output"
PARALLEL = "Parallel"
HELP = "Help"

# The options every command that makes a run takes in the same panels (produce, run, pilot).
_GENERATION = ["--max-tokens", "--thinking", "--thinking-mix", "--preserve-thinking", "--thinking-budget",
               "--thinking-close", "--samples-per-prompt", "--sample-temperatures", "--temperature", "--top-p",
               "--top-k", "--min-p", "--seed"]
_INPUTS = ["--take", "--regenerate", "--max-prompt-tokens", "--max-prompt-chars", "--shard-size"]
_CAPTURE = ["--model", "--layers", "--capture", "--states-dtype", "--capture-check-every", "--speculative",
            "--vllm-arg"]
_QUALITY = ["--stop-loops", "--pause-stub-rate", "--pause-window", "--pause-min-samples"]

PANELS: dict[str, list[tuple[str, list[str]]]] = {
    "produce": [
        (RUN, ["--run", "--resume", "--dry-run", "--pilot"]),
        (CAPTURE, _CAPTURE),
        (GENERATION, _GENERATION),
        (INPUTS, _INPUTS),
        (FLEET, ["--storage", "--broker", "--queue", "--max-pending", "--compress"]),
        (QUALITY, _QUALITY),
        (ESTIMATE, ["--estimate-sample", "--assumed-response-tokens"]),
    ],
    "run": [
        (RUN, ["--run", "--timeout", "--pilot"]),
        (CAPTURE, _CAPTURE),
        (GENERATION, _GENERATION),
        (INPUTS, _INPUTS),
        (WORKERS, ["--cpu", "--gpus", "--max-model-len", "--task-slots", "--encode-threads", "--engine-host"]),
        (FLEET, ["--storage", "--broker"]),
        (QUALITY, _QUALITY),
    ],
    "pilot": [
        (RUN, ["--name", "--sample", "--candidates", "--reference", "--timeout", "--keep-runs"]),
        ("Forecast", ["--forecast-only", "--host-results", "--complete-share"]),
        (CAPTURE, ["--model", "--layers", "--vllm-arg"]),
        (GENERATION, _GENERATION),
        (INPUTS, ["--take", "--regenerate", "--max-prompt-tokens", "--shard-size"]),
        (WORKERS, ["--cpu", "--gpus", "--max-model-len"]),
        (FLEET, ["--storage", "--broker"]),
    ],
    "worker": [
        (RUN, ["--run", "--model", "--layers", "--queue"]),
        ("Devices", ["--cpu", "--gpus", "--name", "--log-dir"]),
        (ENGINE, ["--max-model-len", "--max-num-seqs", "--gpu-memory-utilization", "--kv-cache-gib",
                  "--tensor-parallel-size", "--vllm-arg", "--engine-host"]),
        ("Throughput", ["--task-slots", "--encode-threads"]),
        ("Failures", ["--max-attempts", "--max-crashes"]),
        (FLEET, ["--broker", "--storage"]),
        ("Benchmarks and tests", ["--stand-in-engine"]),
    ],
    "reconcile": [(FLEET, ["--storage", "--broker", "--queue", "--max-pending", "--compress"])],
    "retry-dead": [(RUN, ["--shard"]), (FLEET, ["--storage", "--broker", "--queue", "--max-pending", "--compress"])],
    "resume-run": [(FLEET, ["--storage", "--broker", "--queue"])],
    "status": [(OUTPUT, ["--json", "--watch", "--interval"]),
               ("Workers", ["--inspect-timeout", "--stale-after"]),
               (FLEET, ["--storage", "--broker"])],
    "metrics": [("Server", ["--port", "--addr"]), ("What to export", ["--run", "--queue"]),
                (FLEET, ["--storage", "--broker"])],
    "verify": [("Checks", ["--reference", "--device", "--sample", "--strict", "--allow-incomplete"]),
               (OUTPUT, ["--json"]), (PARALLEL, ["--workers", "--processes", "--part"]), (FLEET, ["--storage"])],
    "stats": [(OUTPUT, ["--json", "--html"]), (PARALLEL, ["--processes", "--part"]), (FLEET, ["--storage"])],
    "export": [(OUTPUT, ["--format", "--out", "--layers", "--model"]),
               ("Which samples", ["--exclude-flags", "--min-response-tokens", "--include-unterminated"]),
               (PARALLEL, ["--processes", "--part"]), (FLEET, ["--storage"])],
    "tiny-model": [("Model", ["--arch", "--num-layers", "--multimodal", "--mtp", "--vocab"])],
    "selfcheck": [("Checks", ["--device", "--modes", "--models", "--timeout"]), (OUTPUT, ["--workdir", "--json"])],
}


# `regen --help`: the commands by what they are for, in the order of a job.
COMMANDS: list[tuple[str, list[str]]] = [
    ("Plan and run a job", ["pilot", "produce", "worker", "run"]),
    ("Watch", ["status", "metrics"]),
    ("Check and hand over", ["verify", "stats", "export"]),
    ("Recover", ["reconcile", "retry-dead", "resume-run"]),
    ("Tools", ["selfcheck", "tiny-model"]),
]


def command_groups(group_name: str) -> dict[str, list[dict]]:
    """rich-click's `command_groups` for the top-level help."""
    return {group_name: [{"name": name, "commands": list(commands)} for name, commands in COMMANDS]}


def option_groups(group_name: str) -> dict[str, list[dict]]:
    """rich-click's `option_groups`: `{"regen produce": [{"name": ..., "options": [...]}, ...]}`, help last."""
    return {f"{group_name} {command}": [*({"name": name, "options": list(options)} for name, options in panels),
                                        {"name": HELP, "options": ["--help"]}]
            for command, panels in PANELS.items()}


def grouped(command: str) -> set[str]:
    """Every flag the panels of `command` name."""
    return {flag for _, options in PANELS.get(command, []) for flag in options}
