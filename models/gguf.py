"""GGUF files (llama.cpp's format), read with the `gguf` package: memory-mapped, dequantized per tensor.

    config, tensors, meta = read_gguf(path)
    config                 ModelConfig from the `llama.*` metadata (GGUF_CONFIG, the one mapping)
    tensors                a Mapping of Hugging Face names -> torch tensors (rows, cols), dequantized
                           on access (one tensor at a time, so a load never holds the whole model twice);
                           tensors.blocks(name): a Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K tensor's own blocks,
                           undecoded (the engine's loader keeps those as they are: engine.quant.QuantLinear)
    meta                   the other metadata the engine uses (`tokenizer.*`, `general.*`), as Python values

Architectures (`general.architecture`): llama (Llama, SmolLM, Mistral: llama.cpp writes Mistral as
llama), qwen2 (+ attn_{q,k,v}.bias) and qwen3 (+ attn_{q,k}_norm.weight), and the tensor types in
SUPPORTED_TYPES. For llama, llama.cpp's converter permutes the q and k rows of each head into Meta's
interleaved rotary layout (pairs 2i, 2i+1); the loader undoes that once, while fusing q/k/v, as
for llama2.c files (`Checkpoint.interleaved_rotary`, `models.weights.interleaved_to_half`). qwen2
and qwen3 keep Hugging Face's half-split rows (llama.cpp runs them with NEOX-style rotary), so
nothing is permuted (INTERLEAVED_ARCHITECTURES).
A file without `output.weight` ties the output projection to the token embeddings. RoPE scaling: a
`rope_freqs.weight` tensor (Llama 3.1+, as llama.cpp's converter writes it) becomes the config's
`rope_freq_factors`; `rope.scaling.type` linear is read; yarn and other types are refused in one line.
"""
from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from models.config import ModelConfig
from models.errors import CheckpointError, ConfigError
from models.gguf_metadata import read_values
from models.pages import FAULT_AROUND, hand_back
from models.weights import hf_shapes

MAGIC = b"GGUF"
# general.architecture -> the config's model_type
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# architectures whose q/k rows llama.cpp's converter permutes into the interleaved rotary layout
INTERLEAVED_ARCHITECTURES = ("llama",)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# types whose blocks the engine computes with as they are (engine.quant's layouts, byte for byte the
# same as ggml's block_q8_0 / q4_0 / q4_1 / q5_0 / q5_1 and the K-quants' super-blocks block_q4_K /
# q5_K / q6_K): `GGUFTensors.blocks` hands them up undecoded; the rest (floats) are read as tensors
BLOCK_KINDS = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q5_0": "q5_0", "Q5_1": "q5_1",
               "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k"}

# `{arch}.<key>` -> ModelConfig field: the one place GGUF metadata meets the config.
GGUF_CONFIG = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "context_length": "max_position_embeddings",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}
# Settings of a Llama variant this engine does not run: key -> is the value one we cannot run?
UNSUPPORTED = {
    "expert_count": lambda v: v > 0,
    "rope.scaling.type": lambda v: v not in ("none", "", "linear"),
}
SMALL_FLOATS = 1 << 16   # F32 / F16 tensors of fewer bytes are copied out of the map (norms, biases)
# llama.cpp writes Llama 3.1+'s RoPE scaling as this tensor of per-frequency divisors (no metadata key):
# it becomes ModelConfig.rope_freq_factors; a loader that skipped it would run plain RoPE, silently wrong
ROPE_FREQS = "rope_freqs.weight"
# GGUF tensor names -> Hugging Face names ({i}: layer index)
TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSOR_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",            # qwen2
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",   # qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
IGNORED_TENSORS = (ROPE_FREQS,)   # read into the config (gguf_config), not a weight
# the metadata the rest of the engine reads (tokenizer, chat template); everything else stays in the file
META_PREFIXES = ("tokenizer.", "general.name", "general.architecture")


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in TENSOR_NAMES:
        return TENSOR_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m and m.group(2) in LAYER_TENSOR_NAMES:
        return f"model.layers.{m.group(1)}.{LAYER_TENSOR_NAMES[m.group(2)]}"
    return None


