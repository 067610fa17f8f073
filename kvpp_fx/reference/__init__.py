"""Reference DeepSeek-V3-style MLA/SFA model with TP and a paged latent cache, plus a small step driver."""

from kvpp_fx.reference.config import PRESETS, RefConfig, load_config
from kvpp_fx.reference.generate import generate

__all__ = ["PRESETS", "RefConfig", "generate", "load_config"]
