"""A decode-sized product's output left as its K splits' fp32 partial sums.

A decode-sized product on held weights (``hpc_kernels.quant_gemm``) splits K over programs so that
a few rows still keep every multiprocessor reading the weight; its output is the splits' partial
sums added in a fixed order (split 0 first) and rounded to the rows' dtype. Where the next kernel
reads the output once, as the residual stream's sum and norm after an attention, GDN or MLP
output does (``hpc_kernels.rms_norm.add_rms_norm``), it adds the splits itself, in the same order
with the same rounding, and the product skips its own addition (the last split's wait for the
others, a few microseconds a product at decode sizes). :meth:`SplitSums.total` gives the summed
output to any other reader, the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SplitSums:
    """``parts`` ``[S, M, N]`` fp32: split ``s``'s partial sums of the product's ``M x N`` output,
    which is ``sum_s parts[s]`` (in the order of ``s``) rounded to ``dtype``."""

    parts: torch.Tensor
    dtype: torch.dtype

    def __post_init__(self) -> None:
        assert self.parts.dim() == 3 and self.parts.dtype == torch.float32, "parts [S, M, N] in fp32"
        assert self.parts.stride(-1) == 1, "each split's rows contiguous"

    @property
    def shape(self) -> torch.Size:
        return self.parts.shape[1:]

    @property
    def splits(self) -> int:
        return self.parts.shape[0]

    def total(self) -> torch.Tensor:
        """The product's output ``[M, N]``: the splits added in order, rounded to ``dtype``."""
        acc = self.parts[0].clone()
        for s in range(1, self.splits):
            acc += self.parts[s]
        return acc.to(self.dtype)


def summed(y: "torch.Tensor | SplitSums") -> torch.Tensor:
    """``y`` itself, or the output its split sums add up to."""
    return y.total() if isinstance(y, SplitSums) else y
