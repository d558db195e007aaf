"""llama2.c checkpoint files: read (memory-mapped), write, and convert to a Hugging Face layout dir.

legacy (v0)  7 x int32: dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len
             (vocab_size < 0: an unshared classifier follows the other weights), then float32 tensors.
v1           uint32 magic 0x616b3432 ("ak42"), int32 version = 1, the same 7 int32, uint8
             shared_classifier, zero padding to 256 bytes, then float32 tensors.
Tensor order and the rotary permutation of the q/k rows live in `models.weights`.
"""
from __future__ import annotations

import math
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from models.config import ModelConfig
from models.errors import CheckpointError, ConfigError
from models.hf_dir import SINGLE, write_safetensors
from models.tokenizer import Tokenizer, check_vocab
from models.weights import hf_to_llama2c, interleaved_to_half, llama2c_layout, runtime_to_hf

MAGIC = 0x616B3432
LEGACY_HEADER = 7 * 4
V1_HEADER = 256
FIELDS = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")


@dataclass(frozen=True)
class Header:
    version: int             # 0 = legacy
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int          # always positive here
    seq_len: int
    shared_classifier: bool
    offset: int              # where the float32 data begins

    def nbytes(self) -> int:
        """The file size this header implies (checked before anything is built from it)."""
        C, I, L, V = self.dim, self.hidden_dim, self.n_layers, self.vocab_size
        D = C // self.n_heads
        qkvo = C * D * (2 * self.n_heads + 2 * self.n_kv_heads)
        floats = V * C + L * (2 * C + qkvo + 3 * C * I) + C
        floats += self.seq_len * D if self.version == 0 else 0      # legacy: unused cos, sin tables
        floats += 0 if self.shared_classifier else V * C
        return self.offset + 4 * floats

    def describe(self) -> str:
        return ", ".join(f"{k}={getattr(self, k)}" for k in FIELDS)


