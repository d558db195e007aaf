"""Feature maps phi for linear attention: sim(q, k) = phi(q) . phi(k) >= 0.

A registry of small modules, each reporting its output width F = out_dim(d), so state
allocation asks the map for F instead of branching on names. Maps run in fp32 whatever
the input dtype: in bf16, elu(x) + 1 is exactly 0 for x < -8 and the denominator of
linear attention would underflow (PITFALLS #12).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.errors import InvalidArgumentError


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """Linear attention computes and stores in fp32 at least (fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


_WIDE = (torch.float32, torch.float64)   # dtypes state_dtype() leaves unchanged


class FeatureMap:
    name: str = ""

    def out_dim(self, d: int) -> int:
        return d

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (..., d) -> (..., F), fp32 or fp64
        return self.apply(x if x.dtype in _WIDE else x.to(state_dtype(x.dtype)))

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Elu1(FeatureMap):
    """elu(x) + 1 (Katharopoulos et al. 2020): x + 1 for x > 0, exp(x) below.

    Written as exp(x) rather than (exp(x) - 1) + 1, which cancels to exactly 0 in fp32 for
    x < -17; the exponent is floored at -60 so phi >= e^-60 > 0 always.
    """
    name = "elu1"

    def apply(self, x):
        # == where(x > 0, x + 1, exp(clamp(x, -60, 0))) bit for bit (exp(0) + x = 1 + x above 0,
        # exp(x) + 0 below), in 4 kernels and without wrapping Python scalars into tensors.
        return torch.exp(x.clamp(-60.0, 0.0)) + torch.relu(x)


class Relu(FeatureMap):
    """relu(x): non-negative; a query orthogonal to every key gets the eps-only denominator."""
    name = "relu"

    def apply(self, x):
        return F.relu(x)


class Softmax(FeatureMap):
    """softmax over the head dimension, per token (so causality holds)."""
    name = "softmax"

    def apply(self, x):
        return torch.softmax(x, dim=-1)


class Cos1(FeatureMap):
    """Su Jianlin's 1 + cos: l2-normalise and append a constant 1, so phi(q).phi(k) = 1 + cos(q, k)."""
    name = "cos1"

    def out_dim(self, d):
        return d + 1

    def apply(self, x):
        x = F.normalize(x, dim=-1)
        return torch.cat([x, x.new_ones(*x.shape[:-1], 1)], dim=-1)


FEATURE_MAPS: dict[str, FeatureMap] = {m.name: m for m in (Elu1(), Relu(), Softmax(), Cos1())}


def get_feature_map(name: str) -> FeatureMap:
    try:
        return FEATURE_MAPS[name]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown feature map {name!r}; valid: {', '.join(FEATURE_MAPS)}") from None