class GGUFTensors(Mapping):
    """Hugging Face name -> torch tensor, dequantized to float32 on each access (F32 and F16 come back
    as views of the file's private memory map, no copy). `shapes` answers without dequantizing."""

    def __init__(self, reader, tensors: dict[str, object], path: Path):
        self.reader, self._tensors, self.path = reader, tensors, path
        self.shapes = {name: tuple(reversed([int(d) for d in t.shape])) for name, t in tensors.items()}
        self.types = {name: t.tensor_type.name for name, t in tensors.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._tensors[name]
        kind = t.tensor_type.name
        if kind in ("F32", "F16") and t.n_bytes < SMALL_FLOATS:
            # a norm's few KB (a bias), read every token: a copy, and the pages it shares with its
            # neighbours' blocks go back (a read of the map would fault ~64 KB around it back in)
            data = np.array(t.data)
            self._release(t.data_offset, t.n_bytes)
        elif kind in ("F32", "F16"):
            data = t.data                      # numpy view of the map, already (rows, cols)
        else:
            dequantize = import_gguf().quants.dequantize
            data = dequantize(t.data, t.tensor_type)   # a new float32 array (rows, cols)
            self._release(t.data_offset, t.n_bytes)
        return torch.from_numpy(np.asarray(data).reshape(self.shapes[name]))

    def blocks(self, name: str) -> tuple[torch.Tensor, str] | None:
        """The file's own blocks of a tensor of a BLOCK_KINDS type, not decoded: (uint8 (rows, row bytes),
        "q8_0" | "q4_0" | "q4_1" | "q5_0" | "q5_1" | "q4_k" | "q5_k" | "q6_k"), a view of the private
        map. None for any other type (floats: `self[name]`)."""
        t = self._tensors[name]
        kind = BLOCK_KINDS.get(t.tensor_type.name)
        if kind is None:
            return None
        return torch.from_numpy(np.asarray(t.data).reshape(self.shapes[name][0], -1)), kind

    def blocks_span(self, names) -> torch.Tensor | None:
        """The blocks of `names` (tensors of BLOCK_KINDS types) as one 1-D uint8 view of the map where
        the file stores them back to back in this order (llama.cpp writes ffn_gate then ffn_up): a
        matrix fused from them needs no copy. None where they lie apart (or are another type)."""
        ts = [self._tensors[n] for n in names]
        if any(t.tensor_type.name not in BLOCK_KINDS for t in ts) or \
                any(a.data_offset + a.n_bytes != b.data_offset for a, b in zip(ts, ts[1:])):
            return None
        start, end = ts[0].data_offset, ts[-1].data_offset + ts[-1].n_bytes
        return torch.from_numpy(self.reader.data[start:end])

    def release(self, name: str) -> None:
        """Drop the file pages of a tensor whose values the caller has copied (fused blocks): the
        copy is what stays resident. Views of the tensor read afterwards fault them back in."""
        t = self._tensors[name]
        self._release(t.data_offset, t.n_bytes)

    def _release(self, offset: int, n: int) -> None:
        """Drop the file pages a dequantized or copied tensor was read from (they would otherwise stay
        resident next to the copy), and those around it that reading it mapped back (fault-around); the
        map stays valid and pages fault back in if read again (models.pages.hand_back: pages written
        since, a private map's copies, are kept)."""
        hand_back(self.reader.data.ctypes.data + offset, n, around=FAULT_AROUND)

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def read_gguf(path: str | os.PathLike) -> tuple[ModelConfig, GGUFTensors, dict]:
    """Config, lazily dequantized tensors under Hugging Face names, and the tokenizer/general metadata."""
    path = Path(path)
    reader = open_reader(path)
    meta = metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                              f"{', '.join(ARCHITECTURES)}")
    cfg = gguf_config(meta, reader, path)
    expected = hf_shapes(cfg)
    tensors = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None or name not in expected:
            if t.name in IGNORED_TENSORS:
                continue
            raise CheckpointError(f"{path}: unexpected tensor {t.name} for a plain {arch} model "
                                  f"(biases, experts and extra norms beyond the architecture's are not supported)")
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise CheckpointError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, which this engine "
                                  f"cannot dequantize; supported: {', '.join(SUPPORTED_TYPES)}")
        tensors[name] = t
    reader.fields.clear()   # (a plain GGUFReader's: ~150 MB of per-string views for a 49k vocabulary)
    lazy = GGUFTensors(reader, tensors, path)
    for name, shape in expected.items():
        if name not in lazy.shapes:
            raise CheckpointError(f"{path}: missing tensor {name} ({gguf_name_of(name)})")
        if lazy.shapes[name] != shape:
            raise CheckpointError(f"{path}: tensor {gguf_name_of(name)} has shape {list(lazy.shapes[name])}, "
                                  f"expected {list(shape)}")
    if reader.tensors:   # the header is read (values in `meta`, shapes in `lazy`): its pages go back
        hand_back(reader.data.ctypes.data, min(t.data_offset for t in reader.tensors))   # ~1.8 MB for 49k tokens
    return cfg, lazy, {k: v for k, v in meta.items() if k.startswith(META_PREFIXES)}


