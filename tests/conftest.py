"""Shared fixtures: small random models on the CPU, and the location of ../shared."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from models.config import ModelConfig
from engine.steps import NativeUnavailableError
from engine.steps.native import PARALLEL_MIN_MACS, library, set_parallel_min
from engine.transformer import Transformer

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("GEN_SHARED_DIR", ROOT.parent / "shared"))

@pytest.fixture(scope="session", autouse=True)
def native_cache(tmp_path_factory):
    """One fresh build cache of the native step for the whole run, shared by the xdist workers and the
    processes tests start (the environment carries it): the step is compiled once per run (the
    workers take turns on its lock) from this checkout's sources, unless `gen`'s own cache holds the
    library of exactly these sources (seed_from_the_users_cache). A GEN_ENGINE_CACHE set by the user
    is kept."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") and base.name.startswith("popen-") else base
    if "GEN_ENGINE_CACHE" not in os.environ:
        os.environ["GEN_ENGINE_CACHE"] = str(shared / "native-cache")
        seed_from_the_users_cache(Path(os.environ["GEN_ENGINE_CACHE"]))
    yield os.environ["GEN_ENGINE_CACHE"]


def seed_from_the_users_cache(run_cache: Path) -> None:
    """A library `gen` already compiled into its own cache (~/.cache/gen-engine: .ci/run's first `gen`
    command builds it) from exactly these sources is copied into the run's cache instead of compiled
    again (~15 s of CPU): its file name is the hash of every source and header, build.py, the flags, the
    compiler (its file's size and time) and the CPU (engine.steps.native.build.source_key), so it is what
    a build here would make; then that compile (by `gen`, from this checkout) is the one the tests run
    on. tests/test_native_build.py tests the build's steps (locks, a failed compile) with a stand-in
    compiler. Copied whole (a temporary file renamed), so a worker never loads half of one."""
    from engine.steps.native import build
    cc = build.compiler()
    if cc is None:
        return
    name = f"decode-{build.source_key(cc)}.so"
    built = Path.home() / ".cache" / "gen-engine" / name
    if not built.is_file() or (run_cache / name).exists():
        return
    run_cache.mkdir(parents=True, exist_ok=True)
    tmp = run_cache / f".{name}.{os.getpid()}"
    shutil.copyfile(built, tmp)
    os.replace(tmp, run_cache / name)


@pytest.fixture
def small_copy_buffer(monkeypatch):
    """run_bench measures the machine's copy bandwidth once per run, for its floor (engine.bench.floor:
    the best of 5 copies of 256 MiB, ~0.5 s and more on a busy machine); tests that do not check the
    floor (tests/test_bench_floor.py does, on the real buffer) have it measured on 16 MiB."""
    from engine.bench import floor
    monkeypatch.setitem(floor.BUFFER_BYTES, "cpu", 16 << 20)


if os.environ.get("PYTEST_XDIST_WORKER"):
    # Workers share the cores: PyTorch's OpenMP pool on more threads than its share of them stalls at
    # every barrier (a small GQA test went from 0.7 s to 4 s), so each worker gets cores / workers.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


def one_line_error(r, *words, code=2):
    """A click result that is one `gen: error:` line on stderr holding each of `words`, exit `code`."""
    print(repr(r.stderr))
    assert r.exit_code == code and "Traceback" not in r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gen: error: ")
    for w in words:
        assert w in lines[0]
    return lines[0]


def tiny_config(**overrides) -> ModelConfig:
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, vocab_size=97, max_position_embeddings=128, rms_norm_eps=1e-5)
    base.update(overrides)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, dtype=torch.float32, **overrides) -> Transformer:
    """A random model whose weights are big enough that attention is far from uniform. With
    feature_map="hedgehog" its learned maps are random too (far from identity, different per layer
    and head)."""
    torch.manual_seed(seed)
    model = Transformer(tiny_config(**overrides))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
        if model.hedgehog is not None:
            g = torch.Generator().manual_seed(seed + 100)
            for p in model.hedgehog.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model.to(dtype).eval()


