"""The rough edges a new user hit (issue 9, section 4), each held by a test."""
from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from cli.main import main
from conftest import ScriptedModel, shared_path, tiny_model
from engine.api import LLM, load
from engine.detokenize import StreamDecoder
from engine.errors import CheckpointError, ConfigError, InvalidArgumentError
from engine.generate import Generation, GenerationConfig
from engine.loader import load_model
from engine.sampling import SamplingParams
from models.config import ModelConfig
from models.corpus import iter_documents
from models.tokenizer import Tokenizer
from models.weights import save_pretrained


def gen(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def one_line_error(r, *words):
    print(r.output)
    assert r.exit_code == 2 and r.exception is None or isinstance(r.exception, SystemExit)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gen: error: ") and "Traceback" not in r.output
    for w in words:
        assert w in lines[0]
    return lines[0]


# ---------------------------------------------------------------------- prompts
def test_prompt_that_is_not_utf8_is_one_line(small_model_dir):
    bad = b"caf\xe9 au lait".decode("utf-8", "surrogateescape")   # what argv holds for undecodable bytes
    one_line_error(gen("--model", small_model_dir, bad), "not valid UTF-8", "0xe9")
    one_line_error(gen("--model", small_model_dir, "-", input=b"caf\xe9\n"), "stdin", "not valid UTF-8")
    with pytest.raises(InvalidArgumentError, match=r"generate\(\): the prompt is not valid UTF-8"):
        load(str(small_model_dir)).generate(bad, max_new_tokens=2)


@pytest.mark.parametrize("prompt", [" ", "\n\t  "], ids=["space", "mixed"])
def test_whitespace_only_prompt_is_empty(small_model_dir, prompt):
    one_line_error(gen("--model", small_model_dir, prompt), "empty")
    with pytest.raises(InvalidArgumentError, match="empty"):
        load(str(small_model_dir)).generate(prompt, max_new_tokens=2)


def test_api_errors_name_the_public_call(small_model_dir):
    llm = load(str(small_model_dir))
    with pytest.raises(InvalidArgumentError, match=r"^generate\(\): a prompt is text or a list of token ids, got NoneType"):
        llm.generate(None)
    with pytest.raises(InvalidArgumentError, match=r"^generate\(\): unknown setting 'temprature'"):
        llm.generate("the cat", temprature=0)
    with pytest.raises(InvalidArgumentError, match=r"^stream\(\): unknown setting 'max_tokens'"):
        llm.stream("the cat", max_tokens=3)
    with pytest.raises(InvalidArgumentError, match=r"^stream\(\): takes one prompt .* for a batch use generate"):
        llm.stream(["the cat", "a dog"])
    with pytest.raises(InvalidArgumentError, match=r"^generate\(\): temperature must be >= 0"):
        llm.generate("the cat", temperature=-1)


# ---------------------------------------------------------------------- devices and checkpoints
@pytest.mark.parametrize("device", ["mps", "xpu"])
def test_device_this_machine_lacks_is_one_line(small_model_dir, device):
    one_line_error(gen("--model", small_model_dir, "--device", device, "the cat"), repr(device))
    with pytest.raises(InvalidArgumentError):
        load(str(small_model_dir), device=device)


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, torch.int64], ids=["int8", "bool", "int64"])
def test_safetensors_tensor_of_a_non_float_dtype_is_refused(tmp_path, dtype):
    save_pretrained(tiny_model(), str(tmp_path))
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"{name} is stored as {str(dtype).removeprefix('torch.')}.*accepted"):
        load_model(tmp_path)


def test_head_count_not_dividing_hidden_size_is_the_configs_error(tmp_path):
    save_pretrained(tiny_model(), str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["head_dim"]                                               # as most Hugging Face configs
    cfg["num_attention_heads"] = cfg["num_key_value_heads"] = 5      # 64 / 5
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"config.json: hidden_size \(64\) is not divisible by num_attention_heads"):
        load_model(tmp_path)


