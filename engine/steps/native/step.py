"""NativeStep: the native step form, one plan per state and the weight copies its plans read."""
from __future__ import annotations

import weakref

import torch

import engine.steps.native as package   # its EXACT16 / REGROUP, read when a step is made (see _switch)
from engine.attention.sparse import SparseWindowState
from engine.quant import QuantLinear
from engine.runspec import check_activations
from engine.steps.native.abi import NativeUnavailableError, bind
from engine.steps.native.cases import state_parts, why_not
from engine.steps.native.plan import PREFILL_ROWS, NativeDecoder
from engine.steps.native.weights import DerivedWeights
from engine.threads import default_threads
from models.pages import trim_heap


def _switch(name: str) -> bool:
    """The package's default for a test switch (engine.steps.native.EXACT16 / REGROUP: older tests
    set them; a constructor option overrides them)."""
    return getattr(package, name)


class NativeStep:
    """The native form: `why_not(state, tokens)`, then `step(tokens, state)` via `__call__`.

    threads: the pool's thread count (the caller's included; RunSpec.threads); None: default_threads().
    activations: what quantized matrices (blocks of any kind) multiply: "f32", the activations as
    they are against the blocks decoded in the dots (PyTorch's arithmetic), "q8", the activations
    rounded to q8 blocks and integer dots (llama.cpp's: ~3x faster here, and a greedy answer can
    flip: PITFALLS 28), or "f32-prompt": prompt blocks in f32, decode steps in q8 (the prompt read as
    PyTorch reads it, the tokens decoded at q8's speed). Float weights are the same either way.
    exact16: fp32 weights holding only 16-bit values run from 16-bit copies (bit-identical, half the
    bytes); regroup: q4_1 / q8_0 blocks run regrouped where the build has the grouped kernels. Both
    on by default (None: the package's EXACT16 / REGROUP); tests turn them off to compare.

    The copies (engine.steps.native.weights.DerivedWeights) belong to this object: `weights`;
    nothing is stored on the model."""
    name = "native"

    def __init__(self, model, threads: int | None = None, activations: str = "f32",
                 exact16: bool | None = None, regroup: bool | None = None):
        self.library = bind()          # raises NativeUnavailableError without a compiler
        self.model, self.threads = model, threads
        self.q8, self.q8_prompt = {"f32": (False, False), "q8": (True, True),
                                   "f32-prompt": (True, False)}[check_activations(activations)]
        self.weights = DerivedWeights(exact16=_switch("EXACT16") if exact16 is None else exact16,
                                      regroup=_switch("REGROUP") if regroup is None else regroup)
        self.plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # state -> NativeDecoder

    def why_not(self, state, tokens) -> str | None:
        plan = self.plans.get(state)
        if plan is not None and plan.epoch == self.model.weights_epoch and tokens.device.type == "cpu":
            return None   # checked when the plan was made; what could change since moves the epoch
        return why_not(self.model, state, tokens)

    def _plan(self, state) -> NativeDecoder:
        threads = self.threads or default_threads()
        plan = self.plans.get(state)
        if plan is None or not plan.still_valid(state, threads):
            made = self.weights.made
            plan = self.plans[state] = NativeDecoder(self.model, state, threads, q8=self.q8, q8_prompt=self.q8_prompt,
                                                     weights=self.weights)
            if self.weights.made != made:
                trim_heap()   # the copies' freed scratch (a model's size, once) goes back to the kernel
        return plan

    def prepare(self, make_state) -> None:
        """The weight copies a plan for the state make_state() returns reads (`weights`), made now (a plan
        for it, dropped with it), for quantized matrices only: their regrouped copies replace the blocks'
        pages (handed back) and cost ~0.2 s on SmolLM2's GGUF. Float weights' 16-bit copies add memory a
        run that never decodes here would hold for nothing, and take milliseconds: made at the first
        step. Weights a plan cannot read are left as they are (the step falls back when it runs)."""
        if not self._quantized():
            return
        state = make_state()
        if self.why_not(state, torch.zeros(state.batch_size, 1, dtype=torch.long, device=state.device)) is None:
            try:
                self._plan(state)
            except NativeUnavailableError:
                pass

    def __call__(self, tokens: torch.Tensor, state) -> torch.Tensor:
        return self._plan(state).step(tokens, state)

    def why_not_prefill(self, state, tokens, fastest: bool = False) -> str | None:
        """None when a prompt block (B, T) without pads can run here (as `why_not`, on a state
        that holds no pads: padded rows sit at their own rotary positions). fastest: only where it
        beats PyTorch's own GEMMs on one thread: f16 weights (measured on tiny, 512 tokens: native
        2.7-4.0k tokens/s vs 1.4k) and quantized ones (PyTorch dequantizes every matrix on every
        call: SmolLM2 Q4_1, native 562 / 731 / 608 tokens/s vs 26 / 136 / 299 for 10 / 64 / 512
        tokens); fp32 MKL and bf16 oneDNN prompt blocks are faster than this step's row dots."""
        if state.padded:
            return "a prompt block on a state with pads runs the module path"
        lin = state_parts(state)[1]
        if getattr(lin, "path", None) == "window" and not isinstance(lin, SparseWindowState) \
                and tokens.shape[1] > PREFILL_ROWS:
            return (f"prompt blocks of window states longer than {PREFILL_ROWS} tokens run the module path (their "
                    f"pad mask moves once a block)")
        if fastest and not self.prefills_fastest():
            return "prompt blocks of fp32 and bf16 weights are faster on PyTorch's GEMMs"
        return self.why_not(state, tokens)

    def prefills_fastest(self) -> bool:
        """Whether this step's prompt blocks beat PyTorch's on these weights (f16 and quantized ones): the
        blocks `auto` hands it (where it runs at all: `why_not`)."""
        return self.model.embed_tokens.weight.dtype == torch.float16 or self._quantized()

    def _quantized(self) -> bool:
        return any(isinstance(m, QuantLinear) for m in self.model.modules())

    def prefill(self, tokens: torch.Tensor, state) -> torch.Tensor:
        """tokens (B, T) -> the last position's logits (B, 1, V), on the thread pool."""
        return self._plan(state).prefill(tokens, state)

    def prefill_pieces(self, tokens: torch.Tensor, state, layers: int = 1, head: bool = True):
        """`prefill` as a generator of pieces of `layers` layers (NativeDecoder.prefill_pieces)."""
        return self._plan(state).prefill_pieces(tokens, state, layers, head)

    def weights_read(self) -> str:
        """What this step reads for the model's matrices (engine.quant.weights_label's names), from
        the copies it holds: "float16" for fp32 weights of f16 values, "q4_1+q8_0" for a GGUF's blocks."""
        return self.weights.weights_read(self.model)