def check_every_split(model, tokens, attention: str = "linear", per_split=None, tol: float = 1e-5) -> None:
    """Chunked == naive reference over the whole block; then prefill(t) + one-token steps == reference
    at every split t, with the final S within `tol` relative of one whole prefill's. `per_split(state,
    full)` adds checks of other state tensors."""
    with torch.no_grad():
        naive = model(tokens, attention, reference=True)
        chunked = model(tokens, attention)
    assert (chunked - naive).abs().max().item() <= tol
    B, T = tokens.shape
    full = model.init_state(B, None, attention)
    model.step(tokens, full)
    worst = worst_S = 0.0
    for t in range(1, T):
        state = model.init_state(B, None, attention)
        outs = [model.step(tokens[:, :t], state)] + [model.step(tokens[:, i:i + 1], state) for i in range(t, T)]
        worst = max(worst, (torch.cat(outs, 1) - naive).abs().max().item())
        worst_S = max(worst_S, (state.S - full.S).abs().max().item() / full.S.abs().max().item())
        if per_split is not None:
            per_split(state, full)
    print(f"max |diff| logits {worst:.3e}, relative S {worst_S:.3e}")
    assert worst <= tol and worst_S <= tol


def shared_path(*parts: str) -> Path:
    """A file under ../shared, or skip the test with the reason."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} not found: ../shared is absent on this machine")
    return path


# ---------------------------------------------------------------------- generation fixtures
WORDS = ("the cat dog sat ran on a mat happy little big girl boy saw tree sun day went home "
         "and then she he said hello friend played ball park time once upon").split()


def generated_sentences(n: int = 400, seed: int = 0) -> list[str]:
    """Plain English-like sentences made from a small word list (deterministic)."""
    import random
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "."
            for _ in range(n)]


def sentence_corpus(path, n: int = 300, seed: int = 0):
    """A corpus file of generated_sentences, five to a document, documents separated by '<|endoftext|>'
    lines (what gen linearize and gen train read); returns the path."""
    sents = generated_sentences(n, seed=seed)
    path.write_text("\n<|endoftext|>\n".join(" ".join(sents[i:i + 5]) for i in range(0, n, 5)))
    return path


@pytest.fixture(scope="session")
def small_tokenizer(tmp_path_factory):
    """A 300-piece byte-fallback SentencePiece model trained here (no ../shared needed)."""
    from models.tokenizer import train_tokenizer
    path = tmp_path_factory.mktemp("tok") / "tokenizer.model"
    return train_tokenizer(generated_sentences(), str(path), vocab_size=300)


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory, small_tokenizer):
    """A saved random model (HF layout) with the small tokenizer: for load() and the CLI."""
    from models.weights import save_pretrained
    out = tmp_path_factory.mktemp("model")
    model = tiny_model(seed=3, vocab_size=small_tokenizer.vocab_size, max_position_embeddings=64,
                       trained_for=("softmax", "linear"))
    save_pretrained(model, str(out), tokenizer_path=small_tokenizer.path)
    return out


class ScriptState:
    """The state a ScriptedModel hands out: counts steps, holds no tensors, has no capacity."""
    max_len = None
    nbytes = 0

    def __init__(self, batch: int):
        self.batch, self.steps = batch, 0


class ScriptedModel:
    """A stand-in for Transformer (same init_state/step calls) whose logits make greedy decoding
    emit `scripts[b]` one token per step (then repeat the script's last token)."""

    def __init__(self, scripts: list[list[int]], vocab_size: int, eos_token_id=2):
        self.scripts = scripts
        self.config = tiny_config(vocab_size=vocab_size, eos_token_id=eos_token_id)
        self.device = torch.device("cpu")
        self.calls: list[tuple[tuple[int, ...], bool]] = []   # (tokens shape, last_only) per step

    def run_spec(self, attention=None, feature_map=None, spec=None):
        from engine.runspec import RunSpec
        return spec if spec is not None else RunSpec.from_config(self.config, attention, feature_map)

    def init_state(self, batch=1, max_len=None, attention=None, feature_map=None, device=None, dtype=None,
                   spec=None):
        return ScriptState(batch)

    def step(self, tokens, state, valid=None, last_only=False):
        self.calls.append((tuple(tokens.shape), last_only))
        k = state.steps
        state.steps += 1
        logits = torch.full((tokens.shape[0], 1, self.config.vocab_size), -1e4)
        for b, script in enumerate(self.scripts):
            logits[b, 0, script[min(k, len(script) - 1)]] = 0.0
        return logits


def greedy(step, state, logits, n):
    """n greedy tokens from logits (B, V), feeding each back. Returns a list per row."""
    out = [[] for _ in range(logits.shape[0])]
    for _ in range(n):
        nxt = logits.argmax(-1)
        for b, t in enumerate(nxt.tolist()):
            out[b].append(t)
        logits = step(nxt[:, None], state)[:, -1]
    return out


def check_rows_join_and_leave(step, new_state) -> None:
    """Rows prefilled alone (lengths 5, 2, 10), joined into one running batch at steps 0, 3 and 5
    (`concat`), dropped as they finish (`select_rows`): each row's 12 greedy tokens equal its solo
    run. new_state(max_len) -> an empty one-row state of the configuration under test."""
    prompts = [[1, 5, 9, 20, 3], [1, 7], [4, 4, 4, 4, 4, 4, 4, 4, 4, 1]]

    def prefill(ids, max_len):
        s = new_state(max_len)
        return s, step(torch.tensor([ids]), s, last_only=True)[:, -1]

    solo = []
    for ids in prompts:
        s, logits = prefill(ids, 64)
        solo.append(greedy(step, s, logits, 12)[0])
    outs, last, rows, state = [[] for _ in prompts], {}, [], None
    for t in range(30):
        if t in (0, 3, 5):                       # a new row joins the running batch
            i = (0, 3, 5).index(t)
            s, logits = prefill(prompts[i], 32)
            last[i] = int(logits.argmax())
            outs[i].append(last[i])
            state = s if state is None else type(s).concat([state, s], max_len=64)
            rows.append(i)
        logits = step(torch.tensor([[last[i]] for i in rows]), state)[:, -1]
        for b, i in enumerate(rows):
            last[i] = int(logits[b].argmax())
            outs[i].append(last[i])
        keep = [b for b, i in enumerate(rows) if len(outs[i]) < 12]
        if len(keep) < len(rows):
            rows = [rows[b] for b in keep]
            state = state.select_rows(keep) if keep else None
        if not rows:
            break
    assert outs == solo


def check_regrouping_copies_rows_exactly(step, new_state) -> None:
    """Four rows prefilled alone (lengths 5, 2, 10, 3), joined (`concat`), stepped twice, then rows
    [3, 0, 1] kept (`select_rows`: out of order, in two runs): every kept row's saved state equals the
    same row kept alone, and no slot outside a row's real ones is ever read: they are filled with NaN
    (a regrouping on the CPU leaves them unwritten), and a step of the kept rows still equals the same
    rows' step in the whole batch, every logit finite."""
    prompts = [[1, 5, 9, 20, 3], [1, 7], [4, 4, 4, 4, 4, 4, 4, 4, 4, 1], [2, 8, 6]]
    parts = []
    for ids in prompts:
        s = new_state(32)
        step(torch.tensor([ids]), s)
        parts.append(s)
    state = type(parts[0]).concat(parts, max_len=40)
    for t in (3, 11):
        step(torch.full((4, 1), t), state)
    kept = state.select_rows([3, 0, 1])
    for j, i in enumerate([3, 0, 1]):
        want, got = state.select_rows([i]).state_dict(), kept.select_rows([j]).state_dict()
        assert want["meta"] == got["meta"]
        assert want["tensors"].keys() == got["tensors"].keys()
        for name, t in want["tensors"].items():
            assert torch.equal(t, got["tensors"][name]), name
    for regrouped in (state, kept):
        poison_unwritten(regrouped)
    whole = step(torch.full((4, 1), 7), state)[:, -1]
    mine = step(torch.full((3, 1), 7), kept)[:, -1]
    assert torch.isfinite(whole).all() and torch.isfinite(mine).all()
    torch.testing.assert_close(mine, whole[[3, 0, 1]], rtol=0, atol=1e-5)


def poison_unwritten(state) -> None:
    """NaN in every KV slot that is not a real one written (pads, and past `slots`): what a regrouped
    cache on the CPU may hold there, at its worst."""
    for part in getattr(state, "parts", [state]):
        if hasattr(part, "slot_real"):
            outside = ~part.slot_real.clone()
            outside[:, part.slots:] = True
            for t in (part.k, part.v):
                t.masked_fill_(outside[None, :, None, :, None], float("nan"))


@pytest.fixture(scope="module")
def native_built(native_cache):
    """The native step built into the run's fresh cache (native_cache; or the module skipped, saying why), every phase on
    its pool even for small models, PyTorch references on one thread; restored afterwards. Yields
    the library."""
    try:
        lib = library()
    except NativeUnavailableError as e:
        pytest.skip(f"native decode step unavailable here: {e}")
    set_parallel_min(0)       # every phase on the pool, even for these small models
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the references (module path) on one thread: no OpenMP barriers on a busy machine
    yield lib                 # the ctypes library, for tests that call its kernels directly
    torch.set_num_threads(torch_threads)
    set_parallel_min(PARALLEL_MIN_MACS)


@pytest.fixture(scope="module")
def native_kernels(native_built):
    """(library, Mat) with the signatures of the kernels tests call directly: the quantized matmul
    (gen_qmatmul), q8 activation row bytes (qx_row_bytes), one matrix row decoded to fp32 (row_to_f32)."""
    import ctypes

    from engine.steps.native import Mat
    lib = native_built
    lib.gen_qmatmul.argtypes = [ctypes.POINTER(Mat), ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    lib.gen_qmatmul.restype = None
    lib.qx_row_bytes.argtypes = [ctypes.c_int]
    lib.qx_row_bytes.restype = ctypes.c_size_t
    lib.row_to_f32.argtypes = [ctypes.POINTER(Mat), ctypes.c_int, ctypes.c_void_p]
    lib.row_to_f32.restype = None
    return lib, Mat


def prompt_and_follow(seed: int, padded: bool, batch: int = 3, prompt: int = 7, follow: int = 12):
    """(prompt (batch, prompt), its pad mask or None, follow (batch, follow)): with `padded`, rows 1
    and 2 are left-padded by 3 and 6 slots."""
    g = torch.Generator().manual_seed(seed)
    tokens, rest = torch.randint(0, 97, (batch, prompt), generator=g), torch.randint(0, 97, (batch, follow), generator=g)
    real = None
    if padded:
        real = torch.ones(batch, prompt, dtype=torch.bool)
        real[1, :3] = real[2, :6] = False
    return tokens, real, rest


def module_and_native_steps(model, step, ref, fast, follow):
    """Step `follow` (B, N) token by token: the module path of `model` on state `ref`, the Stepper
    `step` on state `fast`, which must run natively every time. Returns both logits (B, N, V)."""
    a, b = [], []
    for t in follow.T:
        a.append(model.step(t[:, None], ref))
        b.append(step(t[:, None], fast))
        assert step.last_form == "native", step.fallback
    return torch.cat(a, 1), torch.cat(b, 1)


def check_padded_pair_alone(model, step, a: list[int], b: list[int], steps: int, path: str = "linear") -> None:
    """Prompts a and b (len(a) > len(b)) in one left-padded batch on `step`, then `steps` one-token
    steps (tokens 12 + i and 20 + i): each row's logits equal its own run alone on the module path."""
    pad = len(a) - len(b)
    batch = torch.tensor([a, [0] * pad + b])
    real = torch.tensor([[True] * len(a), [False] * pad + [True] * len(b)])
    state = model.init_state(2, None, path)
    with torch.no_grad():
        out = step(batch, state, valid=real)
        nxt = [step(torch.tensor([[12 + i], [20 + i]]), state) for i in range(steps)]
        for row, ids, base in ((0, a, 12), (1, b, 20)):
            alone = model.init_state(1, None, path)
            o = model.step(torch.tensor([ids]), alone)
            assert (out[row, -1] - o[0, -1]).abs().max().item() <= 1e-5
            for i in range(steps):
                assert (nxt[i][row] - model.step(torch.tensor([[base + i]]), alone)[0]).abs().max().item() <= 1e-5


def native_after_prefill(model, prompt, real, follow, max_len: int):
    """A prompt (left-padded by `real`) prefilled on the module path into a state and copied into a
    twin; then `follow` token by token on the module path and on the native step (which must run every
    step). Returns (module state, native state, module logits, native logits)."""
    from engine.steps import Stepper
    ref, fast = model.init_state(prompt.shape[0], max_len), model.init_state(prompt.shape[0], max_len)
    with torch.no_grad():
        model.step(prompt, ref, valid=real)
        fast.load_state_dict(ref.state_dict())
        a, b = module_and_native_steps(model, Stepper(model, "native", threads=2), ref, fast, follow)
    return ref, fast, a, b


def check_rows_alone(step, model, prompt, rows, max_len: int = 40) -> None:
    """Rows (B, 1) stepped in one batch after the same prompt get the bits each gets alone."""
    B = rows.shape[0]
    state = model.init_state(B, max_len, "softmax")
    step(prompt.expand(B, -1).contiguous(), state, last_only=True)
    both = step(rows, state)
    for b in range(B):
        alone = model.init_state(1, max_len, "softmax")
        step(prompt, alone, last_only=True)
        assert torch.equal(step(rows[b:b + 1], alone), both[b:b + 1])


def greedy_against(step, model, ref, prompt, path: str, n: int = 20, synced: bool = False):
    """Prompt block (1, T), then n greedy steps on `step`; `ref` (a module path) follows on a twin
    state with the same tokens (synced: the twin reset to `step`'s state before each step, so that
    each step is compared from the same state). Returns (logits, reference logits) (1 + n, V) and
    the ids each would pick."""
    state, twin = model.init_state(1, 64, path), model.init_state(1, 64, path)
    got = [step(prompt, state, last_only=True)[0, -1]]
    want = [ref.step(prompt, twin)[0, -1]]
    ids, ref_ids = [], []
    for _ in range(n):
        ids.append(int(got[-1].argmax()))
        ref_ids.append(int(want[-1].argmax()))
        tok = torch.tensor([[ids[-1]]])
        if synced:
            twin.load_state_dict(state.state_dict())
        got.append(step(tok, state)[0, -1])
        want.append(ref.step(tok, twin)[0, -1])
    return torch.stack(got), torch.stack(want), ids, ref_ids


def check_qmatmul(lib, mat, x, b, kind: str, shape: tuple[int, int], label: str) -> None:
    """The native q8 matmul `mat` (a Mat over blocks `b` of `kind`) on activations x [B, cols]: equal to
    linear_q8's exact sums within fp32 rounding of the per-block scaling (1e-6 of the largest output),
    within the activations' q8 rounding of dequantize-then-fp32, and a row's result independent of
    its batch."""
    import ctypes

    from engine.quant import dequantize, linear_q8, quantize_activations
    rows, cols = shape
    got, qx = torch.empty(x.shape[0], rows), torch.zeros(x.shape[0], lib.qx_row_bytes(cols), dtype=torch.uint8)
    lib.gen_qmatmul(ctypes.byref(mat), x.data_ptr(), x.shape[0], got.data_ptr(), qx.data_ptr())
    want = linear_q8(x, b, kind, shape)
    w = dequantize(b, kind, shape)
    exact = x @ w.T
    rel = ((got - want).abs().max() / want.abs().max()).item()
    # dequantize-then-fp32: each activation moves by at most half its block's q8 step (max|x| / 254)
    _, dx = quantize_activations(x)
    bound = (dx / 2).repeat_interleave(32, -1) @ w.abs().T
    print(f"{label}: relative to linear_q8 {rel:.1e}; to dequantize-then-fp32 "
          f"{((got - exact).abs() / bound).max():.2f} of the rounding bound")
    assert rel <= 1e-6
    assert ((got - exact).abs() <= bound * 1.001 + 1e-6).all()
    one = torch.empty(1, rows)
    lib.gen_qmatmul(ctypes.byref(mat), x[-1:].contiguous().data_ptr(), 1, one.data_ptr(), qx.data_ptr())
    assert torch.equal(one[0], got[-1])


def check_dequantize_equals_gguf(b, kind: str, shape: tuple[int, int], gguf_type) -> None:
    """engine.quant.dequantize of blocks `b` equals the gguf package's own decoding, bit for bit."""
    import numpy as np
    from gguf.quants import dequantize as gguf_dequantize

    from engine.quant import dequantize
    ours = dequantize(b, kind, shape)
    ref = gguf_dequantize(b.numpy(), gguf_type)
    assert ours.dtype == torch.float32 and ref.shape == shape
    assert np.array_equal(ours.numpy().view(np.int32), ref.view(np.int32))


def check_native_q8_decode(model, prompt, path: str, label: str) -> None:
    """The native q8 step against the q8 reference from the same state (1e-5 of the logits' scale on
    most steps, 0.1 at worst, where torch's and C's fp32 sums put an activation at a q8 rounding tie),
    and against dequantize-then-fp32 only loosely (q8's rounding must show: the reference is not
    vacuous)."""
    from engine.quant import q8_reference
    from engine.steps import Stepper
    step = Stepper(model, "native", threads=2, activations="q8")
    got, want, _, _ = greedy_against(step, model, q8_reference(model), prompt, path, synced=True)
    per_step = (got - want).abs().amax(-1) / want.abs().amax(-1)
    q8, deq, _, _ = greedy_against(Stepper(model, "native", threads=2, activations="q8"), model, model, prompt, path)
    d_exact = ((q8 - deq).abs().amax(-1) / deq.abs().amax(-1)).max().item()
    tight = (per_step <= 1e-5).float().mean().item()
    print(f"{label} {path}: native q8 vs q8 reference max {per_step.max():.1e} ({tight:.0%} of steps within "
          f"1e-5); vs dequantize-then-fp32 {d_exact:.1e}")
    assert step.last_form == "native"
    assert tight >= 0.75 and per_step.max() <= 0.1
    assert 1e-6 < d_exact <= 0.1


def check_native_f32_decode(model, prompt, path: str, label: str) -> None:
    """The native step with fp32 activations on one thread (each matrix runs whole) against the module
    path on dequantized weights: the same products summed in another order (1e-4 of the logits' scale
    over the prompt and 20 steps), greedy ids equal."""
    from engine.steps import Stepper
    step = Stepper(model, "native", threads=1, activations="f32")
    got, want, ids, ref_ids = greedy_against(step, model, model, prompt, path)
    assert step.last_form == "native" and step.last_prefill_form == "native"
    rel = ((got - want).abs().amax(-1) / want.abs().amax(-1)).max().item()
    print(f"{label} {path}: native f32 vs dequantize-then-fp32, max relative logit diff {rel:.1e}")
    assert rel <= 1e-4
    assert ids == ref_ids
