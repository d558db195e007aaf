"""What keeps a GGUF load's resident memory near its file's size (issue 33; the sizes themselves:
benchmarks/load_memory.py, docs/measurements.md). Each test guards one cut and fails where it is undone:
a load never imports torch._dynamo (triton's library alone was ~55 MB of pages); pages handed back
leave the resident set whoever else maps the file, and no value changes; the native step's regrouped
copies leave the blocks they came from out of RSS; one tokenizers object per tokenizer; the GGUF
header's pages go back after parsing."""
from __future__ import annotations

import mmap
import os
import subprocess
import sys
import threading

import pytest
import torch

from models.pages import PAGE, hand_back, resident_file_bytes

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from chat_fixtures import write_gguf  # noqa: E402
from conftest import tiny_model  # noqa: E402

LINUX = sys.platform.startswith("linux") and os.path.exists("/proc/self/pagemap")
# rows of 160: 5 blocks of 32 (q4_1 / q8_0: the regrouped kernels' shapes)
CFG = dict(hidden_size=160, intermediate_size=288, num_hidden_layers=2, num_attention_heads=5,
           num_key_value_heads=1, vocab_size=12000, max_position_embeddings=64, rope_theta=10000.0)


@pytest.fixture(scope="module")
def q4_1_file(tmp_path_factory):
    """SmolLM2's mix on a random model: Q4_1 matrices, a Q8_0 embedding tied to lm_head."""
    path = tmp_path_factory.mktemp("mem") / "q4_1.gguf"
    kinds = {"token_embd.weight": Q.Q8_0}
    strings = [f"piece {i:05d}" for i in range(20000)]   # a vocabulary-sized header: ~500 kB, many pages
    write_gguf(path, tiny_model(seed=11, tie_word_embeddings=True, **CFG), None,
               qtype_of=lambda name, shape: kinds.get(name, Q.Q4_1), template=None,
               write_tokenizer=lambda w: w.add_array("test.strings", strings))
    return path


def python(code: str) -> str:
    """`code` run by a fresh interpreter with this one's import path: its stdout (it must succeed)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.fixture(scope="module")
def fresh_load(q4_1_file):
    """What one fresh interpreter saw around a load of q4_1_file (one process for the two tests below,
    each reading its own lines): right after the load, whether gguf and sentencepiece are imported;
    after a generation and dequantize_model, the torch._dynamo and triton modules imported; then
    `import sentencepiece`'s class name."""
    code = ("import sys, engine\n"
            "from engine.quant import dequantize_model\n"
            f"llm = engine.load({str(q4_1_file)!r}, threads=1)\n"
            "print('gguf' in sys.modules, 'sentencepiece' in sys.modules)\n"
            "llm.generate([1, 5, 9], max_new_tokens=3, temperature=0)\n"
            "dequantize_model(llm.model)\n"
            "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'triton'))))\n"
            "try:\n"
            "    import sentencepiece\n"
            "    print(sentencepiece.SentencePieceProcessor.__name__)\n"
            "except ImportError as e:\n"
            "    print('ImportError', e)\n")
    return python(code).strip().splitlines()[-3:]


def test_a_load_never_imports_dynamo(fresh_load):
    """nn.Embedding's random init on the meta device ran torch._refs, whose first call imports
    torch._dynamo and triton: a load and a generation (and dequantize_model) must not."""
    assert fresh_load[1] == "[]"


def test_learned_maps_made_on_the_meta_device_never_import_dynamo():
    """Hedgehog's identity maps made under a load's meta device (engine.loader.build) ran torch.eye
    through torch._refs, importing torch._dynamo (~1.1 s of every load of smollm2-linear); they are
    identities still."""
    code = ("import sys, torch\n"
            "from engine.attention.feature_maps import Hedgehog\n"
            "with torch.device('meta'):\n"
            "    Hedgehog(2, 4, 2, 8, decay=True)\n"
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))\n"
            "fm = Hedgehog(2, 3, 1, 4)\n"
            "print(all(torch.equal(w, torch.eye(4).expand_as(w)) for w in (fm.q_weight, fm.k_weight)), "
            "tuple(fm.q_weight.shape), tuple(fm.k_weight.shape))\n")
    assert python(code).strip().splitlines()[-2:] == ["[]", "True (2, 3, 4, 4) (2, 1, 4, 4)"]


