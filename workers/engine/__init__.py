"""The vLLM engine a worker generates and captures with: in this process or in a child process of its own.

`Engine` (interface.py) is what the worker's code holds; `InProcessEngine` steps vLLM on a thread of this
process, `EngineProcess` runs one in a child process (the CPU worker's). Nothing here imports the rest of
workers/ (vLLM's environment is written by the base's app.base.process_env).
Each module, file by file: docs/workers.md#the-engine-package-file-by-file.
"""