def import_gguf():
    """The `gguf` package (lazy: `gen --model tiny` never needs it), imported without sentencepiece where
    nothing has imported that yet: gguf's `__init__` imports its vocabulary converters, which import
    sentencepiece if they can (only their SentencePiece converter uses it; reading a file never does):
    ~1.3 MB of a library a GGUF load does not run. A later `import sentencepiece` works as usual (only
    gguf.vocab's own SentencePiece converter stays without it in this process; the engine never uses it)."""
    if "gguf" in sys.modules or "sentencepiece" in sys.modules:
        return importlib.import_module("gguf")
    left_out = _LeftOut("sentencepiece")
    sys.meta_path.insert(0, left_out)
    try:
        return importlib.import_module("gguf")
    finally:
        sys.meta_path.remove(left_out)


class _LeftOut:
    """A meta path finder under which `import NAME` fails in the thread that installed it (gguf.vocab
    catches that ImportError) and nowhere else: another thread's import of NAME meanwhile, or a
    find_spec, goes on as usual (a None in sys.modules would have failed it too)."""

    def __init__(self, name: str):
        self.name, self.thread = name, threading.get_ident()

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name and threading.get_ident() == self.thread:
            raise ModuleNotFoundError(f"{fullname} is left out while gguf is imported", name=fullname)
        return None


class PlainMap:
    """A GGUFReader mixin (first among the bases): the reader's map seen as a plain ndarray, the same
    pages, but slicing it skips np.memmap's per-slice bookkeeping, which made reading 100k vocabulary
    strings and dequantizing row groups 2-3x slower."""
    @property
    def data(self):
        return self._data

    @data.setter
    def data(self, value):
        self._data = np.asarray(value)


def _reader_class():
    gguf = import_gguf()
    GGUFReader, GGUFValueType, ReaderField = gguf.GGUFReader, gguf.GGUFValueType, gguf.gguf_reader.ReaderField

    class Reader(PlainMap, GGUFReader):
        """GGUFReader over a plain-ndarray map (PlainMap), parsing the metadata faster."""

        def _fast_build_fields(self, offs, count):
            """The metadata as Python values in `values` (models.gguf_metadata: not two numpy views
            per string); `fields` keeps general.alignment, which the base class reads."""
            order = "=" if self.byte_order == "I" else (">" if sys.byteorder == "little" else "<")
            kinds: dict = {}
            self.values, end = read_values(memoryview(self.data), int(offs), int(count), order, kinds)
            if "general.alignment" in self.values:
                self.fields["general.alignment"] = ReaderField(
                    int(offs), "general.alignment", [np.array([self.values["general.alignment"] or 0], np.uint64)],
                    [0], [GGUFValueType(kinds["general.alignment"])])
            return end

    # the override replaces a private method of the installed gguf: only where it is the one this was
    # written against (self, offs, count); another gguf keeps its own parse (slower, the same values)
    base = getattr(GGUFReader, "_build_fields", None)
    if base is not None and list(inspect.signature(base).parameters) == ["self", "offs", "count"]:
        Reader._build_fields = Reader._fast_build_fields
    return Reader


def metadata(reader) -> dict:
    """The file's key-value metadata as Python values (a reader of `_reader_class` parsed them into
    `values`; any other reader's fields are read one by one: field_value)."""
    values = {k: field_value(f) for k, f in reader.fields.items()}
    values.update(getattr(reader, "values", {}))
    return values