def test_a_gguf_load_leaves_sentencepiece_out_and_importable(fresh_load):
    """The gguf package's __init__ imports sentencepiece for its vocabulary converters (~1.3 MB that
    reading a file never runs): a load imports the package without it, and `import sentencepiece`
    afterwards works as ever."""
    pytest.importorskip("sentencepiece", reason="sentencepiece is not installed")
    assert fresh_load[0].split() + fresh_load[2:] == ["True", "False", "SentencePieceProcessor"]


def test_leaving_sentencepiece_out_of_the_gguf_import_is_the_importing_threads_alone():
    """While gguf is imported without sentencepiece, another thread's `import sentencepiece` (or
    find_spec) goes on as usual (a None in sys.modules failed it: "import halted"); only the importing
    thread's fails, and after it nothing is left out."""
    pytest.importorskip("sentencepiece", reason="sentencepiece is not installed")
    code = ("import importlib, importlib.util, sys, threading\n"
            "from models.gguf import _LeftOut\n"
            "left = _LeftOut('sentencepiece')\n"
            "sys.meta_path.insert(0, left)\n"
            "try:\n"
            "    import sentencepiece\n"
            "    print('here: imported')\n"
            "except ImportError:\n"
            "    print('here: left out')\n"
            "got = []\n"
            "t = threading.Thread(target=lambda: got.append((importlib.util.find_spec('sentencepiece') is not None,\n"
            "                                                 importlib.import_module('sentencepiece').__name__)))\n"
            "t.start(); t.join()\n"
            "print('other:', *got[0])\n"
            "sys.meta_path.remove(left)\n")
    assert python(code).splitlines() == ["here: left out", "other: True sentencepiece"]


def mapped_twice(path):
    """Two private maps of one file in this process (as a second process mapping it would hold its
    pages: MADV_PAGEOUT skips pages mapped more than once) and a uint8 tensor on the first."""
    f = open(path, "rb")
    maps = [mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE) for _ in range(2)]
    f.close()
    return maps, [torch.frombuffer(m, dtype=torch.uint8) for m in maps]


