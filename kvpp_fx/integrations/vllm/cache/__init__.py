"""The KV cache under vLLM: specs from vLLM's cache specs (`specs`), the plan and scratch layout and the
memory budget (`layout`, `scratch`), and KVPP's allocator with its self-check (`allocation`). Imports
nothing: the plugin must stay cheap in every vLLM process."""
