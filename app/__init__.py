"""Shared core of regen: configuration, the Celery app, storage, the run manifest, record schema and codecs.

Everything the producer and the workers must agree on lives here, so that a record written by a worker on
one host is read the same way by `regen status`, `verify` and `export` on another.
"""