def test_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path, small_tokenizer):
    save_pretrained(tiny_model(vocab_size=small_tokenizer.vocab_size - 10), str(tmp_path),
                    tokenizer_path=small_tokenizer.path)
    with pytest.raises(CheckpointError, match="tokenizer has 300 tokens but the model's vocab_size is 290"):
        load_model(tmp_path)


# ---------------------------------------------------------------------- gen convert
def test_convert_refuses_a_non_empty_dir_and_force_leaves_no_stale_files(tmp_path, small_tokenizer):
    src = shared_path("checkpoints", "stories260K", "llama2c", "stories260K.bin")
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"stray")
    r = gen("convert", "llama2c", src, out, "--no-progress")
    one_line_error(r, "not empty", "--force")
    assert (out / "model.safetensors").read_bytes() == b"stray"
    (out / "tokenizer.model").write_bytes(b"old tokenizer")
    (out / "README.md").write_text("an old model card")
    (out / "notes.txt").write_text("the user's own file")
    r = gen("convert", "llama2c", src, out, "--no-progress", "--force")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]
    load_model(out)


def test_convert_checks_the_tokenizer_and_the_source_before_it_clears_or_writes(tmp_path, small_tokenizer):
    """A --tokenizer that is no SentencePiece model, or another model's, was copied in (every later load
    failed); --force removed the old model before a bad SRC failed (the old one lost), and kept a
    linearize output's maps and adapters beside the new model."""
    from models.llama2c import export_llama2c
    src = tmp_path / "m.bin"
    export_llama2c(tiny_model(seed=5, vocab_size=small_tokenizer.vocab_size), src, version=1)
    garbage = tmp_path / "bin.bin"
    garbage.write_bytes(os.urandom(2000))
    one_line_error(gen("convert", "llama2c", src, tmp_path / "a", "--no-progress", "--tokenizer", garbage),
                   "not a SentencePiece model")
    assert not (tmp_path / "a").exists()
    small = tmp_path / "small.bin"
    export_llama2c(tiny_model(seed=5, vocab_size=small_tokenizer.vocab_size - 10), small, version=1)
    one_line_error(gen("convert", "llama2c", small, tmp_path / "b", "--no-progress", "--tokenizer",
                       small_tokenizer.path), "this tokenizer belongs to another model")
    out = tmp_path / "out"
    assert gen("convert", "llama2c", src, out, "--no-progress", "--tokenizer", small_tokenizer.path).exit_code == 0
    for name in ("maps.safetensors", "adapters.safetensors", "linearize.json"):   # as if linearized
        (out / name).write_bytes(b"{}")
    kept = {p.name: p.read_bytes() for p in out.iterdir()}
    one_line_error(gen("convert", "llama2c", garbage, out, "--no-progress", "--force"), "llama2.c")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == kept          # a bad SRC: nothing cleared
    r = gen("convert", "llama2c", src, out, "--no-progress", "--force", "--tokenizer", out / "tokenizer.model")
    assert r.exit_code == 0, r.output   # new weights, the tokenizer it held (it was cleared, then not found)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.model"]
    assert gen("convert", "llama2c", src, out, "--no-progress", "--force").exit_code == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


# ---------------------------------------------------------------------- streaming and stopping
def test_bytes_that_can_never_complete_a_character_are_released_at_once():
    tok = Tokenizer(shared_path("tokenizers", "llama2", "tokenizer.model"))
    byte = lambda b: tok.sp.piece_to_id(f"<0x{b:02X}>")  # noqa: E731
    ids = [tok.encode("Hi")[0], byte(0x80), byte(0x80), byte(0x80), byte(0xE4), byte(0xBD), byte(0xA0),
           byte(0xE4), tok.encode("x")[0]]
    d = StreamDecoder(tok)
    chunks = [d.push(i) for i in ids]
    chunks.append(d.finish())
    print(chunks)
    assert chunks[1:4] == ["\ufffd"] * 3             # stray continuation bytes: out at once
    assert chunks[4:7] == ["", "", "\u4f60"]          # a valid prefix waits for its character
    assert chunks[7] == "" and chunks[8].startswith("\ufffd")   # E4 then a letter: released with the letter
    assert "".join(chunks) == tok.decode_continuation(ids)


