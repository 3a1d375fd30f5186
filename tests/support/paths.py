"""Where the tests find the repository and the fixture files they read (all inside the repository)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES_DIR = REPO / "tests" / "fixtures"  # files the tests read: chat conversations, an old-version .rgh file
FORMATS_DIR = FIXTURES_DIR / "formats"  # one row per input shape the producer meets (README.md there)
