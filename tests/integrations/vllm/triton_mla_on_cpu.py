"""Test-only: vLLM's TRITON_MLA backend (a CUDA user's MLA kernel) on vLLM CPU, under Triton's interpreter.

Three changes, applied in every process of an engine whose environment sets `ENV` (the TP workers are
spawned and re-run the entry module, which imports this one):

- the CPU platform returns TRITON_MLA when ``attention_backend="TRITON_MLA"`` is asked (it knows only its own
  MLA backends);
- TRITON_MLA's cache write is CPU_MLA's: its own is the CUDA-only ``concat_and_cache_mla``, and CPU_MLA's
  writes the same bytes (the latent, then the rope part, per slot); for an fp8 cache (which CPU_MLA does
  not have) the write follows ``concat_and_cache_mla``'s fp8 contract in torch: each value divided by the
  layer's k scale, saturated to e4m3's range, stored as e4m3 bytes;
- TRITON_MLA accepts float32, in which its Triton decode kernel is exact under the interpreter (the
  interpreter multiplies bfloat16 ``tl.dot`` operands as raw bits).

Nothing else of TRITON_MLA changes: its metadata builder, ``forward_mqa`` and ``decode_attention_fwd`` run as
on CUDA, interpreted.
"""

from __future__ import annotations

import os

ENV = "KVPP_TESTS_TRITON_MLA"
_APPLIED = "_kvpp_tests_triton_mla"


def apply() -> None:
    import torch
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend, TritonMLAImpl
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if getattr(CpuPlatform, _APPLIED, False):
        return
    original = CpuPlatform.get_attn_backend_cls.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if attn_selector_config.use_mla and selected_backend == AttentionBackendEnum.TRITON_MLA:
            return AttentionBackendEnum.TRITON_MLA.get_path()
        return original(cls, selected_backend, attn_selector_config, num_heads)

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale):
        if not kv_cache_dtype.startswith("fp8"):
            return CPUMLAImpl.do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype,
                                                 k_scale)
        if kv_cache.numel() == 0:
            return None
        rows = torch.cat([kv_c_normed, k_pe.squeeze(1)], dim=-1).float() / k_scale.float()
        slots = slot_mapping.flatten().long()
        valid = slots >= 0
        flat = kv_cache.view(torch.float8_e4m3fn).view(-1, rows.shape[-1])
        flat[slots[valid]] = rows[valid].clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return None

    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    TritonMLAImpl.do_kv_cache_update = do_kv_cache_update
    TritonMLABackend.supported_dtypes = [*TritonMLABackend.supported_dtypes, torch.float32]
    setattr(CpuPlatform, _APPLIED, True)


if os.environ.get(ENV):
    apply()
