"""What the tests share, one module per real component: Redis, models, worker processes, engines, runs."""
