"""Tests of the vLLM integration (kvpp_fx/integrations/vllm/), and the shims and entry modules they run."""
