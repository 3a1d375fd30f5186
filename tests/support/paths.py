"""Where the tests find the repository and the real dataset rows the producer must read."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FORMATS_DIR = REPO.parent / "shared" / "data" / "formats"
FIXTURES_DIR = REPO / "tests" / "fixtures"  # files the tests read: chat conversations, an old-version .rgh file
