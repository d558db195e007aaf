"""Helpers for the GGUF, BPE and chat tests: a small byte-level BPE trained here, a ChatML template,
a tiny random Llama saved as a Hugging Face directory with them, and a GGUF writer (gguf.GGUFWriter)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from conftest import generated_sentences, tiny_model

# SmolLM2-135M-Instruct's template (ChatML with a default system message)
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
          "<|im_end|>\n' }}"
          "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
UNICODE_LINES = ["Ünïcödé façade naïve café", "日本語のテキストと中文字符", "emoji 😀👍🏽 🇫🇷 ok", "Ελληνικά и русский"]


def train_bpe(out: Path, vocab_size: int = 400) -> Path:
    """A byte-level BPE (GPT-2 pre-tokenizer) with ChatML special tokens: tokenizer.json +
    tokenizer_config.json (ids 0, 1, 2 = <|endoftext|>, <|im_start|>, <|im_end|>; EOS <|im_end|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(generated_sentences(300) + UNICODE_LINES * 3, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False, "chat_template": CHATML}))
    return out


def bpe_model_dir(out: Path, seed: int = 5, **cfg) -> Path:
    """A random tiny Llama (HF layout) with the BPE above: a model that can chat (badly)."""
    from models.weights import save_pretrained
    train_bpe(out)
    from tokenizers import Tokenizer
    vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()
    base = dict(vocab_size=vocab, max_position_embeddings=256, trained_for=("softmax", "linear"),
                bos_token_id=1, eos_token_id=2)
    base.update(cfg)
    save_pretrained(tiny_model(seed=seed, **base), str(out))
    return out


def gguf_tokenizer_fields(tok_dir: Path) -> dict:
    """tokenizer.ggml.* values of the tokenizer.json in tok_dir (as llama.cpp's converter writes them)."""
    raw = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = raw["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else " ".join(m) for m in raw["model"]["merges"]]
    types = [3 if t in SPECIALS else 1 for t in tokens]
    return {"tokens": tokens, "merges": merges, "types": types}


def write_gguf(path: Path, model, tok_dir: Path | None, qtype_of=None, arch: str = "llama",
               template: str | None = CHATML, pre: str = "gpt2", tie: bool | None = None,
               extra_tensors: dict | None = None, eot_id: int | None = None, write_tokenizer=None) -> dict:
    """Write `model` (a runtime Transformer) as a llama.cpp-style GGUF: tensors under llama.cpp's names
    for `arch` (gguf's own TensorNameMap), q/k rows permuted to the interleaved rotary layout for llama
    only (llama.cpp's converter leaves qwen2/qwen3 rows as they are), tensors quantized with
    gguf.quants (qtype_of(gguf_name, shape) -> type, default F32). `extra_tensors`: {gguf name: float32
    array} written as they are (e.g. rope_freqs.weight); eot_id: tokenizer.ggml.eot_token_id;
    write_tokenizer(writer): writes tokenizer.ggml.* itself (tok_dir None).
    Returns {Hugging Face name: the dequantized tensor as stored, in Hugging Face row order}."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from models.weights import half_to_interleaved, runtime_to_hf
    cfg = model.config
    tie = cfg.tie_word_embeddings if tie is None else tie
    w = gguf.GGUFWriter(str(path), arch)
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size or arch == "qwen3":
        w.add_key_length(cfg.head_dim)     # as llama.cpp's converter, wherever the config names head_dim
        w.add_value_length(cfg.head_dim)
    if eot_id is not None:
        w.add_eot_token_id(eot_id)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if tok_dir is not None:
        f = gguf_tokenizer_fields(tok_dir)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(f["tokens"])
        w.add_token_merges(f["merges"])
        w.add_token_types(f["types"])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(False)
    if write_tokenizer is not None:
        write_tokenizer(w)
    if template is not None:
        w.add_chat_template(template)
    hf = runtime_to_hf(model.state_dict(), cfg)
    known = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    # llama.cpp's names for this architecture (another one, e.g. gpt2 for a refusal test: llama's)
    tmap = gguf.get_tensor_name_map(known[arch] if arch in ("qwen2", "qwen3") else gguf.MODEL_ARCH.LLAMA,
                                    cfg.num_hidden_layers)
    permuted = arch not in ("qwen2", "qwen3")
    stored = {}
    for name, t in hf.items():
        if name == "lm_head.weight" and tie:
            continue
        gname = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        t = t.detach().float()
        heads = {"attn_q.weight": cfg.num_attention_heads, "attn_k.weight": cfg.num_key_value_heads} if permuted else {}
        on_disk = half_to_interleaved(t, heads[gname.split(".", 2)[-1]]) if gname.split(".", 2)[-1] in heads else t
        arr = on_disk.numpy().astype(np.float32)
        qtype = Q.F32 if t.dim() == 1 or qtype_of is None else qtype_of(gname, arr.shape)
        if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
            data = random_k_blocks(arr.shape, qtype, seed=len(stored))
        elif qtype == Q.F32:
            data = arr
        else:
            data = gguf.quants.quantize(arr, qtype)
        w.add_tensor(gname, data, raw_dtype=qtype)
        back = arr if qtype == Q.F32 else gguf.quants.dequantize(data, qtype).reshape(arr.shape)
        back = torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32))
        if gname.split(".", 2)[-1] in heads:   # back to Hugging Face (half-split) row order
            from models.weights import interleaved_to_half
            back = interleaved_to_half(back, heads[gname.split(".", 2)[-1]]).reshape(back.shape)
        stored[name] = back
    for gname, arr in (extra_tensors or {}).items():
        w.add_tensor(gname, np.asarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def random_k_blocks(shape, qtype, seed: int = 0) -> np.ndarray:
    """Random K-quant blocks (the gguf package cannot quantize K-quants: its dequantizer is the
    reference these blocks are read back with): random quants and packed scales, and per super-block
    a random fp16 d (and dmin ~ d times the mean quant, so the weights centre near 0) that gives
    weights of std ~0.05, a trained model's scale."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    std = {Q.Q4_K: 257.0, Q.Q5_K: 520.0, Q.Q6_K: 1370.0}[qtype]   # of a weight / d with random bytes
    d = rng.uniform(0.5, 1.5, size=(rows, cols // block)) * 0.05 / std

    def half(x):
        return x.astype(np.float16).view(np.uint8).reshape(rows, cols // block, 2)
    if qtype in (Q.Q4_K, Q.Q5_K):      # d, dmin first
        raw[..., 0:2] = half(d)
        raw[..., 2:4] = half(d * (7.5 if qtype == Q.Q4_K else 15.5))
    else:                              # Q6_K: d last
        raw[..., nbytes - 2:] = half(d)
    return raw.reshape(rows, cols // block * nbytes)


def hf_model_from(stored: dict, cfg, out: Path) -> Path:
    """A Hugging Face directory holding exactly the tensors the GGUF stores (dequantized), for comparison."""
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in stored.items()}, str(out / "model.safetensors"))
    cfg.to_json(out / "config.json")
    return out


def logits(model, ids) -> torch.Tensor:
    state = model.init_state(1, len(ids) + 1, "softmax")
    return model.step(torch.tensor([ids]), state)[0]
