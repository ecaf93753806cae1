"""Tensors as token arrays: ``tensor_tokens`` (public: ``metrale_model_engine.torch``)."""

from __future__ import annotations

from typing import cast

import torch
from typing_extensions import Buffer

from .._core.words import U32_MAX, check_u32

__all__ = ["tensor_tokens"]


def tensor_tokens(tokens: torch.Tensor) -> Buffer:
    """The values of a 1-D integer tensor as a u32 token array (checked with tensor ops, no Python loop).

    Any device; the values are copied to the CPU once.

    Raises:
        TypeError: the tensor does not hold integers (``torch.bool`` included).
        ValueError: it is not 1-D, or a value is outside the u32 range (the message
            names the first, as ``tokens[i]``).
    """
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be a 1-D token array, got a {tokens.dim()}-D tensor")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise TypeError(f"tokens must hold integers, got a tensor of dtype {tokens.dtype}")
    values = tokens.detach().to(device="cpu", dtype=torch.int64)
    bad = ((values < 0) | (values > U32_MAX)).nonzero()
    if bad.numel():
        index = int(bad[0])
        check_u32(f"tokens[{index}]", int(values[index]))
    # int64 -> int32 keeps the low 32 bits: the u32 bit pattern.  numpy's stubs do
    # not declare the buffer protocol before Python 3.12, hence the cast.
    return memoryview(cast(Buffer, values.to(torch.int32).numpy())).cast("B").cast("I")
