"""The workers: Celery tasks, the vLLM engine, hidden-state capture, quality gate and device pinning."""
