"""`python -m app.cli` runs the `regen` console script (tests and the soak script start workers this way)."""

from app.cli import main

main()
