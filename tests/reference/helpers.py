"""Independent references for the driver tests: greedy decoding by full recomputation, no cache reuse."""

from __future__ import annotations

import torch

from kvpp_fx.reference.model import ReferenceModel
from kvpp_fx.reference.workload import shared_prefix_prompts  # noqa: F401  (re-exported for tests)


def full_forward_logits(model: ReferenceModel, tokens: list[int], block_size: int = 16) -> torch.Tensor:
    """Logits of the last token, computing the whole sequence in one prefill into a fresh cache."""
    cfg = model.config
    n = len(tokens)
    blocks = -(-n // block_size)
    width = cfg.latent_width
    caches = []
    for _ in range(cfg.num_hidden_layers):
        layer = [torch.zeros(blocks, block_size, width)]
        if cfg.is_sfa:
            layer += [torch.zeros(blocks, block_size, cfg.index_head_dim, dtype=torch.int8),
                      torch.zeros(blocks, block_size, 1)]
        caches.append(tuple(layer))
    with torch.no_grad():
        logits, _ = model(torch.tensor(tokens), torch.arange(n), caches, torch.arange(n),
                          torch.arange(blocks, dtype=torch.int32)[None], torch.tensor([n]), torch.tensor([n]),
                          torch.tensor([n - 1]))
    return logits[0]


def recompute_greedy(model: ReferenceModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        tokens.append(int(full_forward_logits(model, tokens).argmax()))
    return tokens[len(prompt):]
