"""The training script on a few documents: loss goes down, checkpoints resume, exports load."""
import random

import pytest
import torch

from engine.evaluate import evaluate_file, windows
from models.corpus import read_documents
from engine.loader import load_model
from engine.train import TrainArgs, get_batch, loss_fn, tokenize_corpus, train
from models.tokenizer import Tokenizer

WORDS = "the a cat dog sun big small red happy sad ran jumped saw played with park tree ball girl boy".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = random.Random(0)
    d = tmp_path_factory.mktemp("corpus")
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))).capitalize() + "." for _ in range(120)]
    (d / "train.txt").write_text("\n<|endoftext|>\n".join(docs[:100]) + "\n")
    (d / "valid.txt").write_text("\n<|endoftext|>\n".join(docs[100:]) + "\n<|endoftext|>\n")
    return d


def args(corpus, out, steps, **kw):
    base = dict(warmup=2, train=str(corpus / "train.txt"), valid=str(corpus / "valid.txt"), out=str(out),
                export=str(out / "export"), vocab_size=320, dim=32, layers=1, heads=2, seq_len=32,
                batch_size=4, steps=steps, lr=3e-3, eval_every=1000, eval_docs=5,
                save_every=1, progress=False, amp=None, seed=0)
    base.update(kw)
    return TrainArgs(**base)


def test_two_steps_lower_the_loss_and_export_loads(corpus, tmp_path):
    a = args(corpus, tmp_path / "run", steps=2)
    model = train(a, log=lambda *_: None)
    tok = Tokenizer(tmp_path / "run" / "tokenizer.model")
    stream = tokenize_corpus(tok, [(corpus / "train.txt").read_text().split("<|endoftext|>")[0].strip()] * 4)
    history = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["history"]
    first, last = [h for h in history if "eval" not in h]
    print("losses", first, last)
    # the same batch, scored by the untrained (seeded) model and by the one after two steps
    untrained = train(args(corpus, tmp_path / "run0", steps=0, export=None,
                           tokenizer=str(tmp_path / "run" / "tokenizer.model")), log=lambda *_: None)
    fixed = get_batch(tokenize_corpus(tok, read_documents(a.train)), a, 0)
    with torch.no_grad():
        before = loss_fn(untrained, fixed, a.paths, a.feature_map)
        after = loss_fn(model, fixed, a.paths, a.feature_map)
    print("fixed batch", {p: (before[p].item(), after[p].item()) for p in a.paths})
    assert all(after[p] < before[p] for p in a.paths)
    loaded, loaded_tok = load_model(tmp_path / "run" / "export", dtype="float32")
    assert loaded.config.trained_for == ("softmax", "linear")
    assert loaded_tok.bos_id == loaded.config.bos_token_id and loaded_tok.eos_id in loaded.config.eos_ids
    batch = get_batch(stream, a, 0)
    with torch.no_grad():
        ours = loss_fn(model, batch, a.paths, a.feature_map)
        theirs = loss_fn(loaded, batch, a.paths, a.feature_map)
    for p in a.paths:   # the export is fp16: close, not equal
        assert abs(ours[p].item() - theirs[p].item()) < 2e-2


def test_resume_continues_exactly(corpus, tmp_path):
    straight = train(args(corpus, tmp_path / "straight", steps=4), log=lambda *_: None)
    train(args(corpus, tmp_path / "split", steps=4, stop_after=2), log=lambda *_: None)   # stopped at step 2
    assert not (tmp_path / "split" / "export").exists()     # exported only when the schedule ends
    logs = []
    resumed = train(args(corpus, tmp_path / "split", steps=4), log=logs.append)
    assert any("resumed" in line and "step 2" in line for line in logs), logs
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.allclose(a, b, atol=1e-6), name


def test_documents_become_bos_text_eos(corpus, tmp_path):
    train(args(corpus, tmp_path / "run", steps=1, export=None), log=lambda *_: None)
    tok = Tokenizer(tmp_path / "run" / "tokenizer.model")
    stream = tokenize_corpus(tok, ["Hello there.", "The end."]).tolist()
    assert stream[0] == tok.bos_id and stream.count(tok.bos_id) == 2 and stream.count(tok.eos_id) == 2
    assert "<|endoftext|>" not in tok.decode(stream)
    text = "The cat saw a big red ball.\n\nThe dog ran!"
    assert tok.decode(tok.encode(text)) == text


def test_eval_windows_score_every_target_once():
    ids = list(range(23))
    for context in (4, 5, 8, 23, 50):
        scored = []
        for win, first in windows(ids, context):
            assert len(win) <= context
            scored += win[first + 1:]      # targets predicted from positions first..end-2
        assert scored == ids[1:], context


def test_eval_file_counts_tokens_and_bytes(corpus, tmp_path):
    train(args(corpus, tmp_path / "run", steps=1), log=lambda *_: None)
    model, tok = load_model(tmp_path / "run" / "export")
    docs = (corpus / "valid.txt").read_text().split("<|endoftext|>")
    docs = [d.strip() for d in docs if d.strip()]
    res = evaluate_file(model, tok, corpus / "valid.txt", attention="linear")
    assert res.documents == len(docs)
    assert res.bytes == sum(len(d.encode()) + 1 for d in docs)
    assert res.tokens == sum(len(tok.encode(d)) + 1 for d in docs)   # text tokens + EOS
    small = evaluate_file(model, tok, corpus / "valid.txt", attention="linear", context=8)
    assert small.tokens == res.tokens      # windows score every target, nothing truncated
