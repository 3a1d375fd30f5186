"""The vLLM engine a worker generates and captures with: in this process or in a child process of its own.

interface.py          `Engine`, what both offer and what the worker's code holds
in_process.py         `InProcessEngine`: vLLM stepped by one thread, results handed on by another
process.py            `EngineProcess`: an `InProcessEngine` in a child process (the CPU worker's), over a pipe
options.py            `EngineOptions`, what an engine is built from
request.py            `GenRequest` and `GenResult`, what goes in and comes out per request
jobs.py               `BatchJob` and `ExclusiveCall`, what a caller waits on
llm_arguments.py      the `vllm.LLM` arguments and per-request sampling parameters
settings.py           settings chosen from the model's config; the vLLM a hybrid target needs
capture_connector.py  vLLM's hidden-state connector, made to work on the CPU
capture_file.py       reading and removing the connector's per-request files
self_test.py          the start-up test: the run's sampling, prompts that break engines, the capture check
recapture.py          a sample's stored ids captured again in a batch of their own and compared
factory.py            the engine a worker builds from its options (the stand-in engine's one plug point)
fault_hook.py         the capture path's hook for the test-only fault injector (its one plug point)
engine_mode.py        the mode a built engine runs in (runner, scheduling, chunking, graphs, device)
limits.py             settings an engine is known to crash on, refused before it runs
scheduling.py         how the engine and the worker's side threads share a CPU's cores

Nothing here imports the rest of workers/ but the doubles at their plug points (factory.py, fault_hook.py;
vLLM's environment is written by the base's app.process_env).
"""
