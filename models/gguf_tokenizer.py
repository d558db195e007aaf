"""A GGUF file's tokenizer, from its `tokenizer.ggml.*` metadata alone (no tensors needed, so llama.cpp's
vocab-only files load too).

    tok = gguf_tokenizer(meta, where)     # the metadata `models.gguf.read_gguf` hands back
    tok = read_gguf_tokenizer(path)       # any GGUF file, weights or not

`tokenizer.ggml.model` picks the kind: "gpt2" is byte-level BPE (`models.bpe`: Llama 3, Qwen, SmolLM,
GPT-2...), "llama" SentencePiece-style BPE (`models.spm_gguf`: Llama 2, Mistral, Phi-3); any other kind,
or a pre-tokenizer this engine lacks, is one line naming the supported ones.
"""
from __future__ import annotations

import os
from pathlib import Path

from models.bpe import BPETokenizer
from models.errors import CheckpointError
from models.gguf import metadata, open_reader
from models.spm_gguf import SentencePieceBPE

GGUF_TOKENIZERS = {"gpt2": BPETokenizer, "llama": SentencePieceBPE}
KINDS = "gpt2 (byte-level BPE), llama (SentencePiece BPE)"


def gguf_tokenizer(meta: dict, where: str = ""):
    kind = meta.get("tokenizer.ggml.model")
    if kind not in GGUF_TOKENIZERS:
        raise CheckpointError(f"{where}: GGUF tokenizer model {kind!r} is not supported; supported: {KINDS}")
    return GGUF_TOKENIZERS[kind].from_gguf(meta, where)


def read_gguf_tokenizer(path: str | os.PathLike):
    path = Path(path)
    reader = open_reader(path)
    meta = {k: v for k, v in metadata(reader).items() if k.startswith("tokenizer.")}
    return gguf_tokenizer(meta, str(path))
