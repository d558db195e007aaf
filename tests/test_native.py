"""The native C step form (engine.steps.native) against the module path: both attention paths,
batches (left-padded too), threads, 16-bit and quantized weights."""
import pytest
import torch

from engine.errors import ContextFullError
from engine.quant import QuantLinear, quantize, quantize_model
from engine.steps import NativeStep, NativeUnavailableError, Stepper
from tests.conftest import tiny_model


pytestmark = pytest.mark.usefixtures("native_built")   # tests/conftest.py: built, or skipped with the reason


def run(model, prompt, follow, backend, max_len=64, attention="softmax", batch=1, fmap=None, threads=None,
        real=None, state_dtype=None):
    """Prefill `prompt` (pad mask `real`), then step `follow` one token at a time;
    returns (logits, state, forms that ran)."""
    step = Stepper(model, backend, threads=threads)
    state = model.init_state(batch, max_len, attention, feature_map=fmap, dtype=state_dtype)
    out = [step(prompt, state, valid=real)[:, -1:]]
    forms = set()
    for t in follow.T:
        out.append(step(t.reshape(batch, 1), state))
        forms.add(step.last_form)
    return torch.cat(out, 1), state, forms


def tokens(seed, batch=1, prompt=5, follow=20):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (batch, prompt), generator=g), torch.randint(0, 97, (batch, follow), generator=g)


CASES = {
    "MHA": {}, "GQA": {"num_key_value_heads": 2}, "untied": {"tie_word_embeddings": False},
    "no-rope": {"position_encoding": "none"}, "head_dim-12": {"head_dim": 12},
}


@pytest.mark.parametrize("case", list(CASES))
def test_native_step_equals_module_step(case, threads=2):
    model = tiny_model(**CASES[case])
    prompt, follow = tokens(1)
    ref, s_ref, _ = run(model, prompt, follow, "module")
    got, s_got, forms = run(model, prompt, follow, "native", threads=threads)
    d = (ref - got).abs().max().item()
    n = s_ref.slots   # the slots written (a CPU cache's others are unwritten memory)
    dk = max((s_ref.k[..., :n, :] - s_got.k[..., :n, :]).abs().max().item(),
             (s_ref.v[..., :n, :] - s_got.v[..., :n, :]).abs().max().item())
    print(f"{case}: max |logit diff| {d:.2e}, max |cache diff| {dk:.2e}")
    assert d <= 1e-4 and dk <= 1e-5
    assert s_got.slots == s_ref.slots == 25 and int(s_got.lengths) == 25
    assert forms == {"native"}, "the native step did not run"


def test_native_greedy_tokens_equal_module():
    model = tiny_model(num_key_value_heads=2)
    outs = {}
    for backend in ("module", "native"):
        step, state = Stepper(model, backend, threads=2), model.init_state(1, 60)
        tok, ids = torch.tensor([[1, 5, 9]]), []
        for _ in range(50):
            tok = step(tok, state)[:, -1:].argmax(-1)
            ids.append(int(tok))
        outs[backend] = ids
    assert outs["module"] == outs["native"]


