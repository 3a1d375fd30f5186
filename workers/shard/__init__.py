"""What a worker does to one shard, in the order a delivery meets it.

tasks.py          the Celery tasks `generate_shard` and `capture_shard`, and their work
delivery.py       one delivery around that work: claimed, guarded, a failure settled by its class
task_guards.py    the guards a delivery passes before its work, and what a failed attempt leaves behind
generate.py       a shard's samples through the engine: prompts, records, hidden states checked and encoded
multiturn.py      every assistant turn of a conversation regenerated in order
capture_stage.py  the staged run's second stage: capture the states of records generated before
shard_output.py   publishing: records and states under attempt names, then the completion marker
"""
