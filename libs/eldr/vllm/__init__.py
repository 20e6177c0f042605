"""ELDR inside and in front of vLLM.

- `capture`: folds the expert ids routed for each prompt token into per-KV-block summaries
  and prefill-done events (pure: numpy and `eldr.core`/`eldr.wire` only);
- `publisher`: hands those messages to NATS from a background thread, never blocking the
  engine;
- `plugin`: the `vllm.general_plugins` entry point that hooks every MoE router of the model
  in vLLM's worker process;
- `sources`: the other source of the same records, vLLM's built-in routed-experts output;
- `pd`: the disaggregated prefill -> decode handoff as pure functions (request bodies,
  decode candidates, headers), and `gateway`: the gateway's decision waiting and in-flight
  bookkeeping (the HTTP and bus wiring is `eldr_services.gateway`);
- `tinymodel`: a tiny random-weight Qwen3-MoE plus a locally trained tokenizer, for tests
  and the runnable example.

Nothing here imports vLLM, torch or transformers at module level: the main environment
imports and type-checks this package without them (they live in `.venv-vllm`, see
docs/VLLM.md).
"""