@pytest.mark.skipif(not LINUX, reason="page residency is read from Linux's /proc/self/pagemap")
def test_hand_back_drops_file_pages_and_keeps_every_value(tmp_path):
    path = tmp_path / "pages.bin"
    data = torch.randint(0, 256, (64 * PAGE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    path.write_bytes(data.numpy().tobytes())
    maps, (t, other) = mapped_twice(path)
    assert int(t.sum()) == int(other.sum()) == int(data.sum())      # both maps' pages resident
    t[5 * PAGE + 7] = t[5 * PAGE + 7] ^ 0xFF                          # one written page: anonymous now
    written = t.clone()
    assert resident_file_bytes(t.data_ptr(), t.numel()) == 63 * PAGE
    assert hand_back(t.data_ptr(), t.numel())
    assert resident_file_bytes(t.data_ptr(), t.numel()) == 0         # dropped though the other map holds them
    assert torch.equal(t, written)                                    # the file's pages fault back; the written one stayed
    assert torch.equal(other, data)
    del t, other
    for m in maps:
        m.close()


@pytest.mark.skipif(not LINUX, reason="page residency is read from Linux's /proc/self/pagemap")
def test_hand_back_around_a_tensor_smaller_than_a_page(tmp_path):
    """A norm's 2 KB (a copy made from the map, models.gguf SMALL_FLOATS) holds no whole page, but
    reading it faulted the file pages around it in: `around` drops those; a written page stays."""
    from models.pages import FAULT_AROUND
    path = tmp_path / "pages.bin"
    data = torch.randint(0, 256, (64 * PAGE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    path.write_bytes(data.numpy().tobytes())
    maps, (t, other) = mapped_twice(path)
    at = 32 * PAGE + 100
    t[at - 3 * PAGE] = t[at - 3 * PAGE] ^ 0xFF                       # a written neighbour: anonymous
    written = t.clone()
    near = t.data_ptr() + at - FAULT_AROUND, 2 * FAULT_AROUND
    assert resident_file_bytes(*near) > 0
    assert not hand_back(t.data_ptr() + at, 2304)                     # no whole page inside
    assert hand_back(t.data_ptr() + at, 2304, around=FAULT_AROUND)
    assert resident_file_bytes(*near) == 0 and torch.equal(t, written) and torch.equal(other, data)
    del t, other
    for m in maps:
        m.close()


@pytest.mark.skipif(not LINUX, reason="page residency is read from Linux's /proc/self/pagemap")
def test_native_regrouped_copies_hand_back_their_blocks(q4_1_file, native_built):
    """Once the native step has regrouped a matrix (its grouped q8 kernels), the blocks it was made
    from, views of the file's map (o, down, gate_up: one view of gate and up; the tied lm_head's
    embedding blocks), leave the resident set; the values stay the file's. The embedding's lookups read
    the head's regrouped rows, so tokens from all over the vocabulary fault none of the table back in
    (they did: ~30 MB of SmolLM2's after a 2,000-token prompt), and the norms are copies, so nothing
    reads the map each token: none of the file is resident afterwards, not even the pages around
    what was copied (a read maps the 64 KB around it)."""
    from engine.api import load
    from engine.steps.native.abi import bind
    if not bind().gen_has_q4_1r():
        pytest.skip("this build has no grouped q4_1 / q8_0 kernels (they need AVX-512 VNNI)")
    llm = load(str(q4_1_file), threads=1)   # (the load makes the copies: nothing of the map is read here)
    model = llm.model
    views = [b.mlp.gate_up.blocks for b in model.layers] + [b.mlp.down_proj.blocks for b in model.layers] + \
        [b.self_attn.o_proj.blocks for b in model.layers]
    head = model.lm_head.blocks
    assert head.data_ptr() == model.embed_tokens.blocks.data_ptr()
    prompt = [1] + list(range(5, CFG["vocab_size"], 257))   # rows from all over the table
    ids = llm.generate(prompt, max_new_tokens=3, temperature=0).ids
    maps = [line.split() for line in open("/proc/self/maps") if line.rstrip().endswith(q4_1_file.name)]
    spans = [(*(int(x, 16) for x in m[0].split("-")), int(m[2], 16)) for m in maps]   # (lo, hi, file offset)
    assert spans and sum(resident_file_bytes(lo, hi - lo) for lo, hi, _ in spans) == 0   # (before any read here)
    data = q4_1_file.read_bytes()   # the file's bytes, read without a map

    def stored(t):   # what the file holds where `t` maps it
        lo, _, offset = next(s for s in spans if s[0] <= t.data_ptr() < s[1])
        at = t.data_ptr() - lo + offset
        return torch.frombuffer(bytearray(data[at:at + t.numel()]), dtype=torch.uint8).view(t.shape)
    assert all(torch.equal(v, stored(v)) for v in views) and torch.equal(head, stored(head))
    assert llm.generate(prompt, max_new_tokens=3, temperature=0).ids == ids


def test_one_tokenizers_object_reads_special_tokens_either_way():
    """A BPE tokenizer holds one tokenizers.Tokenizer (not a second copy for plain text), and
    `special` still decides, per call, even from threads at once."""
    pytest.importorskip("tokenizers", reason="the tokenizers package is not installed")
    import tokenizers
    from models.bpe import BPETokenizer
    tokens = ["<|im_end|>", *"<|>_imend", "a", "b", "ab"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.token_type": [3] + [1] * (len(tokens) - 1)}
    tok = BPETokenizer.from_gguf(meta, "test")
    held = [v for v in vars(tok).values() if isinstance(v, tokenizers.Tokenizer)]
    assert len(held) == 1
    special, plain = tok.encode("ab<|im_end|>", special=True), tok.encode("ab<|im_end|>")
    assert special == [len(tokens) - 1, 0] and 0 not in plain and len(plain) > 2
    results = []

    def many(flag):
        results.extend((flag, tok.encode("ab<|im_end|>", special=flag)) for _ in range(200))
    threads = [threading.Thread(target=many, args=(flag,)) for flag in (True, False, True, False)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(results) == 800 and all(ids == (special if flag else plain) for flag, ids in results)


@pytest.mark.skipif(not LINUX, reason="page residency is read from Linux's /proc/self/pagemap")
def test_the_header_pages_go_back_after_parsing(q4_1_file):
    """The metadata (a 49k-token vocabulary is ~1.8 MB of pages) is parsed into Python values once;
    its pages of the map are handed back."""
    from models.gguf import read_gguf
    _, tensors, _ = read_gguf(q4_1_file)
    first = min(t.data_offset for t in tensors._tensors.values())
    base = tensors.reader.data.ctypes.data
    assert first > 50 * PAGE and resident_file_bytes(base, first) == 0


def test_a_load_and_a_plan_that_made_copies_trim_the_heap(q4_1_file, native_built, monkeypatch):
    """What a load freed (metadata, the tokenizer's build) and the scratch of the native step's
    copies go back to the kernel once each (glibc's malloc_trim); a plan that made no copy does not trim.
    The copies are made by the load (its run's one-token state), not in the first prompt's prefill."""
    import platform

    import engine.api
    import engine.steps.native.step
    from models.pages import trim_heap
    assert trim_heap() is (platform.libc_ver()[0] == "glibc")
    calls = []
    monkeypatch.setattr(engine.api, "trim_heap", lambda: calls.append("load"))
    monkeypatch.setattr(engine.steps.native.step, "trim_heap", lambda: calls.append("plan"))
    llm = engine.api.load(str(q4_1_file), threads=1)
    step = next(f for f in llm.step.forms if f.name == "native")
    made = ["plan"] if step.weights.made else []   # (no copies where the build lacks the grouped kernels)
    assert step.weights.made == 0 or step.weights.made >= 4   # per layer o, gate_up, down; the head
    assert calls == ["load", *made]
    copies = step.weights.made
    llm.generate([1, 5, 9], max_new_tokens=2, temperature=0)   # the first prompt: the copies exist
    assert calls == ["load", *made] and step.weights.made == copies
    llm.generate([1, 5, 9], max_new_tokens=2, temperature=0)
    assert calls == ["load", *made] and step.weights.made == copies


def test_a_load_whose_native_plan_cannot_be_made_still_loads(q4_1_file, native_built, monkeypatch):
    """The copies made at load come from a native plan; weights a plan cannot read (NativeUnavailableError)
    leave the load as it was before copies were made there (a run that only scores never meets it).
    Float weights make no copies at load (their 16-bit copies would add memory a run that never
    decodes natively holds)."""
    import engine.api
    from engine.steps.native import NativeUnavailableError
    from engine.steps.native.step import NativeStep

    def refuse(self, state):
        raise NativeUnavailableError("the native step needs contiguous CPU weights (test)")
    with monkeypatch.context() as patch:
        patch.setattr(NativeStep, "_plan", refuse)
        llm = engine.api.load(str(q4_1_file), threads=1)
        step = next(f for f in llm.step.forms if f.name == "native")
        assert step.weights.made == 0 and not step.plans
    tiny = engine.api.load("tiny", threads=1)
    assert next(f for f in tiny.step.forms if f.name == "native").weights.made == 0


def test_a_prompt_plan_hands_its_scratch_back_when_it_dies(q4_1_file, native_built, monkeypatch):
    """A plan that read a prompt block (its prompt plan: per thread rows x the widest output, the
    vocabulary) trims the heap when it is freed with its state; a plan that only decoded does not."""
    import gc

    import engine.api
    import engine.steps.native.plan as plan
    calls = []
    monkeypatch.setattr(plan, "trim_heap", lambda **kw: calls.append("trim"))
    llm = engine.api.load(str(q4_1_file), threads=1)
    step = next(f for f in llm.step.forms if f.name == "native")
    state = llm.model.init_state(1, 16)
    step(torch.tensor([[1]]), state)                       # a decode step only: no prompt plan
    calls.clear()                                          # (making the first plan grouped q/k/v: a trim)
    del state
    gc.collect()
    assert calls == []
    llm.generate([1, 5, 9], max_new_tokens=2, temperature=0)
    gc.collect()
    assert calls == ["trim"] and not step.plans
