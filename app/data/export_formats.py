"""Every `regen export --format`, in one list: what each is, what it needs, and which class writes it.

Why one list: a format's name used to be spelled in six places (the exporter's tuples, the trainer module's
tuples and its class table, the CLI's choices, the format checks, the docs' tables) with nothing tying them
together. Now the CLI's `--format` choices, the exporter's checks (`Exporter`, app.data.export) and the
summary table in docs/formats.md are read from `FORMATS`, and tests/data/test_export_formats.py holds the docs'
and the README's tables to it.

This module imports nothing heavy (the CLI reads it for `--help`): a writer class is named as
`module:Class` and imported by `writer_class()` when an export starts; a format's optional dependencies are
imported by `require()` (app.base.packages) before any work, so a missing one is one line with the pip command, not a traceback
half-way through an export.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from app.base.errors import ConfigError
from app.base.packages import require

TEXT, STATES, TOKENS = "text", "hidden states", "token-only"


@dataclass(frozen=True)
class ExportFormat:
    name: str
    kind: str  # TEXT: rows of text; STATES: the captured hidden states; TOKENS: ids and loss masks only
    description: str  # one line, for the docs table
    reads_with: str  # the trainer or reader that loads it, for the docs table
    writer: str | None = None  # `module:Class` (a StateExport) for STATES and TOKENS; text rows: the exporter's own
    per_conversation: bool = False  # TEXT: one row per conversation (every turn), not one per record
    final_norm: bool = False  # applies the target's final norm: reads the checkpoint (`--model`)
    keeps_unterminated: bool = True  # `--include-unterminated` is allowed (TEXT)
    file: str | None = None  # the one file holding every row, where the format writes one
    requires: tuple[str, ...] = ()  # optional modules imported before any work (app.base.packages)
    final_layer: bool = False  # STATES: writes the final layer (vLLM id N), so the run must have captured it
    aux_layers: int | None = None  # STATES: exactly this many auxiliary layers besides the final one (None: any)

    @property
    def needs_states(self) -> bool:
        """Only a run that captured hidden states (`--capture inline` or `staged`) can be exported so."""
        return self.kind == STATES

    @property
    def needs(self) -> str:
        """What the format needs, in words (the docs table)."""
        parts = ["a capture run" if self.needs_states else "any run"]
        if self.final_norm:
            parts.append("the target checkpoint (final norm)")
        return ", ".join(parts)

    def writer_class(self) -> type:
        """The class that writes the format (STATES and TOKENS), imported now."""
        if self.writer is None:
            raise ValueError(f"the {self.name} format's rows are written by the exporter itself")
        module, cls = self.writer.split(":")
        return getattr(importlib.import_module(module), cls)

    def require(self) -> None:
        """Import the format's optional packages; a missing one is a ConfigError with the pip command."""
        for module in self.requires:
            require(module, f"regen export --format {self.name}")


TORCH = "torch"  # token_freq.pt and SpecForge's .ckpt files are torch.save output
DATASETS = "datasets"  # speculators' dataset (save_to_disk)
PYARROW = "pyarrow"

# In the order `regen export --help` lists them.
FORMATS: dict[str, ExportFormat] = {f.name: f for f in (
    ExportFormat("sharegpt", TEXT, "one row per conversation: every turn the model saw, reasoning and tool calls",
                 "LLaMA-Factory / axolotl; `regen produce` reads it back", per_conversation=True),
    ExportFormat("parquet", TEXT, "one row per record (per turn sample), one fixed schema",
                 "`datasets.load_dataset(\"parquet\", ...)`", requires=(PYARROW,)),
    ExportFormat("specforge-jsonl", TEXT, "SpecForge's regenerated-data rows, also joined into one file",
                 "SpecForge online training (`data.train_data_path`)", per_conversation=True,
                 keeps_unterminated=False, file="regenerated.jsonl"),
    ExportFormat("specforge-dflash", STATES, "`data_{i}.ckpt`: ids, loss mask, the auxiliary layers side by side",
                 "SpecForge offline DFlash (`data.hidden_states_path`)",
                 writer="app.data.export_specforge:SpecForgeDFlash", requires=(TORCH,)),
    ExportFormat("specforge-eagle3", STATES, "`data_{i}.ckpt`: the normed final layer and three auxiliary layers",
                 "SpecForge offline EAGLE-3 (`training.strategy=eagle3`)",
                 writer="app.data.export_specforge:SpecForgeEagle3", final_norm=True, requires=(TORCH,),
                 final_layer=True, aux_layers=3),
    ExportFormat("speculators", STATES, "a `save_to_disk` dataset and `hidden_states/hs_{i}.safetensors`",
                 "`speculators train --data-path`", writer="app.data.export_speculators:Speculators",
                 requires=(TORCH, DATASETS), final_layer=True),
    ExportFormat("specforge-online", TOKENS, "`prompts.jsonl`: ids and loss masks, no states",
                 "SpecForge online (`data.prompts_path`), the target on SGLang capture servers",
                 writer="app.data.export_online:SpecForgeOnline", file="prompts.jsonl", requires=(TORCH,)),
    ExportFormat("speculators-online", TOKENS, "the `speculators` dataset without `hidden_states/`",
                 "`speculators train --on-missing generate`, states from a vLLM endpoint",
                 writer="app.data.export_online:SpeculatorsOnline", requires=(TORCH, DATASETS)),
)}


def get(name: str) -> ExportFormat:
    """The format called `name`; an unknown name is a ConfigError listing the known ones."""
    if name not in FORMATS:
        raise ConfigError(f"unknown export format {name!r} (one of {', '.join(FORMATS)})")
    return FORMATS[name]


def names(kind: str | None = None) -> list[str]:
    """Every format's name (or those of one kind), in the listed order."""
    return [f.name for f in FORMATS.values() if kind is None or f.kind == kind]


def markdown_table() -> str:
    """The summary table docs/formats.md shows (tests/data/test_export_formats.py keeps it equal to this)."""
    lines = ["| `--format` | kind | needs | optional packages | what is written | read with |",
             "|---|---|---|---|---|---|"]
    for f in FORMATS.values():
        packages = ", ".join(f"`{module}`" for module in f.requires) or "-"
        lines.append(f"| `{f.name}` | {f.kind} | {f.needs} | {packages} | {f.description} | {f.reads_with} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # `python -m app.data.export_formats`: the docs table, to paste after a change
    print(markdown_table(), end="")
