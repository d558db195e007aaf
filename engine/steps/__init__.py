"""The forms of the one-token decode step, side by side behind one protocol; the caller picks one.

    step = make_step(model, backend="auto", threads=None)   # "auto" | "torch" | "native" | "module" | "graph"
    logits = step(tokens, state)          # (B, T) -> (B, T, V); prompt blocks run model.step
    step.last_form                        # the form that ran the last one-token step
    step.fallback                         # why a faster form did not run it (None: it did)
                                          # ("graph: ...; native: ...": each form that refused, in order)

Forms, each held to the module reference by tests:
  module  `Transformer.step` itself: nn.Module calls per layer, the reference every form equals
  torch   `engine.steps.torch_step`: the same arithmetic with the per-token overheads removed
  native  `engine.steps.native`: the step in C, on the model's own weights and the state's tensors
  graph   `engine.steps.graph_step`: the torch form's arithmetic captured as a CUDA graph and replayed

A form is any object with `name`, `why_not(state, tokens) -> str | None` (None: it can run this
step) and `__call__(tokens, state) -> logits (B, 1, V)`. It owns whatever it caches (plans, raw
pointers) and re-checks it before every step; nothing is hung on the model or the state.

Backends: "torch" runs the torch form; "native" the native form where it applies and torch where
it does not (the reason is kept in `fallback`), and it raises if the C step cannot be built;
"auto" (the default) is "native" that falls back to torch when the C step cannot be built
either, with the graph form first on a CUDA model (the C step runs on the CPU only); "graph" runs the
graph form where it applies (CUDA) and torch elsewhere; "compiled" is "graph" with the step compiled by
torch.compile before its capture (fused kernels; the first step of each shape pays the compile); "module" runs the reference for every step.
"""
from __future__ import annotations

from typing import Protocol

import torch

from engine.runspec import (BACKENDS, DEFAULT_ACTIVATIONS, DEFAULT_PREFILL_CHUNK, MODULE_PREFILL_CHUNK,  # noqa: F401
                            NATIVE_PREFILL_CHUNK, check_backend, check_prefill_chunk)
from engine.steps.graph_step import GraphStep
from engine.steps.native import ACTIVATIONS, NativeStep, NativeUnavailableError, check_activations, pool_rest
from engine.steps.rows_alone import prefill_rows_alone, rows_alone_apply
from engine.steps.torch_step import TorchStep

class StepForm(Protocol):
    name: str

    def why_not(self, state, tokens: torch.Tensor) -> str | None: ...

    def __call__(self, tokens: torch.Tensor, state) -> torch.Tensor: ...


class ModuleStep:
    """The reference: `Transformer.step`, module by module."""
    name = "module"

    def __init__(self, model):
        self.model = model

    def why_not(self, state, tokens):
        return None

    def __call__(self, tokens, state):
        return self.model.step(tokens, state)


