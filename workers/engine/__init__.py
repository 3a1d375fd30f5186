"""The vLLM engine a worker generates and captures with: in this process or in a child process of its own."""