def open_reader(path: Path):
    """A GGUFReader over a private (copy-on-write) map of the file, or a one-line CheckpointError."""
    GGUFReader = _reader_class()
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a directory, not a GGUF file") from None
    if magic != MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (starts with {magic!r}, expected {MAGIC!r})")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reader = GGUFReader(path, "c")   # private map: tensors are writable views, the file is never written
    except Exception as e:   # the reader raises ValueError/IndexError/... on a cut or corrupt file
        raise CheckpointError(f"{path}: truncated or corrupt GGUF file ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else 'no detail'})") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise CheckpointError(f"{path}: truncated GGUF file: tensor {t.name} ends at byte "
                                  f"{t.data_offset + t.n_bytes}, the file has {size}")
    return reader


def field_value(field):
    """A metadata field as a Python value (str, int, float, bool, or a list of them)."""
    try:
        return field.contents()
    except Exception:   # a value type this gguf version cannot decode: keep the key, drop the value
        return None


def gguf_config(meta: dict, reader, path: Path) -> ModelConfig:
    """ModelConfig from `{arch}.*` metadata (GGUF_CONFIG) and the token ids of `tokenizer.ggml.*`."""
    arch = meta["general.architecture"]
    raw = {}
    for key, field in GGUF_CONFIG.items():
        value = meta.get(f"{arch}.{key}")
        if isinstance(value, list):   # per-layer values (some files): only a uniform list fits our config
            if len(set(value)) != 1:
                raise ConfigError(f"{path}: {arch}.{key} differs between layers ({value[:4]}...); not supported")
            value = value[0]
        if value is not None:
            raw[field] = value
    for key, is_bad in UNSUPPORTED.items():
        value = meta.get(f"{arch}.{key}")
        if value is not None and is_bad(value):
            raise ConfigError(f"{path}: unsupported setting {arch}.{key} = {value!r}")
    if "vocab_size" not in raw:
        tokens = meta.get("tokenizer.ggml.tokens")
        embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if tokens:
            raw["vocab_size"] = len(tokens)
        elif embd is not None:
            raw["vocab_size"] = int(embd.shape[1])
    if "num_key_value_heads" not in raw and "num_attention_heads" in raw:
        raw["num_key_value_heads"] = raw["num_attention_heads"]
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    heads = raw.get("num_attention_heads")
    head_dim = raw.get("head_dim") or (raw["hidden_size"] // heads if "hidden_size" in raw and isinstance(heads, int)
                                       and heads > 0 else None)   # else the config's own check says what is wrong
    if rope_dims is not None and head_dim is not None and rope_dims != head_dim:
        raise ConfigError(f"{path}: partial rotary ({arch}.rope.dimension_count = {rope_dims}, head_dim "
                          f"{head_dim}) is not supported")
    names = {t.name for t in reader.tensors}
    raw["tie_word_embeddings"] = "output.weight" not in names
    if meta.get(f"{arch}.rope.scaling.type") == "linear":
        raw["rope_scaling"] = {"rope_type": "linear", "factor": meta.get(f"{arch}.rope.scaling.factor")}
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:
        if freqs.tensor_type.name not in ("F32", "F16"):
            raise CheckpointError(f"{path}: tensor {ROPE_FREQS} has type {freqs.tensor_type.name}; expected F32")
        raw["rope_freq_factors"] = [float(x) for x in np.asarray(freqs.data, dtype=np.float64).reshape(-1)]
    if meta.get("tokenizer.ggml.bos_token_id") is not None:
        raw["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
    # the end of a sequence: EOS, and the end of a turn / message where the file names them (llama.cpp's
    # converter writes Llama 3's <|eot_id|> as eot when the tokenizer's EOS is <|end_of_text|>)
    ends = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                   "tokenizer.ggml.eom_token_id") if meta.get(k) is not None]
    if ends:
        ends = list(dict.fromkeys(ends))
        raw["eos_token_id"] = ends[0] if len(ends) == 1 else ends
    raw["model_type"] = ARCHITECTURES[arch]
    return ModelConfig.from_dict(raw, where=str(path))


def gguf_name_of(hf: str) -> str:
    """The GGUF name of a Hugging Face tensor name (for messages)."""
    for g, h in TENSOR_NAMES.items():
        if h == hf:
            return g
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf)
    if m:
        for g, h in LAYER_TENSOR_NAMES.items():
            if h == m.group(2):
                return f"blk.{m.group(1)}.{g}"
    return hf
