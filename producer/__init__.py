"""The producer: read prompt files, normalise them to chat messages, dedupe, shard and enqueue."""
