"""The read side of a run: what the workers published, read back (run reader, verify, stats, exports to the
trainers, the training dataset, the transformers reference check). It imports only the shared base in `app/`."""