class Stepper:
    """What the generation loop calls. Prompt blocks run in chunks of `chunk` tokens (`prefill_chunk`,
    or where that is None NATIVE_PREFILL_CHUNK when the native step prefills this model's blocks,
    MODULE_PREFILL_CHUNK when the module path does: a GPU, fp32 / bf16 weights, --backend torch), each on
    the native pool where it applies, else the module path; a prompt block (last_only) of left-padded
    rows, or of rows the native step will decode that the native pool cannot prefill, runs row by
    row, each row as it runs alone, chunks included (engine.steps.rows_alone); one-token steps run
    the first form of `forms` that applies (the last one always does)."""

    def __init__(self, model, backend: str = "auto", threads: int | None = None,
                 prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK, activations: str = DEFAULT_ACTIVATIONS):
        self.model, self.backend = model, check_backend(backend)
        self.prefill_chunk = check_prefill_chunk(prefill_chunk)   # as given (None: the path's default)
        self.activations = check_activations(activations)
        self.forms: list[StepForm] = []
        self.fallback: str | None = None
        torch_form = TorchStep(model)
        if backend in ("graph", "compiled") or (backend == "auto" and model.embed_tokens.weight.device.type == "cuda"):
            self.forms.append(GraphStep(model, torch_form, compile=backend == "compiled"))   # shares the torch form's plan
        if backend in ("auto", "native"):
            try:
                self.forms.append(NativeStep(model, threads=threads, activations=activations))
            except NativeUnavailableError as e:
                if backend == "native":
                    raise
                self.fallback = str(e)
        self._built_fallback = self.fallback   # why the native form could not be built (kept while the first form runs)
        if backend == "module":
            self.forms.append(ModuleStep(model))
        else:
            self.forms.append(torch_form)
        self.last_form: str | None = None
        self.last_prefill_form: str | None = None   # the form that ran the last prompt block
        # tokens a prompt block runs at a time (0: whole prompts), the same for every caller (the generation
        # loop's progress blocks and the server's pieces are cut at its multiples)
        if self.prefill_chunk is not None:
            self.chunk = self.prefill_chunk
        else:
            natively = any(f.name == "native" and model.embed_tokens.weight.device.type == "cpu"
                           and (backend == "native" or f.prefills_fastest()) for f in self.forms)
            self.chunk = NATIVE_PREFILL_CHUNK if natively else MODULE_PREFILL_CHUNK

    def rest(self) -> None:
        """The caller steps away for a while (a server delivering a step's tokens): after a native
        step its pool's idle workers sleep now instead of spinning for the next phase
        (engine.steps.native.pool_rest)."""
        if self.last_form == "native":
            pool_rest()

    def release(self, state) -> None:
        """Drop what the step forms keep for `state` (the native form's plan: its scratch and thread
        buffers, ~4.5 MB on SmolLM2), for a state that is only read from now on (a prompt's state in
        the server's prefix cache: 64 of them held ~290 MB of plans)."""
        for form in self.forms:
            plans = getattr(form, "plans", None)
            if plans is not None:
                plans.pop(state, None)

    def prepare(self, make_state) -> None:
        """Make now what the step forms make once on their first call (the native form: its quantized
        matrices' regrouped copies, ~0.2 s on SmolLM2's GGUF), so that the first prompt's prefill time is
        the prefill's own. make_state(): a one-slot state of the run, made only where a form has work."""
        for form in self.forms:
            prepare = getattr(form, "prepare", None)
            if prepare is not None:
                prepare(make_state)

    @property
    def forms_available(self) -> list[str]:
        return [f.name for f in self.forms]

    def _native_decodes(self, state, tokens) -> bool:
        return any(f.name == "native" and f.why_not(state, tokens[:, :1]) is None for f in self.forms)

    def _native_prefill(self, state, tokens):
        """The form that prefills this unpadded block natively (auto: where it is the faster form), or None."""
        for form in self.forms:
            if hasattr(form, "prefill") and form.why_not_prefill(state, tokens, self.backend == "auto") is None:
                return form
        return None

    def __call__(self, tokens: torch.Tensor, state, valid: torch.Tensor | None = None,
                 last_only: bool = False) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, V), or (B, 1, V) with last_only (a prompt block: it runs in
        chunks of `chunk` tokens from each row's first real token; the logits are the last chunk's)."""
        if valid is None and tokens.dim() == 2 and tokens.shape[1] == 1:
            return self._one_token(tokens, state)
        if last_only and tokens.dim() == 2:   # a prompt block
            if valid is not None and bool(valid.all()):
                valid = None
            # Left-padded rows, and rows the native step decodes next (its q8 rounding turns the last
            # bits a batched PyTorch prefill moves into steps), run one at a time, as each runs alone.
            if (not (valid is None and self._native_prefill(state, tokens)) and rows_alone_apply(tokens, state, valid)
                    and (valid is not None or self._native_decodes(state, tokens))):
                return prefill_rows_alone(lambda t, s: self(t, s, last_only=True), tokens, state, valid)
            chunk = self.chunk or tokens.shape[1]
            for s in range(0, tokens.shape[1], chunk):
                logits = self._block(tokens[:, s:s + chunk], state, None if valid is None else valid[:, s:s + chunk])
            return logits
        self.last_form = "module"
        self.last_prefill_form = "module"
        return self.model.step(tokens, state, valid=valid, last_only=last_only)

    def pieces(self, tokens: torch.Tensor, state, logits: bool = True):
        """A prompt block (B, T) without pads, `self(tokens, state, last_only=True)` in pieces: a
        generator that yields after each piece of work and returns the same logits (StopIteration.value),
        bit for bit. The native form's chunks and the module path's run a layer a piece. Between
        pieces the state is open: nothing else may step it. The server feeds a long prompt this way, a
        few pieces between decode steps (engine.serve.scheduler). logits=False: a block that is not
        the prompt's last; the native form skips the output layer (the value returned is then None or
        logits nobody should read)."""
        if tokens.shape[0] != 1:   # rows of one block prefill as they run alone: one piece
            logits = self(tokens, state, last_only=True)
            yield
            return logits
        want, out = logits, None
        chunk = self.chunk or tokens.shape[1]
        for s in range(0, tokens.shape[1], chunk):
            block = tokens[:, s:s + chunk]
            form = self._native_prefill(state, block) if block.shape[1] > 1 else None
            if form is not None and hasattr(form, "prefill_pieces"):
                self.last_prefill_form = form.name
                head = want and s + chunk >= tokens.shape[1]   # the call's last chunk, when asked
                out = yield from form.prefill_pieces(block, state, head=head)
            elif form is None and block.shape[1] > 1 and hasattr(self.model, "step_pieces"):
                self.last_form = self.last_prefill_form = "module"   # a layer a piece, as _block's arithmetic
                out = yield from self.model.step_pieces(block, state, last_only=True)
            else:
                out = self._block(block, state, None)
                yield
        return out

    def _one_token(self, tokens: torch.Tensor, state) -> torch.Tensor:
        refused = []
        for form in self.forms:
            reason = form.why_not(state, tokens)
            if reason is None:
                self.last_form = form.name
                self.fallback = "; ".join(refused) if refused else self._built_fallback
                return form(tokens, state)
            refused.append(f"{form.name}: {reason}")
        raise AssertionError("the last step form applies to every state")   # TorchStep / ModuleStep

    def _block(self, tokens: torch.Tensor, state, valid: torch.Tensor | None) -> torch.Tensor:
        """One chunk of a prompt block -> its last logits (B, 1, V)."""
        if valid is None and tokens.shape[1] == 1:
            return self._one_token(tokens, state)
        form = self._native_prefill(state, tokens) if valid is None else None
        if form is not None:
            self.last_prefill_form = form.name
            return form.prefill(tokens, state)
        self.last_form = self.last_prefill_form = "module"
        return self.model.step(tokens, state, valid=valid, last_only=True)


def make_step(model, backend: str = "auto", threads: int | None = None,
              prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK, activations: str = DEFAULT_ACTIVATIONS) -> Stepper:
    return Stepper(model, backend, threads, prefill_chunk, activations)


__all__ = ["BACKENDS", "StepForm", "Stepper", "ModuleStep", "TorchStep", "GraphStep", "NativeStep", "NativeUnavailableError",
           "make_step", "check_backend", "check_prefill_chunk", "DEFAULT_PREFILL_CHUNK", "ACTIVATIONS",
           "DEFAULT_ACTIVATIONS", "check_activations"]
