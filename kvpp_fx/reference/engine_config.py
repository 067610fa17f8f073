"""The reference engine's settings: `EngineConfig` (validated when built) and `PipelineLink` (where a
pipeline stage sends its hidden states and which rank samples). Both frozen, neither imports torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpp_fx.cache.cost import KVPP_MODES
from kvpp_fx.cache.cost import LinkModel

GRAPH_MODES = ("none", "eager", "piecewise")


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    token_budget: int = 32
    max_model_len: int = 256
    graph_mode: str = "eager"      # "none" runs the model uncompiled (KVPP off only)
    inner: Any = "eager"           # inner backend of the piecewise mode
    speculative: bool = False      # MTP drafts (needs num_nextn_predict_layers >= 1)
    dump_dir: str | None = None
    active_blocks: bool = True     # pass each step's blocks with history to the runtime (else whole layers)
    kvpp_mode: str = "broadcast"   # "broadcast", "owner" or "auto" (chosen by the cost model)
    per_request_paths: bool = True  # owner/auto: each request's rows take their own path (hybrid steps);
    #                                 False: one path for the whole step
    compact_scratch: bool = True   # scratch slots of S blocks from max_model_len and token_budget (else
    #                                whole layers); a step whose rows do not fit sends some to their owners
    scratch_blocks: int | None = None  # S, overriding what max_model_len and token_budget give
    kvpp_link: LinkModel | None = None  # the cost model's link and owner throughput (default: gloo on one host)
    # "module:callable" building the runtime's DeviceAPI from the cache's device (the tests' fault seam;
    # a string, so that it reaches spawned ranks); None: the default DeviceAPI
    device_api: str | None = None

    def __post_init__(self) -> None:
        if self.graph_mode not in GRAPH_MODES:
            raise ValueError(f"graph_mode must be one of {GRAPH_MODES}, got {self.graph_mode!r}.")
        if self.kvpp_mode not in KVPP_MODES:
            raise ValueError(f"kvpp_mode must be one of {KVPP_MODES}, got {self.kvpp_mode!r}.")
        if self.block_size < 1 or self.token_budget < 1 or self.max_model_len < self.block_size:
            raise ValueError("block_size and token_budget must be positive and max_model_len >= block_size.")
        if self.compact_scratch and not self.active_blocks:
            raise ValueError("compact_scratch needs active_blocks: a compact slot holds only the listed blocks.")
        if self.scratch_blocks is not None and not self.compact_scratch:
            raise ValueError("scratch_blocks sizes compact slots: it needs compact_scratch=True.")

    @property
    def max_blocks_per_request(self) -> int:
        return -(-self.max_model_len // self.block_size)


@dataclass(frozen=True)
class PipelineLink:
    """Where this rank's stage sends its hidden states, and which rank samples for everyone.

    Every rank runs the same schedule; the sampled token ids travel from ``sampler`` to all ranks.
    """

    prev_rank: int | None
    next_rank: int | None
    sampler: int

    @classmethod
    def for_rank(cls, rank: int, tp: int, pp: int) -> PipelineLink:
        stage = rank // tp
        return cls(prev_rank=rank - tp if stage > 0 else None, next_rank=rank + tp if stage < pp - 1 else None,
                   sampler=(pp - 1) * tp)
