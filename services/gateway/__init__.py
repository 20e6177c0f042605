"""ELDR gateway: the OpenAI-compatible front door of a disaggregated vLLM deployment."""
