"""The tests' fixtures, one module per real component under tests/support/ (Redis dbs, tiny models, worker
processes), loaded here as plugins so every test folder sees them without importing them; `ci_skips` turns a
skip into a failure under CI."""

pytest_plugins = ["tests.support.redis_db", "tests.support.models", "tests.support.workers",
                  "tests.support.ci_skips"]
