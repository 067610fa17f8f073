"""KVPP's subclasses of vLLM's KV connectors: what every one shares (`base`), vLLM's disk connector
(`example`), NIXL (`nixl`), Mooncake (`mooncake`), and the plugin's routing of a configured connector to
them (`routing`). vLLM's factory finds the classes by name in ``kvpp_fx.integrations.vllm.connectors``.
Imports nothing: the plugin must stay cheap in every vLLM process."""
