"""ELDR decode adapter: reports a vLLM decode instance's load and liveness to the routers."""
