"""The pilot, in one place: `regen pilot` measures a host on a sample of the real input in each candidate
setting and forecasts the whole job.

Steps, one module each: `sample`, `host` (with `peak_memory`), `measure`, `forecast`
(docs/pilot.md#the-pilots-modules). A floor of its own, above the producer, the workers and the run readers it
assembles (tests.test_layout): only the commands (`app.cli.pilot`, `regen produce --pilot`, `regen status`)
import it.
"""
