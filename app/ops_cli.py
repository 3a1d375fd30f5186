"""Commands for operating the fleet: status, metrics."""

commands: list = []
