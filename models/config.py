"""Model configuration: a frozen dataclass read from and written to `config.json`.

Keys use Hugging Face names so that a Llama, Mistral, Qwen2 or Qwen3 directory loads as is and
our own exports load in `transformers`. Our own keys (`attention`, `feature_map`,
`position_encoding`, `linear_rope`, `trained_for`) are ignored by other readers.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import NamedTuple

from models.errors import ConfigError
from models.replace import replacing


class Family(NamedTuple):
    """What a model_type adds to the Llama block (RMSNorm, SwiGLU, RoPE, GQA), which all of them share."""
    architecture: str           # transformers' class, written into exported configs
    qkv_bias: bool = False      # q, k and v projections have biases (Qwen2; o_proj has none)
    qk_norm: bool = False       # per-head RMSNorm on q and k before RoPE (Qwen3's q_norm, k_norm)


FAMILIES = {
    "llama": Family("LlamaForCausalLM"),
    "mistral": Family("MistralForCausalLM"),
    "qwen2": Family("Qwen2ForCausalLM", qkv_bias=True),
    "qwen3": Family("Qwen3ForCausalLM", qk_norm=True),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
ATTENTION_PATHS = ("softmax", "linear", "hybrid")   # hybrid: per layer, see layer_attention
LAYER_PATHS = ("softmax", "linear")
POSITION_ENCODINGS = ("rope", "none")
# Feature maps a config may name; engine.attention.feature_maps implements each (a test holds the two together).
FEATURE_MAP_NAMES = ("elu1", "relu", "softmax", "cos1", "hedgehog")   # hedgehog: learned (gen linearize)
# RoPE scalings this engine computes (engine.transformer.Rotary), with the keys each one needs. Hugging
# Face spells the setting `rope_scaling` (older) or `rope_parameters` (transformers 5), the type as
# `rope_type` or `type`; "dynamic" (NTK) rescales with the sequence length and is refused.
ROPE_SCALINGS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}

# Keys without which no model can be built; everything else has the Hugging Face default.
REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "vocab_size")


def model_type_of(architectures, where: str = "config") -> str:
    """A config without `model_type`: the family its `architectures` names; none named: llama (a bare
    Llama config); any other class is refused (it ran as a Llama: a Gemma config got Llama's forward)."""
    if not architectures:
        return "llama"
    names = [architectures] if isinstance(architectures, str) else architectures
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{where}: architectures must be a list of class names, got {architectures!r:.60}")
    by_class = {family.architecture: model_type for model_type, family in FAMILIES.items()}
    for name in names:
        if name in by_class:
            return by_class[name]
    raise ConfigError(f"{where}: no model_type, and architectures {names} names no supported family; "
                      f"supported: {', '.join(f.architecture for f in FAMILIES.values())}")


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None      # None: = num_attention_heads (no GQA)
    head_dim: int | None = None                 # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    bos_token_id: int = 1
    eos_token_id: int | tuple[int, ...] = 2
    model_type: str = "llama"
    # --- this engine's own keys ---
    attention: str = "softmax"                  # default attention path for this checkpoint
    feature_map: str = "elu1"                   # linear attention feature map
    position_encoding: str = "rope"             # "rope" or "none"
    linear_rope: bool = True                    # rotate q, k before the feature map in linear mode
    trained_for: tuple[str, ...] = ("softmax",)  # paths the weights were trained for
    torch_dtype: str | None = None              # dtype the weights were saved in, informational
    layer_attention: tuple[str, ...] | None = None  # attention "hybrid": per layer "softmax" or "linear"
    window: int = 0                             # linear layers also attend exactly to the last W keys (0: off)
    sparse_keys: int = 0                        # with a window: hard keys per layer and head kept exact (0: off)
    transfer_loss: tuple[float, ...] | None = None  # per layer, relative transfer loss of learned maps (linearize)
    # RoPE frequency scaling: {"rope_type": "llama3" | "linear", <its keys in ROPE_SCALINGS>} or None
    rope_scaling: dict | None = None
    # per-frequency divisors of the rotary inverse frequencies (D/2 numbers): llama.cpp's `rope_freqs`
    # tensor, how its converter writes Llama 3.1+'s scaling into a GGUF file
    rope_freq_factors: tuple[float, ...] | None = None
    # Mistral's sliding-window softmax attention: query t sees keys (t - W, t], its own included (transformers'
    # mask); None: every key. Not `window` (linear layers' exact last keys): see `softmax_window`
    sliding_window: int | None = None

    def __post_init__(self):
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            heads, width = self.num_attention_heads, self.hidden_size
            if isinstance(heads, int) and isinstance(width, int) and heads > 0 and width > 0 and width % heads:
                raise ConfigError(f"config: hidden_size ({width}) is not divisible by num_attention_heads "
                                  f"({heads}); fix one of them or give head_dim explicitly")
            object.__setattr__(self, "head_dim", width // heads if isinstance(heads, int) and heads > 0 else None)
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        for key in ("layer_attention", "transfer_loss", "rope_freq_factors"):
            if isinstance(getattr(self, key), list):
                object.__setattr__(self, key, tuple(getattr(self, key)))
        if isinstance(self.trained_for, (list, str)):
            tf = (self.trained_for,) if isinstance(self.trained_for, str) else tuple(self.trained_for)
            object.__setattr__(self, "trained_for", tf)
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self, where: str = "config") -> None:
        def bad(msg):
            raise ConfigError(f"{where}: {msg}")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            bad(f"unsupported model_type {self.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        for key in REQUIRED_KEYS + ("num_key_value_heads", "head_dim"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                bad(f"{key} must be a positive integer, got {value!r}")
        mpe = self.max_position_embeddings
        if not isinstance(mpe, int) or isinstance(mpe, bool) or mpe <= 0:
            bad(f"max_position_embeddings must be a positive integer, got {mpe!r}")
        for key, least in (("rms_norm_eps", 0.0), ("rope_theta", None)):
            value = getattr(self, key)
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                    or value < 0 or (least is None and value == 0)):
                bad(f"{key} must be a finite number {'>= 0' if least is not None else '> 0'}, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            bad(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.position_encoding == "rope" and self.head_dim % 2:
            bad(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.attention not in ATTENTION_PATHS:
            bad(f"attention must be one of {', '.join(ATTENTION_PATHS)}, got {self.attention!r}")
        if self.position_encoding not in POSITION_ENCODINGS:
            bad(f"position_encoding must be one of {', '.join(POSITION_ENCODINGS)}, "
                f"got {self.position_encoding!r}")
        if self.feature_map not in FEATURE_MAP_NAMES:
            bad(f"feature_map must be one of {', '.join(FEATURE_MAP_NAMES)}, got {self.feature_map!r}")
        if not isinstance(self.linear_rope, bool):
            bad(f"linear_rope must be true or false, got {self.linear_rope!r}")
        if self.layer_attention is not None:
            if (len(self.layer_attention) != self.num_hidden_layers
                    or any(p not in LAYER_PATHS for p in self.layer_attention)):
                bad(f"layer_attention must list {self.num_hidden_layers} entries, each softmax or linear")
        elif self.attention == "hybrid":
            bad("attention hybrid needs layer_attention (per layer softmax or linear)")
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 0:
            bad(f"window must be a non-negative integer, got {self.window!r}")
        sk = self.sparse_keys
        if not isinstance(sk, int) or isinstance(sk, bool) or sk < 0:
            bad(f"sparse_keys must be a non-negative integer, got {sk!r}")
        sw = self.sliding_window
        if sw is not None and (isinstance(sw, bool) or not isinstance(sw, int) or sw <= 0):
            bad(f"sliding_window must be a positive integer or null, got {sw!r}")
        if sw is not None and self.model_type != "mistral":
            bad(f"sliding_window is read for Mistral only (model_type {self.model_type!r} has none here)")
        if self.transfer_loss is not None and len(self.transfer_loss) != self.num_hidden_layers:
            bad(f"transfer_loss must list {self.num_hidden_layers} numbers, one per layer")
        for path in self.trained_for:
            if path not in ATTENTION_PATHS:
                bad(f"trained_for lists unknown path {path!r}; valid: {', '.join(ATTENTION_PATHS)}")
        self._validate_rope_scaling(bad)

    def _validate_rope_scaling(self, bad) -> None:
        scaling, factors = self.rope_scaling, self.rope_freq_factors
        if scaling is not None:
            kind = scaling.get("rope_type") if isinstance(scaling, dict) else None
            if kind not in ROPE_SCALINGS:
                bad(f"unsupported rope scaling {scaling!r}; supported rope_type: {', '.join(ROPE_SCALINGS)}")
            for key in ROPE_SCALINGS[kind]:
                value = scaling.get(key)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                    bad(f"rope scaling {kind} needs a positive number {key}, got {value!r}")
            if kind == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
                bad(f"rope scaling llama3 needs high_freq_factor > low_freq_factor, got {scaling!r}")
        if factors is not None:
            if scaling is not None:
                bad("give rope_scaling or rope_freq_factors, not both")
            if self.position_encoding != "rope" or len(factors) != self.head_dim // 2:
                bad(f"rope_freq_factors must list head_dim / 2 = {self.head_dim // 2} numbers, got {len(factors)}")
            if not all(isinstance(f, (int, float)) and f > 0 and f != float("inf") for f in factors):
                bad("rope_freq_factors must be positive finite numbers")

    # ------------------------------------------------------------------ derived
    @property
    def eos_ids(self) -> tuple[int, ...]:
        eos = self.eos_token_id
        return tuple(eos) if isinstance(eos, (tuple, list)) else (eos,)

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    @property
    def qkv_bias(self) -> bool:
        return self.family.qkv_bias

    @property
    def qk_norm(self) -> bool:
        return self.family.qk_norm

    @property
    def softmax_window(self) -> int:
        """The keys each softmax query sees, its own included (Mistral's sliding window, "sliding window"
        in messages); 0: the whole context, also for a window that covers max_position_embeddings (it never
        bites within the context: the plain KV cache runs it). Apart from `window`, the linear layers' last keys."""
        sw = self.sliding_window
        return sw if sw is not None and sw < self.max_position_embeddings else 0

    @property
    def num_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ json
    @classmethod
    def from_dict(cls, raw: dict, where: str = "config") -> "ModelConfig":
        raw = dict(raw)
        if raw.get("model_type") is None:   # absent (or null): the family `architectures` names
            raw["model_type"] = model_type_of(raw.get("architectures"), where)
        model_type = raw["model_type"]
        quantized = raw.get("quantization_config")
        if quantized:   # bitsandbytes, GPTQ, AWQ, FP8: tensors this loader does not read
            method = quantized.get("quant_method") if isinstance(quantized, dict) else None
            raise ConfigError(f"{where}: a {f'{method}-' if method else ''}quantized checkpoint (quantization_config) "
                              f"is not supported; give the float weights (safetensors) or a GGUF file")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"{where}: unsupported model_type {model_type!r}; "
                              f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        for key in REQUIRED_KEYS:
            if key not in raw:
                raise ConfigError(f"{where}: missing required key {key!r}")
        if "rope_theta" not in raw and isinstance(raw.get("rope_parameters"), dict):
            raw["rope_theta"] = raw["rope_parameters"].get("rope_theta", 10000.0)
        unsupported = {
            "attention_bias": lambda v: bool(v), "mlp_bias": lambda v: bool(v),
            "hidden_act": lambda v: v not in ("silu", "swish"),
        }
        if model_type == "qwen2":   # Qwen2's q/k/v biases are always there; transformers reads no such key
            del unsupported["attention_bias"]
        for key, is_bad in unsupported.items():
            if key in raw and is_bad(raw[key]):
                raise ConfigError(f"{where}: unsupported setting {key}={raw[key]!r}")
        check_sliding_window(raw, where)
        if model_type != "mistral":      # Qwen2/3 keep the key with use_sliding_window off (checked above)
            raw.pop("sliding_window", None)
        if model_type == "qwen3" and raw.get("head_dim") is None:
            raw["head_dim"] = 128               # transformers' Qwen3Config default, not hidden / heads
        raw["rope_scaling"] = rope_scaling_of(raw, where)
        if "torch_dtype" not in raw and isinstance(raw.get("dtype"), str):
            raw["torch_dtype"] = raw["dtype"]
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in names}
        try:
            return cls(**kwargs)
        except ConfigError as e:
            raise ConfigError(f"{where}: {str(e).split(': ', 1)[-1]}") from None
        except TypeError as e:
            raise ConfigError(f"{where}: {e}") from None

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "ModelConfig":
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ConfigError(f"{path}: no such file; a model directory needs a config.json")
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        return cls.from_dict(raw, where=path)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["eos_token_id"] = list(self.eos_ids) if len(self.eos_ids) > 1 else self.eos_ids[0]
        d["trained_for"] = list(self.trained_for)
        for key in ("layer_attention", "transfer_loss", "rope_scaling", "rope_freq_factors", "sliding_window"):
            if d[key] is None:
                del d[key]
            elif isinstance(d[key], tuple):
                d[key] = list(d[key])
        d["architectures"] = [self.family.architecture]
        d["hidden_act"] = "silu"
        if self.model_type != "qwen2":
            d["attention_bias"] = False
        d["mlp_bias"] = False
        if self.model_type == "mistral":    # transformers' MistralConfig would default to a 4096-token window
            d["sliding_window"] = self.sliding_window
        elif self.model_type in ("qwen2", "qwen3"):
            d["use_sliding_window"] = False
        if d["torch_dtype"] is None:
            del d["torch_dtype"]
        if not d["sparse_keys"]:
            del d["sparse_keys"]
        return d

    def to_json(self, path: str | os.PathLike) -> None:
        with replacing(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")


def rope_scaling_of(raw: dict, where: str) -> dict | None:
    """The RoPE scaling a Hugging Face config names (`rope_scaling`, or transformers 5's
    `rope_parameters`), normalized to {"rope_type": ..., <ROPE_SCALINGS keys>}; None for default RoPE."""
    for key in ("rope_scaling", "rope_parameters"):
        value = raw.get(key)
        if value in (None, {}):
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: {key} must be an object, got {value!r}")
        kind = value.get("rope_type", value.get("type", "default"))
        if kind == "default":
            continue
        if kind not in ROPE_SCALINGS:
            raise ConfigError(f"{where}: unsupported rope_type {kind!r} in {key}; supported: default, "
                              f"{', '.join(ROPE_SCALINGS)}")
        scaling = {"rope_type": kind}
        for name in ROPE_SCALINGS[kind]:
            if name == "original_max_position_embeddings" and name not in value:
                scaling[name] = raw.get("max_position_embeddings")   # transformers' fallback
            else:
                scaling[name] = value.get(name)
        return scaling
    return None


def check_sliding_window(raw: dict, where: str) -> None:
    """Mistral's sliding window (every layer slides when `sliding_window` is set) runs on the softmax path
    (`ModelConfig.softmax_window`; engine.attention.sliding). Qwen2/3's slides only some layers (where
    `layer_types` says so, or with `use_sliding_window` from layer `max_window_layers` on): refused in one
    line where a window shorter than the context would bite; the released models have it off.
    (Not this engine's own `window`, the exact last keys of linear layers.)"""
    model_type, window = raw.get("model_type", "llama"), raw.get("sliding_window")
    if model_type == "mistral":
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
            raise ConfigError(f"{where}: sliding_window must be a positive integer or null, got {window!r}")
        return
    if model_type not in ("qwen2", "qwen3"):
        return
    types, layers = raw.get("layer_types"), raw.get("num_hidden_layers", 0)
    sliding = bool(raw.get("use_sliding_window")) and window is not None and (
        "sliding_attention" in types if isinstance(types, list) else raw.get("max_window_layers", 28) < layers)
    if not sliding:
        return
    context = raw.get("max_position_embeddings", 2048)
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ConfigError(f"{where}: sliding_window must be a positive integer or null, got {window!r}")
    if window < context:
        raise ConfigError(f"{where}: {model_type}'s per-layer sliding-window attention (use_sliding_window, "
                          f"sliding_window {window} < max_position_embeddings {context}) is not supported (only "
                          f"Mistral's, every layer): set use_sliding_window to false or max_position_embeddings "
                          f"to {window} in config.json")
