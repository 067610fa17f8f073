"""vLLM integration of kvpp-fx (loaded by vLLM through the ``vllm.general_plugins`` entry point).

``backend`` is the compiled path's Dynamo backend:
``compilation_config={"mode": 2, "backend": "kvpp_fx.integrations.vllm.backend"}``. See docs/vllm.md.
"""

from kvpp_fx.integrations.vllm.compilation import kvpp_vllm_backend as backend

__all__ = ["backend"]
