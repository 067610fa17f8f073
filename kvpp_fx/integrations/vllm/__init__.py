"""vLLM integration of kvpp-fx (loaded by vLLM through the ``vllm.general_plugins`` entry point).

Status: configuration validation at ``LLM(...)``/``vllm serve`` construction, and compatibility of the
rewritten graph with vLLM's own ``split_graph``. Cache allocation, the step hooks and the two graph
paths inside vLLM's CPU worker are not implemented yet; with ``enable_kvpp`` on, vLLM still runs with
its replicated cache (see docs/vllm.md).
"""
