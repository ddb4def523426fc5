"""The cross-entropy of the torch engine: the one function the forward (engines/torch/forward.py,
on every layout) and the eval read the output head's loss from.

    ce_T, lse_T = token_losses(logits_TV, labels_T)   # each token's CE and log-partition
    ce, z = head_losses(logits_TV, labels_T)          # their means: the CE and the z-loss term

The arithmetic is in fp32 whatever the logits' dtype (fp64 stays fp64): logsumexp over the
vocabulary, minus the label's logit. head_losses with kernel=True reads 16-bit logits through the
Triton kernels of engines/torch/kernels/xent.py (the same two means, tested against these forms);
the caller says when they can run (xent.kernels_usable).

Shape legend: T tokens (one dim, or several: B x S, the means then over all of them),
V vocabulary.
"""

from __future__ import annotations

import torch

from engines.torch.kernels import xent


def token_losses(logits_TV: torch.Tensor, labels_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ce_T, lse_T): each token's cross-entropy against its label and its log-partition, fp32."""
    logits_TV = logits_TV.to(torch.promote_types(logits_TV.dtype, torch.float32))
    lse_T = torch.logsumexp(logits_TV, -1)
    return lse_T - logits_TV.gather(-1, labels_T.unsqueeze(-1)).squeeze(-1), lse_T


def head_losses(logits_TV: torch.Tensor, labels_T: torch.Tensor, kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy, mean squared log-partition) over the tokens; kernel: by the Triton
    kernels (2-d logits on a GPU where xent.kernels_usable), which never widen the logits."""
    if kernel:
        return xent.HeadLosses.apply(logits_TV.contiguous(), labels_T.contiguous())
    ce_T, lse_T = token_losses(logits_TV, labels_T)
    return ce_T.mean(), lse_T.square().mean()
