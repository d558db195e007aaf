"""gen linearize and gen train refuse bad numbers before any work: one line naming the option, exit code 2,
no traceback, and no --out directory (neither a half-written .linearize/ nor an empty run directory)."""
import pytest
from click.testing import CliRunner

from cli.main import main
from tests.conftest import sentence_corpus

LINEARIZE = ["--tokens", "512", "--seq-len", "32", "--layer-steps", "1", "--finetune-steps", "1", "--batch-size", "2",
             "--finetune-batch", "2", "-t", "1"]
TRAIN = ["--steps", "2", "--dim", "32", "--layers", "1", "--heads", "2", "--seq-len", "16", "--batch-size", "2",
         "--vocab-size", "300", "-t", "1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return sentence_corpus(tmp_path_factory.mktemp("data") / "text.txt", 300, seed=2)


def ids(cases) -> list[str]:
    """Test ids from the options given: lr_nan, hybrid_2_window_4, ..."""
    return ["_".join(a.removeprefix("--") for a in extra) for extra, _ in cases]


def refused(args, option, out):
    """The command gave one line naming `option`, exit 2, no traceback, and left no `out`."""
    r = CliRunner().invoke(main, [str(a) for a in args])
    print(r.output)
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit))
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gen: error: ") and option in lines[0], r.output
    assert not out.exists()


LINEARIZE_CASES = [
    (["--seq-len", "1"], "--seq-len"),            # the finetune would read rows of 0 tokens
    (["--seq-len", "0"], "--seq-len"),
    (["--lr", "-1"], "--lr"), (["--lr", "nan"], "--lr"), (["--lr", "inf"], "--lr"),
    (["--finetune-lr", "nan"], "--finetune-lr"), (["--finetune-lr", "-0.5"], "--finetune-lr"),
    (["--maps-lr", "nan"], "--maps-lr"),
    (["--decay-lr", "nan"], "--decay-lr"), (["--decay", "--decay-lr", "0"], "--decay-lr"),
    (["--gate-lr", "inf"], "--gate-lr"), (["--gate-lr", "nan"], "--gate-lr"),
    (["--finetune-clip", "nan"], "--finetune-clip"),
    (["--budget", "nan"], "--budget"), (["--budget", "inf"], "--budget"), (["--budget", "-1"], "--budget"),
    (["--hybrid", "2"], "--hybrid"),              # the model has 2 layers: none would be linear
    (["--hybrid", "2", "--window", "4"], "--hybrid"),
    (["--hybrid", "3"], "--hybrid"),
]


@pytest.mark.parametrize("extra, option", LINEARIZE_CASES, ids=ids(LINEARIZE_CASES))
def test_linearize_refuses_before_any_work(small_model_dir, corpus, tmp_path, extra, option):
    out = tmp_path / "lo"
    refused(["linearize", "-m", small_model_dir, "--data", corpus, "--out", out, *LINEARIZE, *extra], option, out)


def test_linearize_hybrid_message_names_the_layers(small_model_dir, corpus, tmp_path):
    r = CliRunner().invoke(main, [str(a) for a in ["linearize", "-m", small_model_dir, "--data", corpus, "--out",
                                                   tmp_path / "lo", *LINEARIZE, "--hybrid", "2"]])
    assert "the model has 2 layers" in r.output and "at most 1" in r.output, r.output


TRAIN_CASES = [
    (["--vocab-size", "0"], "--vocab-size"), (["--vocab-size", "259"], "--vocab-size"),
    (["--lr", "nan"], "--lr"), (["--lr", "-1"], "--lr"), (["--lr", "inf"], "--lr"),
    (["--seq-len", "0"], "--seq-len"),
    (["--batch-size", "0"], "--batch-size"),
    (["--amp", "int8"], "--amp"),
    (["--kv-heads", "0"], "--kv-heads"), (["--kv-heads", "3"], "--kv-heads"),
    (["--heads", "3"], "--heads"),                # 32 is no multiple of 3
    (["--heads", "32"], "--heads"),               # heads of 1 dimension: no rotary pairs
    (["--paths", ","], "--paths"), (["--paths", "softmax,hybrid"], "--paths"),
    (["--feature-map", "elu2"], "--feature-map"),
    (["--save-every", "0"], "--save-every"), (["--eval-every", "0"], "--eval-every"),
    (["--steps", "-1"], "--steps"),
    (["--tokenizer", "missing.model"], "--tokenizer"),
]


@pytest.mark.parametrize("extra, option", TRAIN_CASES, ids=ids(TRAIN_CASES))
def test_train_refuses_before_the_tokenizer_trains(corpus, tmp_path, extra, option):
    out = tmp_path / "run"
    refused(["train", "--train", corpus, "--out", out, *TRAIN, *extra], option, out)


@pytest.mark.parametrize("vocab, what", [("262", "at least"), ("100000", "at most")])
def test_train_vocab_size_the_text_cannot_fill_is_one_line(corpus, tmp_path, vocab, what):
    """What the text allows is known only once SentencePiece has read it: still one line, and no run directory."""
    out = tmp_path / "run"
    r = CliRunner().invoke(main, [str(a) for a in ["train", "--train", corpus, "--out", out, *TRAIN,
                                                   "--vocab-size", vocab]])
    print(r.output)
    lines = [line for line in r.output.strip().splitlines() if not line.startswith("training tokenizer")]
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert len(lines) == 1 and "--vocab-size" in lines[0] and what in lines[0]
    assert not out.exists()