def test_stop_reason_tells_eos_from_a_stop_string(small_tokenizer):
    eos = small_tokenizer.eos_id
    word = small_tokenizer.encode("cat")
    model = ScriptedModel([[5, 6, eos, 7], word + [8, 9]], vocab_size=small_tokenizer.vocab_size, eos_token_id=eos)
    cfg = GenerationConfig(max_new_tokens=8, sampling=SamplingParams(temperature=0), stop=("cat",))
    a, b = Generation(model, [[1], [1]], cfg, small_tokenizer).run()
    assert a.finish_reason == b.finish_reason == "stop"
    assert a.stop_reason == eos and b.stop_reason == "cat"


# ---------------------------------------------------------------------- API arguments of the wrong type
@pytest.mark.parametrize("call,says", [
    (lambda llm: load(None), "model must be a registered name"),
    (lambda llm: load(5), "model must be a registered name"),
    (lambda llm: load("tiny", dtype=torch.int8), "dtype torch.int8 is not one the weights can run in"),
    (lambda llm: load("tiny", attention="hybrid", softmax_layers=1), "softmax_layers must be a list of layer numbers"),
    (lambda llm: llm.generate("Once", stop=5), "stop must be a string or a list of strings, got 5"),
    (lambda llm: llm.generate("Once", eos_ids=5), "eos_ids must be a list of token ids"),
    (lambda llm: llm.generate("Once", eos_ids=["a"]), "eos_ids must be a list of token ids"),
    (lambda llm: llm.generate("Once", eos_ids=[-1]), "eos_ids must be a list of token ids"),
    (lambda llm: llm.generate("Once", eos_ids=[99999]), "eos_ids: token id 99999 is outside the vocabulary (0..4095)"),
    (lambda llm: llm.generate("Once", ignore_eos="no"), "ignore_eos must be True or False, got 'no'"),
    (lambda llm: llm.generate("Once", temperature="0.5"), "temperature must be >= 0 (0 = greedy), got '0.5'"),
    (lambda llm: llm.generate("Once", temperature=float("inf")), "temperature must be a finite number >= 0")],
    ids=["model-none", "model-int", "dtype-int8", "softmax-layers-int", "stop-int", "eos-int", "eos-str", "eos-negative",
         "eos-outside-vocab", "ignore-eos-str", "temperature-str", "temperature-inf"])
def test_api_arguments_of_the_wrong_type_are_typed_one_line_errors(call, says):
    """Each was a TypeError, a bare ValueError or a multi-line RuntimeError (or, for a string temperature,
    a message that read as if 0.5 were refused)."""
    llm = load("tiny")
    with pytest.raises(InvalidArgumentError) as e:
        call(llm)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_eos_ids_take_any_collection_of_token_ids():
    llm = load("tiny")
    eos = llm.tokenizer.encode("Once upon")[-1]
    for ids in ([eos], (eos,), {eos}, range(eos, eos + 1)):
        out = llm.stream("Once", eos_ids=ids, temperature=0, max_new_tokens=4)
        "".join(out)
        assert out.result.ids


@pytest.mark.parametrize("at", [5, 24004, 65535, 70000])
def test_a_file_that_is_not_utf8_names_its_first_bad_byte(tmp_path, at):
    """The decoder's own offset counts from its read buffer: a bad byte at 24004 was reported at 7620."""
    data = bytearray(b"a" * 80000)
    data[at] = 0xE9
    (tmp_path / "t.txt").write_bytes(bytes(data))
    with pytest.raises(InvalidArgumentError, match=f"not UTF-8 text \\(invalid continuation byte at byte {at}\\)$"):
        list(iter_documents(tmp_path / "t.txt"))
