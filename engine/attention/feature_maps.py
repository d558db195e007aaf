"""Feature maps phi for linear attention: sim(q, k) = phi(q) . phi(k) >= 0.

A registry of small modules, each reporting its output width F = out_dim(d), so state
allocation asks the map for F instead of branching on names. Maps run in fp32 whatever
the input dtype: in bf16, elu(x) + 1 is exactly 0 for x < -8 and the denominator of
linear attention would underflow (PITFALLS #12).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.errors import InvalidArgumentError


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """Linear attention computes and stores in fp32 at least (fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


_WIDE = (torch.float32, torch.float64)   # dtypes state_dtype() leaves unchanged


class FeatureMap:
    """phi: (B, heads, T, d) -> (B, heads, T, F). `layer` and `role` ("q": query heads, "k": key/value
    heads) name whose map to apply; the fixed maps are the same everywhere and ignore them."""
    name: str = ""

    def out_dim(self, d: int) -> int:
        return d

    has_decay = False
    has_gate = False

    def decay(self, layer=None, v: torch.Tensor | None = None) -> torch.Tensor | None:
        """Layer `layer`'s log decay per key/value head and feature, (Hkv, F) fp32 <= 0 (a slice of
        layers: (L, Hkv, F)), or None: the plain recurrence S_i = S_{i-1} + phi(k_i) v_i^T. With one,
        S_i = diag(exp(decay)) S_{i-1} + ... and the same on z (a learned map's option; the fixed maps
        have none). A map with a gate (`has_gate`) decays by token: given the values v (B, Hkv, T, D)
        it returns (B, Hkv, T, F)."""
        return None

    def __call__(self, x: torch.Tensor, layer: int | None = None, role: str = "k") -> torch.Tensor:
        return self.apply(x if x.dtype in _WIDE else x.to(state_dtype(x.dtype)))   # fp32 or fp64

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


class Zero(FeatureMap):
    """phi = 0 (width 1): the linear branch switched off, an ablation. With a window (`--window W`) a
    linear layer is then sliding-window softmax attention alone: num / (sum of the window's scores +
    EPS), the same normalisation with nothing from the keys that left the window; without one, its
    output is 0."""
    name = "zero"

    def out_dim(self, d):
        return 1

    def apply(self, x):
        return x.new_zeros(*x.shape[:-1], 1)


class Hedgehog(FeatureMap, nn.Module):
    """A learned map per layer and head (Hedgehog, Zhang et al. 2024, arXiv 2402.04347):

        y = x W + b,  phi(x) = [softmax(y), softmax(-y)] over the head dimension, F = 2D

    with separate maps for queries (one per query head) and keys (one per key/value head),
    applied after rotary. Parameters (identity W, zero b when fresh; trained by `gen linearize`):
        q_weight (L, H, D, D), q_bias (L, H, D), k_weight (L, Hkv, D, D), k_bias (L, Hkv, D)
    and optionally (`gen linearize --decay`) decay_logit (L, Hkv, 2D): a learned decay per key/value
    head and feature, log decay = -sigmoid(decay_logit) in (-1, 0) (`decay()`; fresh: -sigmoid(-8),
    a memory of ~3,000 tokens); and on top of it optionally (`gen linearize --gate`) gate_weight
    (L, Hkv, D, 2D), which makes the decay depend on the token (gated linear attention, as GLA's
    data-dependent forget gate, read from the token's value):
        log decay_t = -sigmoid(decay_logit + rms(v_t) gate_weight),  rms(v) = v / sqrt(mean(v^2) + 1e-6)
    (fresh: zero, the constant decay unchanged).
    The checkpoint names of these tensors are mapped in one place, `models.linearized`.
    The instance in FEATURE_MAPS has no layers: a model that carries learned maps supplies its own
    (`Transformer.feature_map`).
    """
    name = "hedgehog"
    TENSORS = ("q_weight", "q_bias", "k_weight", "k_bias")

    def __init__(self, layers: int = 0, heads: int = 1, kv_heads: int = 1, head_dim: int = 1, decay: bool = False):
        nn.Module.__init__(self)
        for role, n in (("q", heads), ("k", kv_heads)):
            # identities, not torch.eye: under a load's meta device torch.eye runs torch._refs, whose
            # first call imports torch._dynamo (~1.1 s and its pages, in every load of learned maps)
            eye = torch.zeros(layers, n, head_dim, head_dim)
            eye.diagonal(dim1=-2, dim2=-1).fill_(1.0)
            self.register_parameter(f"{role}_weight", nn.Parameter(eye))
            self.register_parameter(f"{role}_bias", nn.Parameter(torch.zeros(layers, n, head_dim)))
        self.register_parameter("decay_logit", None)
        self.register_parameter("gate_weight", None)
        if decay:
            self.add_decay()

    @classmethod
    def for_config(cls, cfg, decay: bool = False) -> "Hedgehog":
        return cls(cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, decay)

    def add_decay(self) -> None:
        """Give the maps a fresh learned decay (no-op when they have one)."""
        if self.decay_logit is None:
            L, Hkv, D = self.k_bias.shape
            self.decay_logit = nn.Parameter(torch.full((L, Hkv, 2 * D), DECAY_INIT, device=self.k_bias.device),
                                            requires_grad=self.k_bias.requires_grad)   # as the other maps are

    def add_gate(self) -> None:
        """Make the decay depend on the token: a fresh (zero) gate_weight, and a fresh decay if the
        maps have none (no-op when they have a gate)."""
        self.add_decay()
        if self.gate_weight is None:
            L, Hkv, D = self.k_bias.shape
            self.gate_weight = nn.Parameter(torch.zeros(L, Hkv, D, 2 * D, device=self.k_bias.device),
                                            requires_grad=self.k_bias.requires_grad)

    def add_parts_of(self, names) -> None:
        """Give the maps the optional parts (decay, gate) whose tensors `names` hold: the keys of a
        saved state dict, with or without the `hedgehog.` prefix; so that it then loads."""
        names = {n.removeprefix("hedgehog.") for n in names}
        if "gate_weight" in names:
            self.add_gate()
        elif "decay_logit" in names:
            self.add_decay()

    def out_dim(self, d):
        return 2 * d

    @property
    def has_decay(self) -> bool:
        return self.decay_logit is not None

    @property
    def has_gate(self) -> bool:
        return self.gate_weight is not None

    def check_layer(self, layer) -> None:
        """Raise unless these maps have layer `layer` (the registry's instance has none)."""
        if layer is None or layer >= self.k_weight.shape[0]:
            raise InvalidArgumentError(
                "the hedgehog feature map is learned per layer: load a model that ships its maps "
                "(one written by gen linearize, e.g. smollm2-linear)")

    def decay(self, layer=None, v=None):
        if self.decay_logit is None:
            return None
        logit = self.decay_logit[layer]
        logit = logit if logit.dtype in _WIDE else logit.float()
        if self.gate_weight is not None:
            if v is None:
                raise ValueError("a gated decay depends on the token: pass its values v")
            v = v if v.dtype in _WIDE else v.to(logit.dtype)
            u = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + GATE_EPS)
            w = self.gate_weight[layer]
            logit = logit[:, None, :] + torch.einsum("bhtd,hdf->bhtf", u, w.to(u.dtype))
        return -torch.sigmoid(logit)

    def __call__(self, x: torch.Tensor, layer: int | None = None, role: str = "k") -> torch.Tensor:
        """x (B, heads, T, D) with heads = H for role "q", Hkv for "k" -> (B, heads, T, 2D) fp32."""
        weight = self.q_weight if role == "q" else self.k_weight
        self.check_layer(layer)
        bias = (self.q_bias if role == "q" else self.k_bias)[layer]                    # (heads, D)
        x = x if x.dtype in _WIDE else x.to(state_dtype(x.dtype))
        w = weight[layer]
        w, bias = (w, bias) if w.dtype == x.dtype else (w.to(x.dtype), bias.to(x.dtype))
        return hedgehog_phi(x, w, bias)

    __hash__ = nn.Module.__hash__


DECAY_INIT = -8.0   # a fresh decay_logit: log decay -sigmoid(-8) = -3.4e-4 a token
GATE_EPS = 1e-6     # rms(v) = v / sqrt(mean(v^2) + GATE_EPS), the gate's input


def hedgehog_phi(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, D), w (heads, D, D), bias (heads, D) -> [softmax(xW+b), softmax(-(xW+b))] (B, heads, T, 2D)."""
    y = torch.einsum("bhtd,hde->bhte", x, w) + bias[:, None, :]
    return torch.cat([torch.softmax(y, -1), torch.softmax(-y, -1)], dim=-1)


FEATURE_MAPS: dict[str, FeatureMap] = {m.name: m for m in (Elu1(), Relu(), Softmax(), Cos1(), Hedgehog(),
                                                              Zero())}


def get_feature_map(name: str) -> FeatureMap:
    try:
        return FEATURE_MAPS[name]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown feature map {name!r}; valid: {', '.join(FEATURE_MAPS)}") from None
