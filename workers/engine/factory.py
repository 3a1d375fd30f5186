"""The worker's engine, built from its options: vLLM in this process, vLLM in a process of its own, or (benchmarks
and tests only) an engine standing in for a GPU.

The one plug point of the stand-in engine (workers.doubles.stand_in): the worker picks it by its
`--stand-in-engine` spec here, and `regen worker` reads how many devices the spec stands for here.
"""

from __future__ import annotations

import logging

from workers.doubles.stand_in import StandInEngine, StandInSpec
from workers.engine.in_process import InProcessEngine
from workers.engine.interface import Engine
from workers.engine.options import EngineOptions
from workers.engine.process import PROCESS_NAME, EngineProcess

log = logging.getLogger("regen.worker")


def build_engine(options: EngineOptions, stand_in: str | None = None) -> Engine:
    """The engine `options` describe; with a `stand_in` spec, the engine standing in for a GPU instead."""
    if stand_in:  # benchmarks and tests only: the real worker around an engine standing in for a GPU
        engine = StandInEngine(options, stand_in)
        log.warning("engine: %s, standing in for a GPU (benchmarks and tests only)", engine.spec.text())
        return engine
    if options.host_process:
        engine_process = EngineProcess(options)
        log.info("engine runs in its own process, %s (pid %d); --no-engine-host keeps it in this one",
                 PROCESS_NAME, engine_process.pid)
        return engine_process
    return InProcessEngine(options)


def stand_in_devices(spec: str) -> int:
    """How many worker processes a stand-in spec asks for (one device each); refuses a malformed spec."""
    return StandInSpec.parse(spec).devices
