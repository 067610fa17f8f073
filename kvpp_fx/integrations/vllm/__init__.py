"""vLLM integration of kvpp-fx (loaded by vLLM through the ``vllm.general_plugins`` entry point).

``backend`` is the compiled path's Dynamo backend:
``compilation_config={"mode": 2, "backend": "kvpp_fx.integrations.vllm.backend"}``. See docs/vllm.md.
Importing this package imports nothing else: the plugin must stay cheap in every vLLM process.
"""

from typing import Any

__all__ = ["backend"]


def __getattr__(name: str) -> Any:
    if name == "backend":
        from kvpp_fx.integrations.vllm.attention.compilation import kvpp_vllm_backend

        return kvpp_vllm_backend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
