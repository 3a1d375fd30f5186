"""The tests' fixtures, one module per real component under tests/support/ (Redis dbs, tiny models, worker
processes), loaded here as plugins so every test folder sees them without importing them."""

pytest_plugins = ["tests.support.redis_db", "tests.support.models", "tests.support.workers"]
