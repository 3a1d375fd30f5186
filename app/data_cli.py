"""Commands that read a run's data: verify, stats, export."""

commands: list = []
