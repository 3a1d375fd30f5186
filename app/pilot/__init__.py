"""The pilot, in one place: `regen pilot` measures a host on a sample of the real input in each candidate
setting and forecasts the whole job.

Its steps, one module each:

- `app.pilot.sample`: the seeded sample of the lines a run would enqueue, through the producer's readers;
- `app.pilot.host`: one real `regen run` per candidate on this host, its peak memory polled
  (`app.pilot.peak_memory`), the reference check after it, the host's pilot JSON written;
- `app.pilot.measure`: what each candidate's run measured, read from its storage;
- `app.pilot.forecast`: the candidates, the rates, the fleet's forecast and the recommended lines, the pilot
  files, and a run's rate beside its pilots' forecast (`regen status`).

A floor of its own, above the producer, the workers and the run readers it assembles (tests.test_layout):
only the commands (`app.cli.pilot`, `regen produce --pilot`, `regen status`) import it.
"""
