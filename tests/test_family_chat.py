"""Qwen's and Llama 3's tokenizers, chat templates and EOS sets, against transformers.

Small byte-level BPE vocabularies trained here with the `tokenizers` library, saved with each family's
own tokenizer.json settings (Qwen2.5: NFC + its Split regex, one digit per piece; Llama 3: its Split
regex, digits in threes, ignore_merges, a post-processor adding <|begin_of_text|>); the released chat
templates (tests/templates). No hub."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.api import load
from models.bpe import BPETokenizer
from models.registry import dir_template
from tests.chat_fixtures import UNICODE_LINES
from tests.conftest import generated_sentences

transformers = pytest.importorskip("transformers", reason="transformers not installed (test extra)")
tokenizers = pytest.importorskip("tokenizers", reason="tokenizers not installed")

TEMPLATES = Path(__file__).parent / "templates"
# the Split patterns of the released tokenizer.json files
QWEN_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
LLAMA3_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
FAMILIES = {
    "qwen": dict(split=QWEN_SPLIT, nfc=True, ignore_merges=False, pre="qwen2",
                 specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos=None, eos="<|im_end|>",
                 template="qwen2.5-instruct.jinja"),
    "llama3": dict(split=LLAMA3_SPLIT, nfc=False, ignore_merges=True, pre="llama-bpe",
                   specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                             "<|eot_id|>"], bos="<|begin_of_text|>", eos="<|eot_id|>",
                   template="llama-3.2-instruct.jinja"),
}
TEXTS = ["The cat sat on 12345 mats in 2024.", "I DON'T know, you'll see; she'd've left 3.14159 ago",
         "line one\n\n  indented line\r\nend", "  leading spaces and trailing   ", "tabs\tand 007 digits 9876543210",
         *UNICODE_LINES]


def train_text() -> list[str]:
    numbers = [f"{i} {i * 37 % 10007} {i * 12345}" for i in range(200)]
    return generated_sentences(300) + numbers + UNICODE_LINES * 3 + ["I don't, you'll, we've, she'd"] * 20


def make_tokenizer(out: Path, family: str) -> Path:
    """tokenizer.json + tokenizer_config.json with `family`'s settings. The merges are learned with GPT-2's
    split (digits run together), so the family's own split decides how digits come out."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    f = FAMILIES[family]
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(ignore_merges=f["ignore_merges"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(train_text(), trainer)
    tok.add_special_tokens(f["specials"])
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(f["split"]), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if f["nfc"]:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    if f["bos"]:
        bos = tok.token_to_id(f["bos"])
        tok.post_processor = processors.TemplateProcessing(single=f"{f['bos']} $A", pair=f"{f['bos']} $A {f['bos']} $B",
                                                           special_tokens=[(f["bos"], bos)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": f["bos"], "eos_token": f["eos"],
        "chat_template": (TEMPLATES / f["template"]).read_text(encoding="utf-8")}))
    return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def tok_dir(request, tmp_path_factory):
    return request.param, make_tokenizer(tmp_path_factory.mktemp(request.param), request.param)


def theirs(directory):
    return transformers.AutoTokenizer.from_pretrained(str(directory))


def test_tokenizer_json_encodes_as_transformers(tok_dir):
    family, directory = tok_dir
    ours, hf = BPETokenizer.from_dir(directory), theirs(directory)
    assert ours.add_bos == (family == "llama3")          # Llama 3's post-processor adds BOS; Qwen adds none
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False), text
        assert ours.encode(text, bos=True) == hf.encode(text, add_special_tokens=True), text
        assert ours.decode(ours.encode(text)) == text


def gguf_meta(directory: Path, pre: str) -> dict:
    """tokenizer.ggml.* as llama.cpp's converter writes them from tokenizer.json (specials as control)."""
    raw = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = dict(raw["model"]["vocab"])
    vocab.update({t["content"]: t["id"] for t in raw["added_tokens"]})
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    special = {t["content"] for t in raw["added_tokens"] if t["special"]}
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in raw["model"]["merges"]],
            "tokenizer.ggml.token_type": [3 if t in special else 1 for t in tokens]}


