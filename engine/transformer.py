"""A decoder-only Llama-shaped transformer (Llama, Mistral, Qwen2, Qwen3) whose attention runs either path.

    embed -> L x [x + attn(rmsnorm(x)); x + swiglu(rmsnorm(x))] -> rmsnorm -> lm_head

Runtime weights are fused where that saves kernel launches on the decode path:
`qkv` = [q_proj; k_proj; v_proj] and `gate_up` = [gate_proj; up_proj]. Checkpoint names
are mapped onto these in one place, `models.weights`.

`Transformer.step` is the module path: the reference every faster form of the one-token step
(`engine.steps`) is held to by tests. The generation loop calls a `Stepper`, which picks the form.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.attention import (State, get_feature_map,
                              linear_attention, linear_attention_reference,
                              softmax_attention, softmax_attention_reference)
from engine.attention.feature_maps import FeatureMap, Hedgehog
from engine.attention.hybrid import allocate_state
from engine.attention.sliding import sliding_softmax_attention, sliding_softmax_reference
from engine.attention.sparse import sparse_window_attention
from engine.attention.window import window_attention, window_linear_reference
from engine.errors import InvalidArgumentError
from engine.runspec import RunSpec
from models.config import ModelConfig


def rms_norm(x, weight, eps, n):
    """RMSNorm in fp32 like Hugging Face Llama; x (..., C). eps, n: floats or 0-dim tensors.

    (x * x).sum / n is bit-identical to x.pow(2).mean (torch's mean is sum then div_), and
    addcdiv(eps, s, n) to s / n + eps; with 0-dim tensors for eps and n that is 7 kernels, no
    scalar wrapping.
    """
    x32 = x if x.dtype == torch.float32 else x.float()
    if isinstance(eps, torch.Tensor):
        r = torch.addcdiv(eps, (x32 * x32).sum(-1, keepdim=True), n).rsqrt_()
    else:
        r = (x32 * x32).sum(-1, keepdim=True).div_(n).add_(eps).rsqrt_()
    return weight * (x32 * r if x.dtype == torch.float32 else (x32 * r).to(x.dtype))


def layer_weights(model, paths=None) -> list[tuple]:
    """Per layer, the weights one decode step reads: (ln1, qkv, qkv_bias, qk_norm, o, ln2, gate_up, down).

    qkv_bias: (H + 2 Hkv) * D or None (Qwen2); qk_norm: (H + Hkv, 1, D), q_norm's weight for each query
    head then k_norm's for each key head, or None (Qwen3).
    paths: per layer "softmax" or "linear" (default: all softmax); a linear layer reads its
    adapted projections where the model carries them (`Attention.projections`)."""
    paths = paths or ("softmax",) * len(model.layers)
    out = []
    for b, p in zip(model.layers, paths):
        attn = b.self_attn
        qkv, o = attn.projections(p != "softmax")
        qk_norm = None
        if attn.q_norm is not None:
            qk_norm = torch.cat([attn.q_norm.weight.expand(attn.H, -1), attn.k_norm.weight.expand(attn.Hkv, -1)])[:, None]
        out.append((b.input_layernorm.weight, qkv.weight, qkv.bias, qk_norm, o.weight,
                    b.post_attention_layernorm.weight, b.mlp.gate_up.weight, b.mlp.down_proj.weight))
    return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # (B, T, C), computed in fp32 like HF Llama
        return rms_norm(x, self.weight, self.eps, x.shape[-1])


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    """Rotary embeddings in the half-split layout of Hugging Face Llama checkpoints, with the config's
    frequency scaling (Llama 3's `llama3`, `linear`, or llama.cpp's per-frequency `rope_freq_factors`)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None,
                 freq_factors: tuple[float, ...] | None = None):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.scaling, self.freq_factors = scaling, freq_factors
        self._cos = self._sin = self._sin_signed = None

    @classmethod
    def for_config(cls, cfg) -> "Rotary":
        return cls(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.rope_freq_factors)

    def inv_freq(self, device) -> torch.Tensor:  # (D/2,) fp32, as Hugging Face computes it
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
        inv = 1.0 / self.theta ** exponent
        if self.freq_factors is not None:   # llama.cpp: theta_i / factor_i
            return inv / torch.tensor(self.freq_factors, dtype=torch.float32, device=device)
        s = self.scaling
        if s is None:
            return inv
        if s["rope_type"] == "linear":
            return inv / s["factor"]
        # llama3 (transformers' _compute_llama3_parameters, term for term): long wavelengths are divided
        # by `factor`, short ones kept, the band between interpolated smoothly
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) * ~(wavelen > old / low)
        return torch.where(medium, smoothed, scaled)

    def table(self, n: int, device, dtype):
        """cos, sin tables (n, D) in `dtype`, grown on demand (positions may pass the trained range)."""
        c = self._cos
        if c is None or c.shape[0] < n or c.device != torch.device(device) or c.dtype != dtype:
            # doubling only when a longer table is asked for: a dtype or device switch (the native
            # step reads fp32 rows of an f16 model) rebuilds at the same length, not twice it
            have = c.shape[0] if c is not None else 0
            size = max(n, 2 * have if have < n else have, 256)
            t = torch.arange(size, device=device, dtype=torch.int64).float()
            freqs = torch.outer(t, self.inv_freq(device))
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos, self._sin = emb.cos().to(dtype), emb.sin().to(dtype)
            self._sin_signed = torch.cat((-self._sin[:, :self.head_dim // 2], self._sin[:, self.head_dim // 2:]), -1)
        return self._cos, self._sin

    def signed_table(self, n: int, device, dtype):
        """cos and sign-folded sin (n, D): rotate_half(x) * sin == x[..., perm] * sin_signed, exactly,
        with perm swapping the two halves (engine.steps.torch_step). Checks only the length per call."""
        c = self._cos
        if c is None or c.shape[0] < n or c.dtype != dtype or c.device != device:
            self.table(n, device, dtype)
        return self._cos, self._sin_signed

    def forward(self, positions, dtype):  # (B, T) -> cos, sin (B, 1, T, D)
        cos, sin = self.table(int(positions.max()) + 1 if positions.numel() else 1, positions.device, dtype)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    def for_range(self, start: int, T: int, device, dtype):  # positions start..start+T-1, no sync
        cos, sin = self.table(start + T, device, dtype)
        return cos[start:start + T][None, None], sin[start:start + T][None, None]


def apply_rotary(x, cos, sin):  # x (B, H, T, D)
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """qkv (with a bias for Qwen2), Qwen3's per-head q_norm / k_norm (else None), and o_proj;
    `adapted` = (qkv, o) modules a linear layer runs instead, when the model carries low-rank
    adapters trained with its linear attention (`engine.adapters`), else None.

    Order, as transformers: project (+ bias), per-head norm, RoPE; the attention (a linear layer's
    feature map included) sees q and k after all three."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.H, self.Hkv, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, (self.H + 2 * self.Hkv) * self.D, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.H * self.D, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.D, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.D, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.adapted = None

    def projections(self, linear: bool = False) -> tuple:
        """(qkv, o_proj) modules of this layer run as softmax (linear=False) or linear attention."""
        return self.adapted if linear and self.adapted is not None else (self.qkv, self.o_proj)

    def heads(self, x, rope, linear: bool = False):
        """x (B, T, C) -> q (B, H, T, D), k, v (B, Hkv, T, D): projected, normed per head, rotated."""
        B, T, _ = x.shape
        q, k, v = self.projections(linear)[0](x).split([self.H * self.D, self.Hkv * self.D, self.Hkv * self.D], dim=-1)
        q = q.view(B, T, self.H, self.D)
        k = k.view(B, T, self.Hkv, self.D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)             # (B, H, T, D), (B, Hkv, T, D)
        v = v.view(B, T, self.Hkv, self.D).transpose(1, 2)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        return q, k, v

    def forward(self, x, rope, attend, linear: bool = False):
        B, T, _ = x.shape
        out = attend(*self.heads(x, rope, linear))              # (B, H, T, D)
        return self.projections(linear)[1](out.transpose(1, 2).reshape(B, T, self.H * self.D))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, attend, linear: bool = False):
        x = x + self.self_attn(self.input_layernorm(x), rope, attend, linear)
        return x + self.mlp(self.post_attention_layernorm(x))


def embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding(num, dim); built on the meta device (a load, engine.loader) without its random init:
    normal_ on a meta tensor runs torch._refs, whose first call imports torch._dynamo and triton
    (~130 MB resident, for values the load replaces)."""
    if torch.empty(0).is_meta:
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim)


class Transformer(nn.Module):
    """The model. `config` is the checkpoint's, never reassigned; what a run uses (the path per layer,
    window, feature map, KV dtype) comes from a RunSpec given to `init_state` / `forward`, by default
    `spec`: the one the model was built for (engine.loader: it decides which learned maps it holds),
    else the mode its config names."""

    # training only (`gen linearize --grad-checkpoint`): each layer's activations are recomputed in the
    # backward pass instead of kept, so a long row's memory does not grow with the layers
    checkpoint_layers = False

    def __init__(self, cfg: ModelConfig, spec: RunSpec | None = None):
        super().__init__()
        self.config = cfg
        self._spec = spec
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary.for_config(cfg) if cfg.position_encoding == "rope" else None
        # learned feature maps (gen linearize), present when the config names them
        self.hedgehog = Hedgehog.for_config(cfg) if cfg.feature_map == "hedgehog" else None
        self.weights_epoch = 0   # moves whenever the weights may have moved: step forms rebuild their plans

    def _apply(self, fn, *args, **kwargs):   # .to(), .half(), .float(), .cuda(): new storage
        out = super()._apply(fn, *args, **kwargs)
        self.map_adapted(lambda m: m._apply(fn, *args, **kwargs))
        self.weights_epoch += 1
        return out

    def load_state_dict(self, *args, **kwargs):   # assign=True replaces the Parameter objects
        out = super().load_state_dict(*args, **kwargs)
        self.weights_epoch += 1
        return out

    def adapted_modules(self) -> list[nn.Module]:
        """Every layer's adapted projections (`engine.adapters`): not submodules, so neither in
        `modules()` nor in `state_dict()`; whatever walks or converts the matrices walks these too."""
        return [m for layer in self.layers for m in (layer.self_attn.adapted or ())]

    def map_adapted(self, fn) -> None:
        """Replace every adapted projection m by fn(m) (.to(), quantize, dequantize, reference twins)."""
        for layer in self.layers:
            if layer.self_attn.adapted is not None:
                layer.self_attn.adapted = tuple(fn(m) for m in layer.self_attn.adapted)

    @property
    def device(self):
        return self.embed_tokens.weight.device

    @property
    def dtype(self):
        return self.embed_tokens.weight.dtype

    @property
    def spec(self) -> RunSpec:
        """The run this model was built for (the loader's spec), else the mode its config names."""
        return self._spec if self._spec is not None else RunSpec.from_config(self.config)

    @property
    def kv_dtype(self):
        """The KV cache's dtype of the default run (None: the model's dtype); read-only: RunSpec.kv_dtype."""
        return self.spec.kv_dtype

    def run_spec(self, attention: str | None = None, feature_map: str | None = None,
                 spec: RunSpec | None = None) -> RunSpec:
        """`spec` when given; else the default run (`spec`), on another path `attention` (same layers and
        window) or with another feature map when given (what the old keyword arguments ask)."""
        if spec is not None:
            return spec
        base = self.spec
        if attention is None and feature_map is None:
            return base
        return base.with_path(self.config, attention, feature_map)

    def uses_rope(self, path: str, layer_paths=None) -> bool:
        """path: "softmax", "linear", "window", or "hybrid" (then: whether any layer does; layer_paths:
        the run's per-layer paths, default the default run's)."""
        if self.rotary is None:
            return False
        if path == "hybrid":
            layers = layer_paths if layer_paths is not None else self.spec.layer_paths(self.config.num_hidden_layers)
            return "softmax" in layers or self.config.linear_rope
        return path == "softmax" or self.config.linear_rope

    def feature_map(self, name: str | None = None) -> FeatureMap:
        """The feature map `name` (default: the config's); "hedgehog" is this model's learned maps."""
        name = name or self.config.feature_map
        if name == "hedgehog":
            if self.hedgehog is None:
                raise InvalidArgumentError("this model has no learned (hedgehog) feature maps; load one written "
                                           "by gen linearize (e.g. smollm2-linear) or pick elu1, relu, softmax, cos1")
            return self.hedgehog
        return get_feature_map(name)

    def layer_paths(self, attention: str | None = None, spec: RunSpec | None = None) -> tuple[str, ...]:
        """Per layer "softmax" or "linear" for the run (`run_spec`)."""
        return self.run_spec(attention, spec=spec).layer_paths(self.config.num_hidden_layers)

    def paths_of(self, state) -> tuple[str, ...]:
        """Per layer "softmax" or "linear" as `state` runs them (window layers are linear)."""
        mixed = getattr(state, "layer_paths", None)
        if mixed is not None:
            return tuple(mixed)
        return ("softmax" if state.path == "softmax" else "linear",) * self.config.num_hidden_layers

    # ------------------------------------------------------------------ decoding
    def init_state(self, batch: int = 1, max_len: int | None = None, attention: str | None = None,
                   feature_map: str | None = None, device=None, dtype=None, kv_dtype=None,
                   spec: RunSpec | None = None) -> State:
        """Allocate a decoding state once for the run `spec` (default: `run_spec(attention, feature_map)`).

        max_len: the KV cache's capacity in slots (softmax; default max_position_embeddings);
        the linear state has no capacity limit and ignores it.
        """
        if feature_map is not None:
            get_feature_map(feature_map)   # validate even when the path is softmax
        run = self.run_spec(attention, feature_map, spec)
        fmap = self.feature_map(run.feature_map) if run.attention != "softmax" else None
        return allocate_state(self.config, run.attention, batch, max_len or self.config.max_position_embeddings,
                              device or self.device, dtype or self.dtype, feature_map=fmap,
                              layer_attention=run.layer_attention, window=run.window,
                              kv_dtype=kv_dtype or (run.kv_dtype if dtype is None else None),
                              sparse_keys=run.linear_sparse_keys)

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, state: State, valid: torch.Tensor | None = None,
             last_only: bool = False) -> torch.Tensor:
        """Run a prompt block (T > 1) or one token (T = 1) through the model, writing into `state`.

        tokens (B, T) int64; valid (B, T) bool, False at left pads (prompt blocks only).
        Returns logits (B, T, V), or (B, 1, V) for the last position if `last_only`.
        """
        layers = self._layers(tokens, state, valid, last_only)   # (inside this call's inference mode)
        while True:
            try:
                next(layers)
            except StopIteration as done:
                return done.value

    @torch.inference_mode()   # (on a generator: around each resumption, not across the yields)
    def step_pieces(self, tokens: torch.Tensor, state: State, valid: torch.Tensor | None = None,
                    last_only: bool = False):
        """`step` as a generator that yields after each layer and returns the same logits, bit for bit
        (StopIteration.value): the server feeds a long prompt on the module path a layer at a time between
        decode steps (engine.steps.Stepper.pieces). Between pieces the state is open: nothing else may
        step it."""
        return (yield from self._layers(tokens, state, valid, last_only))

    def _layers(self, tokens: torch.Tensor, state: State, valid: torch.Tensor | None, last_only: bool):
        """step's arithmetic, yielding after each layer (plain: the callers hold inference mode)."""
        span = state.open(tokens, valid)
        x = self.embed_tokens(tokens)
        rope = None
        mixed = getattr(state, "layer_paths", None)    # a hybrid state: rotary per layer
        if self.uses_rope(state.path, mixed):
            if state.padded:   # sequences sit at different positions: gather per sequence
                rope = self.rotary(span.positions, x.dtype)
            else:              # every sequence at start..start+T-1: slice, no gather, no sync
                rope = self.rotary.for_range(span.start, span.length, x.device, x.dtype)
        for i, (layer, path) in enumerate(zip(self.layers, self.paths_of(state))):
            layer_rope = rope if mixed is None or self.uses_rope(mixed[i]) else None
            x = layer(x, layer_rope, lambda q, k, v, i=i: state.attend(i, q, k, v, span), path != "softmax")
            yield
        state.commit(span)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.norm(x))

    # ------------------------------------------------------------------ full sequences
    def forward(self, tokens: torch.Tensor, attention: str | None = None, valid: torch.Tensor | None = None,
                feature_map: str | None = None, reference: bool = False, spec: RunSpec | None = None) -> torch.Tensor:
        """Stateless causal forward over whole sequences (training, evaluation, tests).

        `reference=True` runs the plain-torch twins (uncached full attention; the naive masked
        quadratic form of linear attention). Returns logits (B, T, V).
        """
        run = self.run_spec(attention, feature_map, spec)
        paths = run.layer_paths(self.config.num_hidden_layers)
        fmap = self.feature_map(run.feature_map) if "linear" in paths else None
        window = run.window
        if window and run.sparse_keys:   # one plain-torch form: the reference is the same code
            linear = lambda q, k, v, i: sparse_window_attention(q, k, v, fmap, window, run.sparse_keys,  # noqa: E731
                                                                valid, i)
        elif window:
            linear_fn = window_linear_reference if reference else window_attention
            linear = lambda q, k, v, i: linear_fn(q, k, v, fmap, window, valid, i)  # noqa: E731
        elif reference:
            linear = lambda q, k, v, i: linear_attention_reference(q, k, v, fmap, valid, i)[0]  # noqa: E731
        else:
            linear = lambda q, k, v, i: linear_attention(q, k, v, fmap, valid, i)  # noqa: E731
        softmax = softmax_attention_reference if reference else softmax_attention
        W = self.config.softmax_window
        if W and W < tokens.shape[1]:   # Mistral's sliding window: query t sees keys (t - W, t]
            sliding = sliding_softmax_reference if reference else sliding_softmax_attention
            softmax = lambda q, k, v, valid: sliding(q, k, v, W, valid)  # noqa: E731
        x = self.embed_tokens(tokens)
        rope = None
        if self.uses_rope(run.attention, paths):
            T = tokens.shape[1]
            positions = (torch.arange(T, device=tokens.device).expand_as(tokens) if valid is None
                         else (valid.long().cumsum(1) - 1).clamp_min(0))
            rope = self.rotary(positions, x.dtype)
        recompute = self.checkpoint_layers and torch.is_grad_enabled()
        if recompute:
            from torch.utils.checkpoint import checkpoint
        for i, (layer, path) in enumerate(zip(self.layers, paths)):
            if path == "softmax":
                attend_fn = lambda q, k, v: softmax(q, k, v, valid)  # noqa: E731
            else:
                attend_fn = lambda q, k, v, i=i: linear(q, k, v, i)  # noqa: E731
            inputs = (x, rope if self.uses_rope(path) else None, attend_fn, path != "softmax")
            x = checkpoint(layer, *inputs, use_reentrant=False) if recompute else layer(*inputs)
        return self.lm_head(self.norm(x))