def read_header(path: str | os.PathLike) -> Header:
    path = os.fspath(path)
    with open(path, "rb") as f:
        head = f.read(V1_HEADER)
    if len(head) >= 4 and struct.unpack("<I", head[:4])[0] == MAGIC:
        if len(head) < V1_HEADER:
            raise CheckpointError(f"{path}: truncated llama2.c header ({len(head)} of {V1_HEADER} bytes)")
        version = struct.unpack("<i", head[4:8])[0]
        if version != 1:
            kind = " (int8-quantized Q8_0)" if version == 2 else ""
            raise CheckpointError(f"{path}: llama2.c format version {version}{kind} is not supported; "
                                  f"supported: legacy and version 1 (float32)")
        values = struct.unpack("<7i", head[8:36])
        shared, offset = bool(head[36]), V1_HEADER
    else:
        if len(head) < LEGACY_HEADER:
            raise CheckpointError(f"{path}: not a llama2.c checkpoint (only {len(head)} bytes)")
        values = struct.unpack("<7i", head[:LEGACY_HEADER])
        shared, offset = values[5] > 0, LEGACY_HEADER
        values = values[:5] + (abs(values[5]),) + values[6:]
        version = 0
    fields = dict(zip(FIELDS, values))
    bad = [k for k, v in fields.items() if v <= 0]
    if bad or fields["dim"] % fields["n_heads"] or fields["n_heads"] % fields["n_kv_heads"] \
            or (fields["dim"] // fields["n_heads"]) % 2:
        raise CheckpointError(f"{path}: not a llama2.c checkpoint: implausible header "
                              f"({', '.join(f'{k}={v}' for k, v in fields.items())})")
    return Header(version=version, shared_classifier=shared, offset=offset, **fields)


def header_config(h: Header, where: str) -> ModelConfig:
    """The model config a llama2.c header describes (llama2.c: eps 1e-5, theta 10000, BOS 1, EOS 2)."""
    try:
        return ModelConfig(hidden_size=h.dim, intermediate_size=h.hidden_dim, num_hidden_layers=h.n_layers,
                           num_attention_heads=h.n_heads, num_key_value_heads=h.n_kv_heads,
                           vocab_size=h.vocab_size, max_position_embeddings=h.seq_len, rms_norm_eps=1e-5,
                           rope_theta=10000.0, tie_word_embeddings=h.shared_classifier, bos_token_id=1,
                           eos_token_id=2, trained_for=("softmax",), torch_dtype="float32")
    except ConfigError as e:
        raise CheckpointError(f"{where}: {e}") from None


def read_llama2c(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and Hugging Face-named float32 tensors, memory-mapped, q/k rows still interleaved."""
    path = os.fspath(path)
    h = read_header(path)
    expected, size = h.nbytes(), os.path.getsize(path)
    if size != expected:
        raise CheckpointError(f"{path}: file size {size} bytes does not match its llama2.c header "
                              f"({h.describe()}; {'shared' if h.shared_classifier else 'separate'} classifier), "
                              f"which needs {expected} bytes")
    cfg = header_config(h, path)
    layout = llama2c_layout(cfg, h.version)
    assert h.offset + 4 * sum(math.prod(shape) for _, shape in layout) == expected
    data = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)   # mmap, copy-on-write
    tensors, pos = {}, h.offset
    for name, shape in layout:
        n = 4 * math.prod(shape)
        if name is not None:
            tensors[name] = data[pos:pos + n].view(torch.float32).view(shape)
        pos += n
    return cfg, tensors


def export_llama2c(model, path: str | os.PathLike, version: int = 1) -> None:
    """Write a runtime model as a llama2.c file (legacy version 0 or version 1), float32."""
    cfg = model.config
    if (cfg.position_encoding != "rope" or cfg.rope_theta != 10000.0 or cfg.rope_scaling or cfg.rope_freq_factors
            or cfg.hidden_size != cfg.num_attention_heads * cfg.head_dim or cfg.qkv_bias or cfg.qk_norm):
        raise CheckpointError(f"{path}: llama2.c cannot express this model (needs unscaled RoPE with theta "
                              f"10000, head_dim = hidden_size / num_attention_heads, no q/k/v biases or q/k norms)")
    tensors = hf_to_llama2c(runtime_to_hf(model.state_dict(), cfg), cfg)
    vocab, shared = cfg.vocab_size, cfg.tie_word_embeddings
    dims = (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads)
    if version == 0:
        header = struct.pack("<7i", *dims, vocab if shared else -vocab, cfg.max_position_embeddings)
    elif version == 1:
        header = struct.pack("<Ii7iB", MAGIC, 1, *dims, vocab, cfg.max_position_embeddings, int(shared))
        header += b"\0" * (V1_HEADER - len(header))
    else:
        raise ValueError(f"llama2.c version {version} is not supported; use 0 or 1")
    tables = _rope_tables(cfg)
    with open(path, "wb") as f:
        f.write(header)
        for name, shape in llama2c_layout(cfg, version):
            t = tensors[name] if name is not None else tables.pop(0)
            f.write(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())


def _rope_tables(cfg: ModelConfig) -> list[torch.Tensor]:
    """The legacy format's cos and sin tables (seq_len, D/2): unused by readers, written for fidelity."""
    D = cfg.head_dim
    freqs = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2)[: D // 2].float() / D)
    angles = torch.outer(torch.arange(cfg.max_position_embeddings).float(), freqs)
    return [angles.cos(), angles.sin()]


def convert_llama2c(src: str | os.PathLike, out_dir: str | os.PathLike, tokenizer_path: str | None = None,
                    progress: bool = False, before_writing=None) -> ModelConfig:
    """llama2.c file -> Hugging Face layout dir (config.json + model.safetensors, q/k half-split).

    Streams tensor by tensor from the memory-mapped input; `progress` shows a bar over bytes written.
    The checkpoint and the tokenizer (a SentencePiece model of at most the model's vocabulary) are
    checked first; `before_writing()` (e.g. clearing an older model) runs only once they pass.
    """
    cfg, tensors = read_llama2c(src)
    if tokenizer_path:   # garbage, or another model's, was copied in and failed every later load
        check_vocab(Tokenizer(tokenizer_path), cfg, tokenizer_path)
    if before_writing is not None:
        before_writing()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shapes = {}
    for i in range(cfg.num_hidden_layers):
        for proj, heads in (("q", cfg.num_attention_heads), ("k", cfg.num_key_value_heads)):
            name = f"model.layers.{i}.self_attn.{proj}_proj.weight"
            shapes[name] = tuple(tensors[name].shape)
            tensors[name] = interleaved_to_half(tensors[name], heads)
    total = sum(t.numel() * 4 for t in tensors.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {out / SINGLE}",
              disable=not progress) as bar:
        write_safetensors(out / SINGLE, tensors, shapes=shapes, progress=bar)
    cfg.to_json(out / "config.json")
    dest = out / "tokenizer.model"
    if tokenizer_path and not (dest.is_file() and os.path.samefile(tokenizer_path, dest)):   # (already there)
        shutil.copyfile(tokenizer_path, dest)
    return cfg