def test_gguf_vocab_with_the_family_pre_tokenizer_encodes_as_transformers(tok_dir):
    """A GGUF's vocabulary names its pre-tokenizer (`qwen2` for Qwen2/2.5/3, `llama-bpe` for Llama 3); read
    with it, the same vocabulary encodes as the tokenizer.json does."""
    family, directory = tok_dir
    hf = theirs(directory)
    ours = BPETokenizer.from_gguf(gguf_meta(directory, FAMILIES[family]["pre"]), "test.gguf")
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False), text


def test_the_wrong_pre_tokenizer_would_show():
    """Negative control: Qwen's vocabulary cut as Llama 3 cuts it (digits in threes) encodes numbers otherwise."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        directory = make_tokenizer(Path(d), "qwen")
        right = BPETokenizer.from_gguf(gguf_meta(directory, "qwen2"), "q.gguf")
        wrong = BPETokenizer.from_gguf(gguf_meta(directory, "llama-bpe"), "q.gguf")
        assert right.encode("in 2024 and 12345") != wrong.encode("in 2024 and 12345")


CONVERSATIONS = [
    [{"role": "user", "content": "Hello there, what is 12 + 30?"}],
    [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Bonjour !"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "  Tell me a story \n"}],
]


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_ids_equal_transformers_apply_chat_template(tok_dir, generation_prompt):
    """The released Qwen2.5 and Llama 3.2 templates through the sandboxed renderer: the same ids as
    transformers' apply_chat_template, BOS written once by Llama's template (PITFALLS #18)."""
    family, directory = tok_dir
    tok, hf = BPETokenizer.from_dir(directory), theirs(directory)
    template = dir_template(directory, tok)
    for messages in CONVERSATIONS:
        ours = template.encode(tok, messages, add_generation_prompt=generation_prompt)
        ref = hf.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                     return_dict=False)
        assert ours == list(ref), messages
        if family == "llama3":
            assert ours.count(tok.bos_id) == 1 and ours[0] == tok.bos_id


def family_model_dir(tmp_path, family) -> Path:
    """A random model of the family with this tokenizer, its template and the released EOS settings
    (Qwen2.5-Instruct: config <|im_end|>, generation_config [<|im_end|>, <|endoftext|>]; Llama 3.2
    Instruct: [<|end_of_text|>, <|eom_id|>, <|eot_id|>] in both files, here without <|eom_id|>)."""
    directory = make_tokenizer(tmp_path / family, family)
    vocab = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json")).get_vocab_size()
    ids = {t: tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json")).token_to_id(t)
           for t in FAMILIES[family]["specials"]}
    shape = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256)
    if family == "qwen":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape, eos_token_id=ids["<|im_end|>"]))
        generation_eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    else:
        eos = [ids["<|end_of_text|>"], ids["<|eot_id|>"]]
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, bos_token_id=ids["<|begin_of_text|>"],
                                                                       eos_token_id=eos))
        generation_eos = eos
    model.save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return directory, ids


@pytest.mark.parametrize("family", list(FAMILIES))
def test_chat_stops_at_the_family_eos_set(tmp_path, family):
    directory, ids = family_model_dir(tmp_path, family)
    llm = load(str(directory))
    expected = {"qwen": {"<|im_end|>", "<|endoftext|>"}, "llama3": {"<|end_of_text|>", "<|eot_id|>"}}[family]
    assert set(llm.chat_eos_ids()) == {ids[t] for t in expected}
    stream = llm.chat([{"role": "user", "content": "Hi"}], max_new_tokens=3, temperature=0)
    assert isinstance("".join(stream), str) and stream.result.finish_reason in ("length", "stop")
    with torch.no_grad():   # the prompt the chat ran is transformers' own
        hf = theirs(directory)
        assert llm.chat_template.encode(llm.tokenizer, [{"role": "user", "content": "Hi"}]) == list(
            hf.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False))
