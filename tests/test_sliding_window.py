"""Mistral's sliding window on the softmax path (engine.attention.sliding): query t sees keys (t - W, t], a
ring KV cache of W slots per layer, against transformers' own MistralForCausalLM with random weights, past
the window: the parallel forward, prefill in one block and in chunks, every step form, greedy ids, padded
batches and regrouped rows, saved states, the CLI. The native and graph steps refuse it in one line."""
from __future__ import annotations

import json

import pytest
import torch

from engine.api import load
from engine.attention.sliding import SlidingKVState
from engine.loader import load_model
from engine.steps import make_step
from engine.steps.graph_step import GraphStep
from models.config import ModelConfig
from models.errors import ConfigError

transformers = pytest.importorskip("transformers", reason="transformers not installed (test extra)")

TOL = 1e-4
W = 8            # the sliding window
CONTEXT = 64     # max_position_embeddings
SHAPE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=CONTEXT, rms_norm_eps=1e-5, rope_theta=10000.0,
             tie_word_embeddings=False)


def mistral(sliding_window, seed=0):
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**SHAPE, sliding_window=sliding_window))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.08 if p.dim() >= 2
                    else 1 + 0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(transformers model with sliding_window W, its Hugging Face directory)."""
    theirs = mistral(W)
    directory = tmp_path_factory.mktemp("mistral-swa")
    theirs.save_pretrained(directory)
    return theirs, directory


@pytest.fixture(scope="module")
def ours(saved):
    return load_model(saved[1], dtype="float32")[0]


def ids(seed, length):
    return torch.randint(0, SHAPE["vocab_size"], (1, length), generator=torch.Generator().manual_seed(seed))


def max_diff(a, b):
    d = (a.float() - b.float()).abs().max().item()
    print(f"max |logit diff| = {d:.3e}")
    return d


def stepwise(model, x, backend, state=None):
    step = make_step(model, backend=backend)
    state = state if state is not None else model.init_state(x.shape[0])
    return torch.cat([step(x[:, t:t + 1], state) for t in range(x.shape[1])], 1), step


# ---------------------------------------------------------------------------- against transformers
def test_the_window_changes_transformers_logits(saved):
    """The window bites past W tokens (so the tests below would see a path that ignored it)."""
    theirs, _ = saved
    x = ids(0, 40)
    with torch.no_grad():
        full = mistral(None)(x).logits
        windowed = theirs(x).logits
    assert max_diff(windowed[:, :W], full[:, :W]) <= TOL
    assert max_diff(windowed[:, W:], full[:, W:]) > 100 * TOL


def test_logits_equal_transformers_at_every_position(saved, ours):
    theirs, _ = saved
    assert isinstance(ours.init_state(1), SlidingKVState) and ours.config.softmax_window == W
    x = ids(1, 40)
    with torch.no_grad():
        ref = theirs(x).logits
        assert max_diff(ours(x), ref) <= TOL
        assert max_diff(ours(x, reference=True), ref) <= TOL
        assert max_diff(ours.step(x, ours.init_state(1)), ref) <= TOL          # one block of 40 > W
        for size in (3, W - 1, W, W + 5, 16):                                   # chunked prefill, every split
            state = ours.init_state(1)
            got = torch.cat([ours.step(x[:, s:s + size], state) for s in range(0, 40, size)], 1)
            assert max_diff(got, ref) <= TOL, size
    for backend in ("module", "torch", "auto"):
        got, step = stepwise(ours, x, backend)
        assert max_diff(got, ref) <= TOL, backend


def test_stepper_prefill_chunks_then_steps(saved, ours):
    """The generation loop's shape: a prompt past the window in chunks (DEFAULT_PREFILL_CHUNK and others),
    then one token at a time."""
    theirs, _ = saved
    x = ids(2, 45)
    with torch.no_grad():
        ref = theirs(x).logits
    for chunk in (16, 5):
        step = make_step(ours, backend="torch", prefill_chunk=chunk)
        state = ours.init_state(1)
        last = step(x[:, :30], state, last_only=True)
        got = torch.cat([last] + [step(x[:, t:t + 1], state) for t in range(30, 45)], 1)
        assert max_diff(got, ref[:, 29:]) <= TOL, chunk


@pytest.mark.parametrize("matmuls", [False, True], ids=["sdpa", "two-matmuls"])
def test_torch_step_equals_module_path(ours, matmuls, monkeypatch):
    """matmuls: one query over the ring as two matmuls (what long windows take) instead of SDPA."""
    import engine.attention.sliding as sliding
    if matmuls:
        monkeypatch.setattr(sliding, "ONE_QUERY_MATMUL_FROM", 4)
    x = ids(3, 30)
    module, _ = stepwise(ours, x, "module")
    torch_form, step = stepwise(ours, x, "torch")
    assert step.last_form == "torch"
    assert max_diff(torch_form, module) <= 1e-5
    with torch.no_grad():
        assert max_diff(module, ours(x)) <= TOL


def test_a_16_bit_ring_holds_what_steps_and_blocks_both_read(ours):
    """kv_dtype float16 under fp32 weights: a block reads its own keys rounded as the ring keeps them, so
    prefill in chunks equals one token at a time."""
    x = ids(19, 30)
    state = ours.init_state(1, kv_dtype=torch.float16)
    assert state.k.dtype == torch.float16
    with torch.no_grad():
        blocks = torch.cat([ours.step(x[:, s:s + 7], state) for s in range(0, 30, 7)], 1)
    steps, _ = stepwise(ours, x, "torch", ours.init_state(1, kv_dtype=torch.float16))
    # 1e-4: a block and a step compute a key in fp32 in different orders (per CPU: 3e-5 on an AVX-512
    # Xeon, where one element rounds to the other side of an f16 step); a block that read its keys
    # unrounded differs by 7e-4
    assert max_diff(blocks, steps) <= 1e-4


def test_greedy_ids_equal_transformers_over_40_tokens(saved):
    theirs, directory = saved
    prompt = ids(4, 5)[0].tolist()
    want = list(prompt)
    with torch.no_grad():
        for _ in range(40):
            want.append(int(theirs(torch.tensor([want])).logits[0, -1].argmax()))
    got = load(str(directory)).generate(prompt, max_new_tokens=40, temperature=0, ignore_eos=True)
    assert got.ids == want[5:]


def test_state_bytes_do_not_grow_with_the_context(ours):
    """A ring of W slots per layer: the same bytes after 10 tokens and after 60, W-sized."""
    step = make_step(ours, backend="torch")
    state = ours.init_state(1)
    x = ids(5, 60)
    step(x[:, :10], state, last_only=True)
    early = state.nbytes
    for t in range(10, 60):
        step(x[:, t:t + 1], state)
    cfg = ours.config
    assert state.slots == 60 and state.max_len is None
    assert state.nbytes == early == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * W * cfg.head_dim * 4


# ---------------------------------------------------------------------------- batches
def test_padded_block_equals_each_row_alone(ours):
    """The module path on a left-padded block (pads masked, windows counted in each row's own keys), then
    steps: every row's logits as alone."""
    a, b = ids(6, 19)[0], ids(7, 6)[0]
    tokens = torch.zeros(2, 19, dtype=torch.long)
    tokens[0], tokens[1, 13:] = a, b
    valid = torch.ones(2, 19, dtype=torch.bool)
    valid[1, :13] = False
    more = ids(8, 12).view(1, 12).expand(2, 12)
    with torch.no_grad():
        state = ours.init_state(2)
        first = ours.step(tokens, state, valid=valid)
        rest = torch.cat([ours.step(more[:, t:t + 1], state) for t in range(12)], 1)
        for row, prompt in enumerate((a, b)):
            alone = ours.init_state(1)
            want = ours.step(prompt[None], alone)
            assert max_diff(first[row, 19 - len(prompt):], want[0]) <= TOL
            want = torch.cat([ours.step(more[:1, t:t + 1], alone) for t in range(12)], 1)
            assert max_diff(rest[row], want[0]) <= TOL


def test_concat_and_select_rows_keep_each_row(ours):
    """The server's regrouping: rows prefilled apart (different slots) joined, stepped together, one taken
    back out and stepped on: each as alone."""
    step = make_step(ours, backend="torch")
    prompts = [ids(9, 13), ids(10, 5), ids(11, 20)]
    more = ids(12, 14)
    states = []
    for p in prompts:
        states.append(ours.init_state(1))
        step(p, states[-1], last_only=True)
    joined = SlidingKVState.concat(states)
    assert joined.batch_size == 3 and joined.padded
    batch = torch.cat([step(more[:, t:t + 1].expand(3, 1), joined) for t in range(7)], 1)
    one = joined.select_rows([1])
    assert not one.padded and one.slots == 5 + 7
    later = torch.cat([step(more[:, t:t + 1], one) for t in range(7, 14)], 1)
    for row, p in enumerate(prompts):
        alone = ours.init_state(1)
        step(p, alone, last_only=True)
        want = torch.cat([step(more[:, t:t + 1], alone) for t in range(14)], 1)
        assert max_diff(batch[row], want[0, :7]) <= TOL
        if row == 1:
            assert max_diff(later[0], want[0, 7:]) <= TOL


def test_api_batch_of_prompts_equals_each_alone(saved):
    llm = load(str(saved[1]))
    a, b = ids(13, 19)[0].tolist(), ids(14, 6)[0].tolist()
    both = llm.generate([a, b], max_new_tokens=12, temperature=0, ignore_eos=True)
    alone = [llm.generate(p, max_new_tokens=12, temperature=0, ignore_eos=True) for p in (a, b)]
    assert [r.ids for r in both] == [r.ids for r in alone]


def test_saved_state_resumes_as_uninterrupted(saved, tmp_path):
    llm = load(str(saved[1]))
    prompt = ids(15, 20)[0].tolist()
    whole = llm.generate(prompt, max_new_tokens=10, temperature=0, ignore_eos=True)
    llm.save_state(tmp_path / "s.safetensors", llm.prefill(prompt))
    back = llm.load_state(tmp_path / "s.safetensors")
    assert isinstance(back.state, SlidingKVState)
    assert llm.resume(back, max_new_tokens=10, temperature=0, ignore_eos=True).run()[0].ids == whole.ids


def test_hybrid_saved_state_with_a_ring_resumes_as_uninterrupted(saved, tmp_path):
    """A hybrid's saved state whose softmax part is the ring loads back (it was handed the linear part's
    feature map: TypeError) and continues as the run never stopped."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = load(str(saved[1]), attention="hybrid", softmax_layers=[1])
    prompt = ids(18, 20)[0].tolist()
    whole = llm.generate(prompt, max_new_tokens=10, temperature=0, ignore_eos=True)
    llm.save_state(tmp_path / "s.safetensors", llm.prefill(prompt))
    back = llm.load_state(tmp_path / "s.safetensors")
    assert isinstance(back.state.parts[0], SlidingKVState)
    assert llm.resume(back, max_new_tokens=10, temperature=0, ignore_eos=True).run()[0].ids == whole.ids


def test_hybrid_softmax_layers_slide_too(saved):
    """A hybrid's softmax layer keeps the ring; step by step equals the parallel forward."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load(str(saved[1]), attention="hybrid", softmax_layers=[1], backend="torch").model
    x = ids(16, 30)
    with torch.no_grad():
        full = model(x)
    got, _ = stepwise(model, x, "torch")
    assert isinstance(model.init_state(1).parts[0], SlidingKVState)
    assert max_diff(got, full) <= TOL


# ---------------------------------------------------------------------------- forms that refuse it
def test_native_and_graph_steps_refuse_in_one_line(ours):
    state = ours.init_state(1)
    x = ids(17, 1)
    reason = GraphStep(ours).why_not(state, x)
    assert "sliding-window" in reason and "\n" not in reason
    step = make_step(ours)
    step(x, state)
    assert step.last_form == "torch"
    if "native" in step.forms_available:
        assert "sliding-window KV cache" in step.fallback and "\n" not in step.fallback


def test_cli_generates(saved):
    from click.testing import CliRunner

    from cli.main import main
    prompt = ids(18, 12)[0].tolist()
    r = CliRunner().invoke(main, ["--model", str(saved[1]), "--ids", ",".join(map(str, prompt)), "-n", "20",
                                  "--temperature", "0", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    want = load(str(saved[1])).generate(prompt, max_new_tokens=20, temperature=0)
    assert out["ids"] == want.ids and len(prompt) + len(want.ids) > W


# ---------------------------------------------------------------------------- config
def test_config_names_the_window_apart_from_the_linear_one():
    small = dict(SHAPE, model_type="mistral")
    cfg = ModelConfig.from_dict({**small, "sliding_window": 16})
    assert cfg.softmax_window == 16 and cfg.window == 0
    assert cfg.to_dict()["sliding_window"] == 16
    assert ModelConfig.from_dict({**small, "sliding_window": CONTEXT}).softmax_window == 0   # covers the context
    assert ModelConfig.from_dict({**small, "sliding_window": None}).softmax_window == 0
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict({**small, "sliding_window": 0})
    assert "sliding_window must be a positive integer" in str(e.value) and "\n" not in str(e.value)
    # Qwen2's per-layer window stays refused in one line; off (the released models) it is dropped
    qwen = dict(SHAPE, model_type="qwen2", sliding_window=16)
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict({**qwen, "use_sliding_window": True, "max_window_layers": 0})
    assert "use_sliding_window" in str(e.value) and "\n" not in str(e.value)
    assert ModelConfig.from_dict({**qwen, "use_sliding_window": False}).softmax_window == 0


def test_export_keeps_the_window_for_transformers(ours, tmp_path):
    ours.config.to_json(tmp_path / "config.json")
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    assert theirs.sliding_window == W


def test_server_scheduler_batches_and_joins_rows_as_alone(saved):
    """The server's scheduler driven by hand (no thread, no HTTP): prompts shorter and longer than the window
    prefilled together, two more joining mid-decode (rows right-aligned: a ring renumbered), one of them a
    prefix-cache hit; every request's tokens equal its run alone, past the window."""
    from engine.sampling import SamplingParams
    from engine.serve import PrefixCache, Scheduler
    from engine.serve.scheduler import Job, Token
    llm = load(str(saved[1]), backend="torch")
    prompts = [ids(20 + i, n)[0].tolist() for i, n in enumerate((3, 12, 19))] + [ids(21, 12)[0].tolist() + [5, 6]]

    def run(first, later):
        sched = Scheduler(llm.model, llm.tokenizer, llm.step, max_batch=8, cache=PrefixCache(max_entries=8, min_tokens=4))
        outs = {}

        def jobs(which):
            return [Job(ids=prompts[i], path="softmax", params=SamplingParams(temperature=0.9 if i % 2 else 0, seed=i),
                        max_tokens=16, ignore_eos=True,
                        emit=lambda ev, i=i: outs.setdefault(i, []).append(ev.id if isinstance(ev, Token) else ev))
                    for i in which]
        sched._iterate(jobs(first))
        for _ in range(5):
            sched._iterate([])
        sched._iterate(jobs(later))
        for _ in range(60):
            if not sched.active:
                break
            sched._iterate([])
        return outs, sched

    together, sched = run([0, 1], [2, 3])
    assert sched.cache.hits >= 1          # prompt 3 starts with prompt 1
    for i in range(4):
        alone, _ = run([i], [])
        assert together[i] == alone[i], f"prompt {i}"