@pytest.mark.parametrize("fmap", ["elu1", "relu", "softmax", "cos1"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["MHA", "GQA"])
def test_native_linear_step_equals_module_step(fmap, kv_heads):
    model = tiny_model(num_key_value_heads=kv_heads)
    prompt, follow = tokens(2)
    ref, s_ref, _ = run(model, prompt, follow, "module", attention="linear", fmap=fmap)
    got, s_got, forms = run(model, prompt, follow, "native", attention="linear", fmap=fmap, threads=2)
    d = (ref - got).abs().max().item()
    dS = (s_ref.S - s_got.S).abs().max().item() / s_ref.S.abs().max().item()
    dz = (s_ref.z - s_got.z).abs().max().item() / s_ref.z.abs().max().item()
    print(f"{fmap}: max |logit diff| {d:.2e}, relative S {dS:.2e}, z {dz:.2e}")
    assert d <= 1e-4 and dS <= 1e-5 and dz <= 1e-5
    assert forms == {"native"}, "the native step did not run"


@pytest.mark.parametrize("attention", ["softmax", "linear"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_batched_native_equals_batched_torch_and_module(attention, padded, threads=2):
    """B = 5 (a tile of 4 and a remainder): native == torch == module; left pads: rows 1..4 carry
    1, 3, 0, 4 pads, so rotary positions and masked slots differ per row."""
    model = tiny_model(num_key_value_heads=2)
    B = 5
    prompt, follow = tokens(3, batch=B, prompt=7, follow=12)
    real = None
    if padded:
        real = torch.ones(B, 7, dtype=torch.bool)
        for b, pads in enumerate([0, 1, 3, 0, 4]):
            real[b, :pads] = False
    ref, s_ref, _ = run(model, prompt, follow, "module", attention=attention, batch=B, real=real)
    tor, _, t_forms = run(model, prompt, follow, "torch", attention=attention, batch=B, real=real)
    got, s_got, forms = run(model, prompt, follow, "native", attention=attention, batch=B, real=real,
                            threads=threads)
    d, dt = (ref - got).abs().max().item(), (tor - got).abs().max().item()
    print(f"{attention} padded={padded}: max |native - module| {d:.2e}, |native - torch| {dt:.2e}")
    assert d <= 1e-4 and dt <= 1e-4
    assert forms == {"native"} and t_forms == {"torch"} and s_got.padded == padded
    assert torch.equal(s_got.lengths, s_ref.lengths)
    assert torch.equal(ref.argmax(-1), got.argmax(-1))


def test_padded_rows_equal_each_prompt_alone():
    """PITFALLS #9 for the native step: a left-padded batch row == that prompt run alone."""
    model = tiny_model()
    prompts = [[3, 4, 5, 6, 7], [8, 9]]
    width = max(map(len, prompts))
    batch = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    real = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
    step, state = Stepper(model, "native", threads=2), model.init_state(2, 32)
    tok = step(batch, state, valid=real)[:, -1:].argmax(-1)
    together = [tok]
    for _ in range(12):
        tok = step(tok, state).argmax(-1)
        together.append(tok)
    together = torch.cat(together, 1)
    for b, p in enumerate(prompts):
        step1, s1 = Stepper(model, "native"), model.init_state(1, 32)
        tok = step1(torch.tensor([p]), s1)[:, -1:].argmax(-1)
        alone = [tok]
        for _ in range(12):
            tok = step1(tok, s1).argmax(-1)
            alone.append(tok)
        assert torch.equal(torch.cat(alone, 1)[0], together[b])


def test_results_do_not_depend_on_threads():
    """Every row is summed in one fixed order whoever computes it: 1, 2 and 5 threads (more than the
    cores, so chunks get stolen from descheduled workers) give bit-identical logits."""
    model = tiny_model(hidden_size=128, intermediate_size=256)
    prompt, follow = tokens(4, batch=3, follow=30)
    outs = [run(model, prompt, follow, "native", batch=3, threads=t)[0] for t in (1, 2, 5)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def upcast_pair(dtype, **cfg):
    low = tiny_model(dtype=dtype, **cfg)
    return low, tiny_model(dtype=dtype, **cfg).float()     # the same values, in fp32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_16bit_weights_equal_fp32_on_the_same_values(dtype, attention):
    """The native step reads 16-bit weights and computes in fp32: with an fp32 state it equals the
    module path of the fp32 model holding the same (upcast) values, to fp32 tolerance."""
    low, high = upcast_pair(dtype, num_key_value_heads=2)
    prompt, follow = tokens(5)
    step_ref, step_low = Stepper(high, "module"), Stepper(low, "native", threads=2)
    s_ref = high.init_state(1, 64, attention)
    s_low = low.init_state(1, 64, attention, dtype=torch.float32)
    step_ref(prompt, s_ref)
    for a, b in zip(s_low.tensors(), s_ref.tensors()):   # one prefill (fp32) for both
        a.copy_(b)
    s_low.slots, s_low.lengths = s_ref.slots, s_ref.lengths.clone()
    ref = torch.cat([step_ref(t.view(1, 1), s_ref) for t in follow[0]], 1)
    got = torch.cat([step_low(t.view(1, 1), s_low) for t in follow[0]], 1)
    d = (ref - got).abs().max().item()
    print(f"{dtype} {attention}: max |logit diff| {d:.2e}")
    assert d <= 1e-4 and step_low.last_form == "native"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_16bit_model_takes_the_native_step_with_its_own_cache(dtype):
    """An f16/bf16 model with its own 16-bit KV cache runs natively; against the module path of the
    same model (which computes in 16 bits) logits agree to 16-bit rounding: 3e-2 for bf16 (8-bit
    mantissa), 5e-3 for f16, on logits of magnitude ~1, and the cache matches to one rounding."""
    model = tiny_model(dtype=dtype)
    prompt, follow = tokens(6, follow=20)
    ref, s_ref, _ = run(model, prompt, follow, "module")
    got, s_got, forms = run(model, prompt, follow, "native", threads=2)
    d = (ref.float() - got.float()).abs().max().item()
    n = s_ref.slots   # the slots written (a CPU cache's others are unwritten memory)
    k_ref, k_got = s_ref.k[..., :n, :].float(), s_got.k[..., :n, :].float()
    dk = (k_ref - k_got).abs().max().item() / k_ref.abs().max().item()
    print(f"{dtype}: max |logit diff| {d:.2e}, relative cache diff {dk:.2e}")
    assert forms == {"native"} and got.dtype == torch.float32 and s_got.k.dtype == dtype
    assert d <= (3e-2 if dtype == torch.bfloat16 else 5e-3) and dk <= (2e-2 if dtype == torch.bfloat16 else 3e-3)


def test_fallback_reason_is_kept():
    model = tiny_model(dtype=torch.float64)
    step = Stepper(model, "auto")
    state = model.init_state(1, 8)
    step(torch.tensor([[1, 2]]), state)
    step(torch.tensor([[3]]), state)
    assert step.last_form == "torch" and "float64" in step.fallback


def test_native_step_past_the_cache_raises():
    model = tiny_model()
    step = Stepper(model, "native")
    state = model.init_state(1, 4, "softmax")
    step(torch.tensor([[1, 2, 3]]), state)
    step(torch.tensor([[4]]), state)
    assert step.last_form == "native"
    with pytest.raises(ContextFullError):
        step(torch.tensor([[5]]), state)
    assert state.slots == 4


@pytest.mark.parametrize("attention", ["linear", "softmax"])
def test_native_step_after_storage_is_replaced(attention):
    """PITFALLS #20: model.half().float() frees the weights' storage and allocates new; a native plan
    still holding the old pointers reads freed memory (NaN logits). Every step re-checks them."""
    model = tiny_model(num_key_value_heads=2)
    native = NativeStep(model, threads=2)
    state = model.init_state(1, 16, attention)
    model.step(torch.tensor([[1, 2, 3, 4, 5]]), state)
    for t in (6, 7, 8):
        native(torch.tensor([[t]]), state)
    model.half().float()
    junk = [torch.full((n,), 1e30) for n in (97 * 64, 64 * 96 * 2, 64 * 64 * 3)]   # reuse freed memory
    fresh = model.init_state(1, 16, attention)
    for a, b in zip(fresh.tensors(), state.tensors()):
        a.copy_(b)
    fresh.slots, fresh.lengths = state.slots, state.lengths.clone()
    got = native(torch.tensor([[9]]), state)
    want = model.step(torch.tensor([[9]]), fresh)
    del junk
    d = (got - want).abs().max().item()
    print(f"{attention}: max |logit diff| after half().float() {d:.2e}")
    assert torch.isfinite(got).all() and d <= 1e-4


def _exact16_model():
    """fp32 weights: layer 0's exactly f16 values, layer 1's down_proj exactly bf16 (not f16: beyond
    its range), the rest plain fp32."""
    model = tiny_model(num_key_value_heads=2)
    with torch.no_grad():
        for p in model.layers[0].parameters():
            p.copy_(p.half().float())
        w = model.layers[1].mlp.down_proj.weight
        w.copy_(w.bfloat16().float() * 2.0 ** 20)
    return model


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_exact16_weights_run_from_16_bit_copies_bit_identically(attention):
    """fp32 weights holding only 16-bit values run from f16 / bf16 copies (half the bytes): the
    logits are bit-identical to reading the fp32 tensors, batched and padded; other weights stay fp32."""
    import engine.steps.native as nat
    from tests.conftest import prompt_and_follow
    model = _exact16_model()
    prompt, real, follow = prompt_and_follow(5, padded=True)
    got = {}
    for flag in (True, False):
        nat.EXACT16 = flag
        try:
            step = Stepper(model, "native", threads=2)
            state = model.init_state(3, 32, attention)
            got[flag] = [step(prompt, state, valid=real)[:, -1]]
            for t in follow.T:
                got[flag].append(step(t[:, None], state)[:, -1])
            assert step.last_form == "native"
            plan = step.forms[0].plans[state]
            types = [plan.tables["qkv"][0].type, plan.tables["wd"][1].type, plan.tables["qkv"][1].type]
            assert types == ([1, 2, 0] if flag else [0, 0, 0]), types   # f16, bf16, fp32 (gen.h codes)
        finally:
            nat.EXACT16 = True
    assert torch.equal(torch.stack(got[True]), torch.stack(got[False]))
    assert set(nat.weights_read(model).split("+")) == {"float32", "float16", "bfloat16"}   # what gen bench records


def test_exact16_copy_follows_a_weight_changed_in_place():
    """A weight edited in place (same storage, same pointer) moves its version: the plan drops the
    stale 16-bit copy and the next step reads the new values."""
    model = _exact16_model()
    step = Stepper(model, "native", threads=2)
    state, ref = model.init_state(1, 16), model.init_state(1, 16)
    prompt = torch.tensor([[1, 2, 3, 4]])
    step(prompt, state)
    model.step(prompt, ref)
    step(torch.tensor([[6]]), state)          # the plan and its copies exist before the edit
    model.step(torch.tensor([[6]]), ref)
    assert step.last_form == "native"
    with torch.no_grad():
        model.layers[0].mlp.down_proj.weight.mul_(-2.0)   # still exactly f16
    got, want = step(torch.tensor([[5]]), state), model.step(torch.tensor([[5]]), ref)
    assert step.last_form == "native"
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_quantized_plan_runs_regrouped_blocks(kind):
    """Where the build has the grouped kernels, a q4_1 / q8_0 model's plan reads regrouped copies
    (gen.h T_Q4_1R / T_Q8_0R; tests/test_quant.py holds them to linear_q8) and decodes the same
    greedy tokens as the per-block kernels."""
    import engine.steps.native as nat
    model = tiny_model(num_key_value_heads=2, hidden_size=160, intermediate_size=288)   # 5 and 9 blocks a row
    quantize_model(model, kind)
    ids, types = {}, {}
    for flag in (True, False):
        nat.REGROUP = flag
        try:
            step = Stepper(model, "native", threads=2)
            state = model.init_state(2, 40)
            logits = step(torch.tensor([[1, 5, 9, 2], [7, 3, 3, 8]]), state)[:, -1]
            ids[flag] = [logits.argmax(-1)]
            for _ in range(12):
                ids[flag].append(step(ids[flag][-1][:, None], state)[:, -1].argmax(-1))
            plan = step.forms[0].plans[state]
            types[flag] = {plan.tables[n][0].type for n in ("qkv", "wo", "gu", "wd")}
        finally:
            nat.REGROUP = True
    grouped = {"q4_1": 6, "q8_0": 7}[kind] if step.forms[0].library.gen_has_q4_1r() else {"q4_1": 5, "q8_0": 3}[kind]
    assert types == {True: {grouped}, False: {{"q4_1": 5, "q8_0": 3}[kind]}}
    assert torch.equal(torch.stack(ids[True]), torch.stack(ids[False]))


def test_bench_records_weights_batch_and_form(small_model_dir):
    from engine.bench.sweep import BenchSettings, run_in_process
    from engine.loader import load_model
    settings = BenchSettings(model=str(small_model_dir), contexts=(8,), attentions=("softmax",), steps=3, warmup=1,
                             isolate=False, weights="q8_0", batch=3, backend="native")
    model, _ = load_model(settings.model, dtype=settings.dtype)
    quantize_model(model, settings.quantize)
    rec = run_in_process(model, settings, "softmax", 8)
    assert rec["weights"] == "q8_0" and rec["batch"] == 3 and rec["step_form"] == "native"


def test_default_threads_native_on_every_core_torch_on_one():
    """By default the native pool (no barriers, steals late chunks) uses every core and PyTorch's
    OpenMP pool one thread (it collapses when a core is taken); an explicit count sets both."""
    from engine.threads import available_cores, current_threads, set_threads
    before = torch.get_num_threads()
    try:
        assert set_threads(None) == available_cores() == current_threads() and torch.get_num_threads() == 1
        assert set_threads(3) == 3 and torch.get_num_threads() == 3
        assert current_threads() == available_cores()   # no module-global count: a run's is RunSpec.threads
    finally:
        torch.set_num_threads(before)


def test_bench_labels_the_weights_a_model_holds(small_model_dir):
    """Without --weights the record names what the matrices hold (a GGUF's blocks are not "float32")."""
    from engine.bench.sweep import BenchSettings, run_in_process
    from engine.loader import load_model
    settings = BenchSettings(model=str(small_model_dir), contexts=(8,), attentions=("linear",), steps=2, warmup=1,
                             isolate=False, backend="torch")
    model, _ = load_model(settings.model, dtype=settings.dtype)
    assert run_in_process(model, settings, "linear", 8)["weights"] == "float32"
    quantize_model(model, "q4_1")
    head = model.lm_head                                 # a Q8_0 lm_head beside Q4_1 matrices, as SmolLM2's GGUF
    model.lm_head = QuantLinear(quantize(head.weight, "q8_0"), "q8_0", head.in_features, head.out_features)
    rec = run_in_process(model, settings, "linear", 8)
    assert rec["weights"] == rec["weights_stored"] == "q4_1+q8_0"


def expanded_to_mha(model):
    """The same model with each KV head repeated for its group's query heads (k/v rows of qkv
    copied): multi-head attention that computes exactly what the GQA model does."""
    cfg = model.config
    H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    mha = tiny_model(num_attention_heads=H, num_key_value_heads=H, head_dim=D, dtype=model.embed_tokens.weight.dtype)
    state = model.state_dict()
    heads = torch.arange(H) // (H // Hkv)   # the KV head of each query head
    for name, w in state.items():
        if name.endswith("self_attn.qkv.weight"):
            q, k, v = w.split([H * D, Hkv * D, Hkv * D])
            k, v = (t.view(Hkv, D, -1)[heads].reshape(H * D, -1) for t in (k, v))
            state[name] = torch.cat([q, k, v])
    mha.load_state_dict(state)
    return mha


@pytest.mark.parametrize("cache", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("head_dim", [16, 12], ids=["D16", "D12"])
@pytest.mark.parametrize("kv_heads", [1, 2], ids=["G4", "G2"])
def test_gqa_groups_read_once_equal_repeated_heads(cache, head_dim, kv_heads):
    """Softmax attention runs by KV group (each cached row read once for the group's query heads):
    B = 3 left-padded rows, fp32/f16/bf16 models with their own caches, head_dim on the vector path
    (16) and off it (12), against the same model with its KV heads repeated (one query head per KV
    head: the per-head path), and in fp32 against the module path too."""
    model = tiny_model(num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=head_dim, dtype=cache)
    B = 3
    prompt, follow = tokens(8, batch=B, prompt=6, follow=40)
    real = torch.ones(B, 6, dtype=torch.bool)
    real[1, :2] = False
    got, _, forms = run(model, prompt, follow, "native", batch=B, real=real, state_dtype=cache, threads=2)
    mha, _, _ = run(expanded_to_mha(model), prompt, follow, "native", batch=B, real=real, state_dtype=cache,
                    threads=2)
    d = (mha - got).abs().max().item()
    print(f"G={4 // kv_heads} D={head_dim} {cache}: max |GQA - repeated heads| {d:.2e}")
    assert forms == {"native"} and d <= 1e-5
    if cache == torch.float32:
        ref, _, _ = run(model, prompt, follow, "module", batch=B, real=real)
        assert (ref - got).abs().max().item() <= 1e-4


@pytest.mark.parametrize("bad", [-1, 97])
def test_a_token_outside_the_vocabulary_is_refused_before_the_step(native_built, bad):
    """The native step checks ids itself (C would read outside the embedding): one IndexError naming
    the id, and the state does not move."""
    model = tiny_model()
    step, state = Stepper(model, "native"), model.init_state(2, 16)
    step(torch.tensor([[1, 2], [3, 4]]), state, last_only=True)
    with pytest.raises(IndexError, match=f"token id {bad} outside the vocabulary \\(0..96\\)"):
        step(torch.tensor([[5], [bad]]), state)
    assert state.slots == 2


def test_the_plan_keeps_its_rotary_rows_when_the_model_rebuilds_its_table(native_built):
    """The native plan reads fp32 rotary rows it holds; the module path of an f16 model rebuilds the
    model's table in f16 between native steps: the native logits still equal the module path's."""
    model = tiny_model(dtype=torch.float16)
    prompt, follow = tokens(3, prompt=5, follow=6)
    want, _, _ = run(model, prompt, follow, "module")
    step, state = Stepper(model, "native"), model.init_state(1, 64)
    got = [step(prompt, state)[:, -1:]]
    for t in follow.T:
        model.rotary.table(8, torch.device("cpu"), torch.float16)   # the table swapped for an f16 one
        got.append(step(t.reshape(1, 1), state))
        assert step.last_form == "native"
    assert (torch.cat(got, 1).float() - want.float()).abs().max().item() <= 1e-2
