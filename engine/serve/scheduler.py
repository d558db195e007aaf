"""Continuous batching: one thread runs every decode step; requests join and leave between steps.

    scheduler = Scheduler(model, tokenizer, stepper, max_batch=16)
    scheduler.start()
    job = Job(ids, path="linear", params=SamplingParams(...), max_tokens=64, emit=callback)
    scheduler.submit(job)       # raises Full when every batch row and queue place is taken
    job.cancel()                # the client went away: a queued job leaves the queue at once, a
                                # running one leaves before the next step
    scheduler.withdraw(job)     # True when the job was still queued (it is then out of the queue)
    scheduler.drain()           # shutting down: queued jobs fail (503), submit raises Closed, the
                                # running ones go on; scheduler.busy says whether any is left
    scheduler.stop()            # the loop ends; every job still in it fails (503)

Each attention path has a `Pool`: one batch state holding every active sequence of that path
and the jobs in row order. A loop iteration (1) admits queued jobs: each gets a batch-1 state
(restored from the prefix cache when its prompt extends a cached one; prompts of one path and
length that fit one chunk, arriving together, are prefilled at once as one unpadded batch, then
split); (2) prefills: while sequences decode, prompts advance in pieces (`Stepper.pieces`: a layer
of a chunk of `stepper.chunk` tokens on the native step, the same bits as the whole chunk),
oldest first, for about `prefill_share` decode steps' time (chunked prefill, as vLLM and
llama-server do, sliced finer: the running streams keep flowing whatever the prompt's length; the
chunks start where the stepper's own would, so the tokens equal the API's); with nothing decoding a
prompt runs whole; a prompt done has its first token sampled and its state joined to its pool's
batch (`State.concat`: a KV row is right-aligned, its leading slots pads, never written or read, so
it keeps its own positions); (3) runs one decode step per pool over every row; (4) drops finished
and cancelled rows (`State.select_rows`, which also trims pad slots no kept row needs), except
while a going row holds a long KV cache: finished rows then ride along, decoded and ignored
(`Pool.layout`), until they are as many as the going rows. Prompts being prefilled hold a row's
place: they count against max_batch. Idle, the loop hands the C heap's free pages back once.

A request for n choices is one job with n - 1 `copies`: queued, admitted and cancelled as one
(it takes n rows); its prompt is prefilled once and each copy starts from a copy of that state
(`State.select_rows`), with its own sampler (the server gives choice i the seed + i).

A request's tokens do not depend on what else runs: each job has its own `RowSampler` (its own
seeded torch.Generator; a step samples every row in one pass, engine.sampling.sample_rows), its
prompt's positions are its own, and decode rows never mix (per-row
positions, masked pads; linear rows are independent by construction). An exception in a
step fails that pool's jobs only; the loop goes on.
"""
from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from engine.sampling import RowSampler, SamplingParams, sample_rows
from engine.sequence import Sequence, eos_set
from engine.serve.prefix_cache import PrefixCache
from models.pages import defer_trims, trim_heap


class Full(Exception):
    """Every batch row and queue place is taken."""


@dataclass
class Token:
    """One sampled token of a job, as delivered to its consumer."""
    id: int
    text: str                               # text this token releases (may be "")
    finish_reason: str | None               # "stop" | "length" on the last token
    logprob: float | None = None            # log p(chosen) under the model (before sampling filters)
    top: list[tuple[int, float]] | None = None   # the top_logprobs alternatives (id, logprob)
    index: int = 0                          # the choice it belongs to (a request with n > 1)


@dataclass
class Failure:
    """The job failed inside the engine (HTTP 500), or the server is shutting down (503)."""
    message: str
    status: int = 500


SHUTTING_DOWN = "the server is shutting down"   # the Failure (503) of jobs a shutdown ends


class Closed(Exception):
    """The scheduler admits nothing more (it is draining or stopped)."""


@dataclass(eq=False)
class Job:
    """One request: prompt ids, settings, and where its tokens go (`emit` is called from the loop's thread)."""
    ids: list[int]
    path: str
    params: SamplingParams
    max_tokens: int
    emit: object                              # callable(Token | Failure)
    stop: tuple[str, ...] = ()
    logprobs: int | None = None               # None: none; k >= 0: the chosen token's and the top k
    ignore_eos: bool = False
    eos_ids: frozenset | None = None          # None: the model's and tokenizer's EOS ids
    index: int = 0                            # its choice (Token.index)
    copies: list = field(default_factory=list)   # the request's other choices (n > 1): they share this
    #                                           job's prefill, are queued and cancelled with it
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0                    # prompt tokens restored from the prefix cache
    submitted: float = field(default_factory=time.perf_counter)
    _cancelled: threading.Event = field(default_factory=threading.Event)
    _withdraw: object = None                  # set by Scheduler.submit: takes the job out of its queue
    spec: object = None                       # its run (engine.runspec.RunSpec; None: the model's on `path`)

    @property
    def key(self) -> str:
        """What its batch, prefix cache entries and stats are keyed on: the path, with a hybrid's
        softmax layers and a window when it has them (rows of one key share a batch state)."""
        s = self.spec
        if s is None or (s.attention != "hybrid" and not s.linear_window):
            return self.path
        return s.describe()

    def cancel(self) -> None:
        self._cancelled.set()
        for copy in self.copies:
            copy._cancelled.set()
        if self._withdraw is not None:
            self._withdraw(self)

    @property
    def size(self) -> int:
        """Batch rows it takes: itself and its copies."""
        return 1 + len(self.copies)

    @property
    def group(self) -> list:
        return [self] + self.copies

    def fail(self, message: str, status: int = 500) -> None:
        """Send a Failure to this job and its copies (a shared prefill failed, or a shutdown)."""
        for job in self.group:
            job.emit(Failure(message, status))

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


class Running:
    """A job being decoded: its sampler and its finish rules (engine.sequence: detokenizer, stop
    strings, EOS, length; `eos` is the model's set, used when the job names none)."""

    def __init__(self, job: Job, tokenizer, vocab_size: int, device, eos=frozenset()):
        self.job = job
        self.sampler = RowSampler(job.params, job.ids, vocab_size, device)
        eos = frozenset() if job.ignore_eos else (job.eos_ids if job.eos_ids is not None else eos)
        self.sequence = Sequence(tokenizer, job.stop, eos, job.max_tokens, ids=job.generated)


@dataclass(eq=False)
class Prefill:
    """A job whose prompt is being fed chunk by chunk: its batch-1 state and how many ids it holds."""
    run: Running
    state: object
    done: int                                     # prompt ids in the state (restored or fed)
    logits: torch.Tensor | None = None            # (1, V) after the last chunk fed; None if it failed
    work: object = None                           # the chunk being fed in pieces (Stepper.pieces) or None
    work_ids: int = 0                             # that chunk's prompt ids
    work_s: float = 0.0                           # seconds spent on it so far

    @property
    def left(self) -> int:
        return len(self.run.job.ids) - self.done


@dataclass
class Pool:
    """One attention path's batch: the state (None when empty), its running jobs in row order, and
    every state row's job in order (`layout`: finished rows stay in the state, decoded and ignored,
    until dropping them is cheap: Scheduler._drop)."""
    state: object = None
    rows: list = field(default_factory=list)      # Running, in row order: the rows still going
    layout: list = field(default_factory=list)    # Running of every state row, going or finished
    staging: "Staging | None" = None              # a long row joining a few layers a step
    waiting: list = field(default_factory=list)   # (Running, state) to join once it has joined

    def pending(self) -> list:
        """The Running of rows not in the batch yet (staged or waiting)."""
        return ([self.staging.run] if self.staging is not None else []) + [run for run, _ in self.waiting]


@dataclass
class Staging:
    """A long prompt's row joining a slab over several steps (Scheduler._stage): `per` layers of its
    keys and values copied a step into the slab's next spare row, its real slots ending at `slot`,
    the batch's slots once every layer is in (one step a loop iteration gets it there)."""
    run: object
    state: object
    slot: int
    per: int
    layer: int = 0


# Scheduler.prefill_share's default, by measurement (docs/measurements.md, "Chunked prefill"): SmolLM2,
# one stream, a 4k prompt admitted: worst gap / the stream's gap at the same token with no prompt
# 3.4-4.3x at 1.0, 2.4-2.5x at 0.5 (the prompt's TTFT 1.4-1.5x longer)
PREFILL_SHARE = 0.5
# A row whose keys and values exceed this many bytes joins a running KV slab over several steps, about
# this many a step (whole layers): copying a 4k-token SmolLM2 row at once (~190 MB, its pages faulted
# in) stalled every stream ~70 ms. Measured on the 2-core VM: 8 MB a step cost ~3 ms.
STAGE_BYTES = 8 << 20
DEFER_DROP_FROM = 1024   # a finished row stays in the batch while a going row holds this many KV tokens


def _is_slab(state) -> bool:
    """A KV batch laid out as a slab (KVState.concat(rows=, headroom=)): rows join and leave in place."""
    return getattr(state, "slab", None) is not None


def slab_headroom(headroom: int, rows: int, token_bytes: int, ram: int | None = None) -> int:
    """The headroom of a KV slab, at most what keeps its address space (rows x (2 x headroom) slots,
    the headroom and as much room again) within half the machine's memory: a 128k-token context's slab
    would be refused by the kernel's overcommit check. A prompt longer than it joins by a new layout."""
    if ram is None:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(0, min(headroom, ram // 2 // max(1, rows * 2 * token_bytes)))


class Scheduler:
    """The decode loop and its queue. max_batch: sequences decoded at once (over both paths);
    max_queue: requests waiting beyond those (more are refused with `Full`)."""

    def __init__(self, model, tokenizer, stepper, max_batch: int = 16, max_queue: int | None = None,
                 feature_map: str | None = None, cache: PrefixCache | None = None,
                 prefill_share: float = PREFILL_SHARE, kv_headroom: int | None = None):
        self.model, self.tokenizer, self.stepper = model, tokenizer, stepper
        # while sequences decode, prompts are fed in pieces for about this many times the decode step's
        # time per iteration (_feed): the streams' gaps stay ~(1 + share) steps, a prompt's prefill runs
        # at ~share / (1 + share) of its speed alone
        self.prefill_share = prefill_share
        self.step_s = 0.0             # the decode steps' time per iteration (a moving average)
        self.piece_s = 0.0            # a prompt piece's time (a moving average)
        self._pieces_fed = 0          # pieces fed this iteration (one always is)
        self._trimmed_at = 0          # the iteration count when the heap was last trimmed (_idle)
        self.max_batch = max_batch
        # a KV batch's rows sit at slot >= this (KVState.concat(headroom=)): a prompt up to this long
        # joins a running batch without moving it
        self.kv_headroom = kv_headroom if kv_headroom is not None else model.config.max_position_embeddings
        self.max_queue = max_queue if max_queue is not None else 4 * max_batch
        self.feature_map = feature_map
        self.cache = cache if cache is not None else PrefixCache()
        self.eos = frozenset(eos_set(model.config, tokenizer))
        self.pools: dict[str, Pool] = {}
        self.pending: deque[Job] = deque()
        self.prefilling: list[Prefill] = []      # admitted, prompt not fed yet (oldest first)
        self.chunk = getattr(stepper, "chunk", 0) or 0   # 0: whole prompts in one block (Stepper.chunk)
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None
        self._stopping = False
        self.closed = False           # drain() or stop(): nothing more is admitted
        self.steps = 0                # decode steps run (one per pool per iteration)
        self.failures = 0             # steps or prefills that raised
        self.peak_active = 0          # most sequences decoded in one iteration
        self.admitting = 0            # jobs being prefilled by the loop right now
        # called (from the loop's thread) once an iteration's tokens are all emitted, and after stop()'s
        # failures: a consumer buffering events (the HTTP app's mailbox) wakes its reader once per step
        self.flush_hooks: list = []
        self.timing = {"iterations": 0, "tokens": 0, "step_s": 0.0, "step_cpu_s": 0.0, "busy_s": 0.0,
                       "busy_cpu_s": 0.0, "sample_cpu_s": 0.0, "deliver_cpu_s": 0.0}
        self.thread_id: int | None = None   # the loop thread's OS id (benchmarks read its CPU time in /proc)

    # ------------------------------------------------------------------ control
    def start(self) -> None:
        self._stopping = self.closed = False
        self.thread = threading.Thread(target=self._loop, name="gen-serve-scheduler", daemon=True)
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """End the loop (waits up to `timeout` s for its iteration to finish); every job still queued,
        prefilling or decoding gets Failure(SHUTTING_DOWN, 503)."""
        with self.cond:
            self._stopping = self.closed = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout)
        for job in list(self.pending) + [p.run.job for p in self.prefilling]:
            job.fail(SHUTTING_DOWN, 503)
        for job in [r.job for p in self.pools.values() for r in p.rows + p.pending()]:
            job.emit(Failure(SHUTTING_DOWN, 503))
        self.pending.clear()
        self.prefilling.clear()
        self.pools.clear()
        self._flush()

    def drain(self) -> None:
        """Admit nothing more: queued jobs get Failure(SHUTTING_DOWN, 503) and `submit` raises Closed;
        the jobs already prefilling or decoding run on (to their end, or to `stop`)."""
        with self.cond:
            self.closed = True
            queued = list(self.pending)
            self.pending.clear()
        for job in queued:
            job.fail(SHUTTING_DOWN, 503)
        self._flush()

    @property
    def busy(self) -> bool:
        """Some job is queued, being admitted, prefilled or decoded."""
        return bool(self.pending or self.admitting or self.prefilling or self.active)

    def submit(self, job: Job) -> None:
        if job.size > self.max_batch:   # it would wait for room that never comes
            raise ValueError(f"a job with {job.size} choices needs more rows than max_batch={self.max_batch}")
        with self.cond:
            if self.closed:
                raise Closed()
            if self.active + self.admitting + self.prefilling_rows + self.queued_rows + job.size \
                    > self.max_batch + self.max_queue:
                raise Full()
            job._withdraw = self.withdraw
            self.pending.append(job)
            self.cond.notify_all()
        if job.cancelled:   # cancelled before it was queued: leave at once
            self.withdraw(job)

    def withdraw(self, job: Job) -> bool:
        """Take `job` out of the queue; False when it is not there (admitted, finished, or never queued)."""
        with self.cond:
            try:
                self.pending.remove(job)
            except ValueError:
                return False
            return True

    # ------------------------------------------------------------------ introspection
    @property
    def active(self) -> int:
        """Sequences holding a decoding state (rows of the batch states, and rows joining them)."""
        return sum(len(p.rows) + len(p.pending()) for p in list(self.pools.values()))

    @property
    def prefilling_rows(self) -> int:
        """Rows the prompts being prefilled will take (a request with n choices takes n)."""
        return sum(p.run.job.size for p in list(self.prefilling))

    @property
    def queued_rows(self) -> int:
        return sum(job.size for job in list(self.pending))

    @property
    def states(self) -> int:
        """Batch states held (one per path with active sequences; 0 when idle)."""
        return sum(p.state is not None for p in list(self.pools.values()))

    def stats(self) -> dict:
        """Counts, and `timing`: the loop's iterations and tokens emitted; wall and thread-CPU seconds
        inside decode steps (step_s, step_cpu_s) and inside whole iterations (busy_s, busy_cpu_s: admission,
        steps, sampling, delivery); CPU seconds sampling and delivering tokens; the loop's OS thread id;
        the device the model, its states and the steps run on."""
        return {"device": str(self.model.device),
                "active": self.active, "queued": len(self.pending), "prefilling": len(self.prefilling),
                "states": self.states,
                "state_bytes": sum(p.state.nbytes for p in list(self.pools.values()) if p.state is not None),
                "steps": self.steps, "failures": self.failures, "peak_active": self.peak_active,
                "max_batch": self.max_batch, "max_queue": self.max_queue, "prefix_cache": self.cache.stats(),
                "timing": dict(self.timing), "thread_id": self.thread_id}

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        self.thread_id = threading.get_native_id()
        torch.set_grad_enabled(False)   # this thread only runs inference (autograd's mode is per thread, on by default)
        defer_trims()   # freed prompt plans are trimmed for once per idle spell (_idle), not each on this thread
        while True:
            with self.cond:
                if not self._stopping and not self.pending and not self.active and not self.prefilling:
                    self._idle()
                while not self._stopping and not self.pending and not self.active and not self.prefilling:
                    self.cond.wait(0.5)
                if self._stopping:
                    return
                room = self.max_batch - self.active - self.prefilling_rows
                new = []
                while self.pending and self.pending[0].size <= room:   # in order: a big group waits its turn
                    new.append(self.pending.popleft())
                    room -= new[-1].size
                self.admitting = sum(job.size for job in new)   # out of the queue, not yet rows: still counted
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                self._iterate(new)
            except Exception as e:   # noqa: BLE001 -- a bug in the loop itself: fail what is in flight, go on
                rows = [r for pool in self.pools.values() for r in pool.rows + pool.pending()] + \
                    [p.run for p in self.prefilling]
                in_pools = {id(r.job) for r in rows}
                copies = [c for p in self.prefilling for c in p.run.job.copies]
                self.pools.clear()
                self.prefilling.clear()
                self._fail(Pool(), rows, e)
                for job in [j for leader in new for j in leader.group] + copies:
                    if job.finish_reason is None and id(job) not in in_pools:
                        job.emit(Failure(f"scheduler error: {type(e).__name__}: {e}"))
            finally:
                self.admitting = 0
                self._flush()
                tm = self.timing
                tm["iterations"] += 1
                tm["busy_s"] += time.perf_counter() - t0
                tm["busy_cpu_s"] += time.thread_time() - c0

    def _idle(self) -> None:
        """The loop has nothing to do: once per idle spell, the C heap's free pages go back to the
        kernel (models.pages.trim_heap: a server that served a burst otherwise keeps its freed batch
        states' and scratch memory resident; ~135 MB on SmolLM2 after 240 mixed requests)."""
        if self.timing["iterations"] != self._trimmed_at:
            self._trimmed_at = self.timing["iterations"]
            trim_heap()

    def _flush(self) -> None:
        for hook in list(self.flush_hooks):
            try:
                hook()
            except Exception:   # noqa: BLE001 -- a consumer gone (its event loop closed) must not stop the loop
                pass

    def _iterate(self, new: list[Job]) -> None:
        """One loop iteration: admit `new` jobs, feed prompts (all short ones, one chunk of the oldest
        long one), then one decode step per path."""
        joining: dict[str, list] = {}
        live = [job for job in new if not job.cancelled]
        hits = {id(job): self.cache.lookup(job.key, job.ids) for job in live}
        ready = self._prefill_together([job for job in live if hits[id(job)] is None
                                        and (not self.chunk or len(job.ids) <= self.chunk)])
        # the cheap first: a cache hit or a job prefilled with others sends its first token before the
        # jobs that still need a prefill of their own
        live.sort(key=lambda job: hits[id(job)] is None and id(job) not in ready)
        for job in live:
            admitted = self._admit(job, hits[id(job)], ready.get(id(job)))
            if isinstance(admitted, Prefill):
                self.prefilling.append(admitted)
            else:
                joining.setdefault(job.key, []).extend(admitted)
        self.admitting = 0
        for prefill in self._feed():
            joining.setdefault(prefill.run.job.key, []).extend(
                self._first_tokens(prefill.run, prefill.state, prefill.logits))
        for path, items in joining.items():
            self._join(path, items)
        for path in list(self.pools):
            self._stage(path)
        t0 = time.perf_counter()
        for path in list(self.pools):
            self._step(path)
        if self.pools:
            self.step_s += 0.2 * (time.perf_counter() - t0 - self.step_s)

    def _feed(self) -> list[Prefill]:
        """Feed the prompts being prefilled. While sequences decode, prompts go in pieces (a layer of a
        chunk, Stepper.pieces: the same bits as whole), oldest first, for about `prefill_share` decode
        steps' time per iteration: no stream waits more than ~(1 + share) steps, however long a prompt
        is. With nothing decoding each runs to its end (no stream to keep flowing). Returns the
        prefills now complete, in admission order."""
        self.prefilling = [p for p in self.prefilling if not p.run.job.cancelled]
        decoding = any(pool.rows for pool in self.pools.values())
        if decoding and self.chunk and hasattr(self.stepper, "pieces"):
            self._pieces_fed = 0
            end = time.perf_counter() + self.prefill_share * self.step_s
            for p in self.prefilling:
                self._feed_pieces(p, end)
                if time.perf_counter() + self.piece_s > end:
                    break
        elif decoding and self.chunk:   # a step without pieces: one chunk of the oldest long prompt
            long_fed = False
            for p in self.prefilling:
                if p.left > self.chunk:
                    if not long_fed:
                        long_fed = True
                        self._feed_one(p, self.chunk)
                else:
                    self._feed_one(p, p.left)
        else:
            for p in self.prefilling:
                if p.work is not None:          # a chunk begun in pieces is finished first
                    self._feed_pieces(p, float("inf"))
                elif p.left > 0:
                    self._feed_one(p, p.left)
        done = [p for p in self.prefilling if p.left == 0 and p.logits is not None]
        self.prefilling = [p for p in self.prefilling if p.left > 0]
        return done

    def _feed_pieces(self, p: Prefill, end: float) -> None:
        """Feed p's prompt a piece at a time (a chunk of `self.chunk` ids at a time, Stepper.pieces)
        while the next piece should end before time.perf_counter() reaches `end` (its cost guessed
        from the pieces before it; at least one piece a call), or until the prompt is in."""
        job = p.run.job
        try:
            while p.left > 0:
                t0 = time.perf_counter()
                if t0 + self.piece_s > end and self._pieces_fed:
                    return
                if p.work is None:
                    n = min(self.chunk, p.left)
                    tokens = torch.tensor([job.ids[p.done:p.done + n]], device=self.model.device)   # (1, n)
                    p.work, p.work_ids, p.work_s = self.stepper.pieces(tokens, p.state, logits=n == p.left), n, 0.0
                try:
                    next(p.work)
                    self._pieces_fed += 1
                    p.work_s += time.perf_counter() - t0
                    self.piece_s += 0.2 * (time.perf_counter() - t0 - self.piece_s)
                except StopIteration as finished:   # (a chunk before the prompt's last: no logits)
                    p.logits = finished.value[:, -1] if finished.value is not None else None   # (1, V)
                    p.done += p.work_ids
                    self.cache.record_prefill(p.work_ids, p.work_s + time.perf_counter() - t0)
                    p.work = None
                    if p.left == 0:   # the state is only read from now on (_admit): the cache keeps it as it is
                        self._prompt_done(job, p.state, p.logits)
        except Exception as e:   # noqa: BLE001 -- a failed prefill fails this request only
            self.failures += 1
            job.fail(f"prefill failed: {type(e).__name__}: {e}")
            p.done, p.logits, p.work = len(job.ids), None, None

    def _feed_one(self, p: Prefill, n: int) -> None:
        """Feed the next `n` ids of p's prompt (the stepper cuts them into chunks from where it starts)."""
        job = p.run.job
        try:
            t0 = time.perf_counter()
            tokens = torch.tensor([job.ids[p.done:p.done + n]], device=self.model.device)   # (1, n)
            p.logits = self.stepper(tokens, p.state, last_only=True)[:, -1]                 # (1, V)
            p.done += n
            self.cache.record_prefill(n, time.perf_counter() - t0)
            if p.left == 0:   # the state is only read from now on (_admit): the cache keeps it as it is
                self._prompt_done(job, p.state, p.logits)
        except Exception as e:   # noqa: BLE001 -- a failed prefill fails this request only
            self.failures += 1
            job.fail(f"prefill failed: {type(e).__name__}: {e}")
            p.done, p.logits = len(job.ids), None

    def _prompt_done(self, job: Job, state, logits) -> None:
        """A prompt's state is complete and only read from now on: the step forms drop what they keep
        for it (Stepper.release), and the prefix cache keeps it as it is."""
        if hasattr(self.stepper, "release"):
            self.stepper.release(state)
        self.cache.put(job.key, job.ids, state, logits, owned=True)

    def _prefill_together(self, jobs: list[Job]) -> dict:
        """Prompts of one path and one length arriving together are prefilled as one batch (no pads,
        every row at the positions it has alone). Returns {id(job): (batch-1 state, logits (1, V))};
        a group that fails is left to `_admit`, which prefills (and fails) each job on its own."""
        groups: dict[tuple, list[Job]] = {}
        for job in jobs:
            groups.setdefault((job.key, len(job.ids)), []).append(job)
        ready = {}
        for (path, T), group in groups.items():
            if len(group) < 2:
                continue
            try:
                t0 = time.perf_counter()
                state = self.model.init_state(batch=len(group), max_len=T, attention=group[0].path,
                                              feature_map=self.feature_map, spec=group[0].spec)
                tokens = torch.tensor([job.ids for job in group], device=self.model.device)   # (k, T)
                logits = self.stepper(tokens, state, last_only=True)[:, -1]                 # (k, V)
                self.cache.record_prefill(T * len(group), time.perf_counter() - t0)
                for b, job in enumerate(group):
                    ready[id(job)] = (state.select_rows([b], max_len=T), logits[b:b + 1])
            except Exception:   # noqa: BLE001 -- each job of the group then prefills alone
                continue
        return ready

    def _admit(self, job: Job, hit=None, ready=None):
        """Start `job`. With `ready` (state, logits: prefilled with others) or a prefix cache `hit`
        (entry, tokens) holding its whole prompt, sample its first token now (and its copies'): a
        list of (Running, batch-1 state) for those that go on. Otherwise a Prefill (a fresh state,
        or the cached prefix's) for `_feed`.

        A prompt's batch-1 state holds exactly its prompt (capacity = its length): it is only read once
        complete (`_join` copies it into the pool's batch state, which gets the room to decode), so the
        prefix cache keeps it as it is, without a copy, and a whole-prompt hit joins the cached state
        itself (a copy of a 4k-token SmolLM2 KV row is ~190 MB)."""
        try:
            run = Running(job, self.tokenizer, self.model.config.vocab_size, self.model.device, self.eos)
            if ready is not None:
                state, logits = ready
                self._prompt_done(job, state, logits)
                return self._first_tokens(run, state, logits)
            if hit is not None:
                entry, n = hit
                job.cached_tokens = n
                if n == len(job.ids):
                    return self._first_tokens(run, entry.state, entry.logits)
                return Prefill(run, entry.state.select_rows([0], max_len=len(job.ids)), n)
            return Prefill(run, self.model.init_state(batch=1, max_len=len(job.ids), attention=job.path,
                                                      feature_map=self.feature_map, spec=job.spec), 0)
        except Exception as e:   # noqa: BLE001 -- a failed prefill fails this request only
            self.failures += 1
            job.fail(f"prefill failed: {type(e).__name__}: {e}")
            return []

    def _first_tokens(self, run: Running, state, logits) -> list:
        """A prefilled job and its copies (n > 1: each gets a copy of the prompt's state; one prefill
        for all) sample and send their first tokens: (Running, state) for each that goes on."""
        starts = [(run, state)]
        for copy in run.job.copies:
            try:
                copy.cached_tokens = run.job.cached_tokens
                starts.append((Running(copy, self.tokenizer, self.model.config.vocab_size, self.model.device,
                                       self.eos),
                               state.select_rows([0], max_len=len(copy.ids) + copy.max_tokens)))
            except Exception as e:   # noqa: BLE001
                self.failures += 1
                copy.emit(Failure(f"prefill failed: {type(e).__name__}: {e}"))
        return [item for item in (self._first_token(r, st, logits) for r, st in starts) if item is not None]

    def _first_token(self, run: Running, state, logits):
        """Sample and send a prefilled job's first token: (Running, state) if it goes on, else None."""
        try:
            return (run, state) if self._emit([run], logits)[0] else None
        except Exception as e:   # noqa: BLE001
            self.failures += 1
            run.job.emit(Failure(f"prefill failed: {type(e).__name__}: {e}"))
            return None

    def _join(self, path: str, items: list) -> None:
        if not items:   # every job admitted on this path ended at its first token: nothing joins
            return
        pool = self.pools.setdefault(path, Pool())
        if pool.staging is not None:   # after the staged row (its slot is fixed: the batch must not change)
            pool.waiting.extend(items)
            return
        now, later = [], []
        for it in items:
            (later if self._staging(pool, *it) else now).append(it)
        if now:
            self._join_now(pool, now)
        for i, (run, state) in enumerate(later):
            staging = self._staging(pool, run, state)   # again: the joins before it may have moved the batch
            if staging is not None:
                pool.staging = staging
                pool.waiting.extend(later[i + 1:])
                return
            self._join_now(pool, [(run, state)])

    def _staging(self, pool, run, state) -> Staging | None:
        """How `state`'s row joins `pool`'s slab over several steps, or None: at once (a row of at most
        STAGE_BYTES, no slab, no spare row or slot)."""
        slab = pool.state
        if not _is_slab(slab) or type(state) is not type(slab) or state.batch_size != 1:
            return None
        size = state.row_bytes()
        if size <= STAGE_BYTES:
            return None
        L = state.k.shape[0]
        per = max(1, STAGE_BYTES * L // size)
        # the row's slots end where the batch's will be when its last layer is in: `steps` iterations
        # from now, this one included, each copying `per` layers then stepping once
        slot = slab.slots + -(-L // per) - 1
        remaining = max(r.job.max_tokens - len(r.job.generated) for r in pool.rows + pool.pending() + [run])
        if slab.batch_size >= slab.slab[0].shape[1] or state.slots > slot or slot + remaining > slab.max_len:
            return None
        return Staging(run, state, slot, per)

    def _stage(self, path: str) -> None:
        """Copy the next layers of the pool's staged row; with its last in, the row joins (and then
        the rows that waited for it). A staged job cancelled, or a batch that changed under it (its
        rows all ended): the row joins the ordinary way."""
        pool = self.pools[path]
        st = pool.staging
        if st is None:
            return
        if st.run.job.cancelled or pool.state is None or not pool.rows or pool.state.slots > st.slot:
            pool.staging, items = None, [(st.run, st.state)] + pool.waiting
            pool.waiting = []
            items = [it for it in items if not it[0].job.cancelled]
            if pool.state is None or not pool.rows:
                pool.state, pool.rows, pool.layout = None, [], []
            self._join(path, items)
            self._staged_now(path, st)
            return
        L = st.state.k.shape[0]
        layers = range(st.layer, min(L, st.layer + st.per))
        try:
            if not pool.state.stage(st.state, st.slot, layers):
                raise RuntimeError("the slab refused the staged row")
            st.layer = layers.stop
            if st.layer < L:
                return
            if pool.state.slots != st.slot:
                raise RuntimeError(f"the batch is at slot {pool.state.slots}, the staged row ends at {st.slot}")
            pool.state = pool.state.join_staged(st.state)
            pool.rows, pool.layout = pool.rows + [st.run], pool.layout + [st.run]
            self.peak_active = max(self.peak_active, self.active)
        except Exception as e:   # noqa: BLE001 -- this row fails; the batch goes on
            self.failures += 1
            st.run.job.emit(Failure(f"join failed: {type(e).__name__}: {e}"))
        pool.staging, waiting = None, pool.waiting
        pool.waiting = []
        self._join(path, waiting)
        self._staged_now(path, st)

    def _staged_now(self, path: str, was) -> None:
        """A row `_stage` staged just now (its `_join`, after this iteration's copy) copies its first
        layers now: its slot counts this iteration's step, so one copy a step brings it in on time."""
        st = self.pools[path].staging
        if st is not None and st is not was:
            self._stage(path)

    def _join_now(self, pool: Pool, items: list) -> None:
        rows = pool.rows + [run for run, _ in items]
        states = ([pool.state] if pool.state is not None else []) + [state for _, state in items]
        try:
            pool.state = self._joined(pool.state, [state for _, state in items], states, rows)
            pool.rows, pool.layout = rows, pool.layout + [run for run, _ in items]
            self.peak_active = max(self.peak_active, self.active)
        except Exception as e:   # noqa: BLE001
            self._fail(pool, rows, e)

    def _joined(self, running, new: list, states: list, rows: list):
        """The pool's batch state with the new states' rows. A KV cache on the CPU is a slab
        (KVState.concat(rows=, headroom=)): a row joins in place, written into a spare row, and no
        running row moves (the copy of every running row was the stall of issue 29 at a long prompt's
        end); where it does not fit (no spare row or slot), a new slab is laid out, every row copied."""
        max_len = self._capacity(states, rows)
        if running is not None and hasattr(running, "join"):
            joined = running.join(new, max_len)
            if joined is not None:
                return joined
        cls = type(states[0])
        if states[0].device.type == "cpu" and getattr(cls, "slabs", False):
            headroom = slab_headroom(self.kv_headroom, self.max_batch, states[0].token_bytes)
            try:
                return cls.concat(states, max_len=max_len, rows=self.max_batch, headroom=headroom)
            except RuntimeError:   # the address space refused (a huge context): as many rows as now
                pass
        return cls.concat(states, max_len=max_len)

    @staticmethod
    def _capacity(states, rows) -> int | None:
        """Slots a KV batch needs: the longest row's slots + the most tokens any row may still feed."""
        if states[0].max_len is None:
            return None
        return max(s.slots for s in states) + max(r.job.max_tokens - len(r.job.generated) for r in rows)

    def _step(self, path: str) -> None:
        pool = self.pools[path]
        self._drop(pool, [r for r in pool.rows if r.job.cancelled])
        if not pool.rows:
            if not pool.pending():   # (a staged row joins anew next iteration: _stage)
                del self.pools[path]
            return
        tokens = torch.tensor([[r.job.generated[-1]] for r in pool.layout], device=self.model.device)   # (B, 1)
        try:
            t0, c0 = time.perf_counter(), time.thread_time()
            logits = self.stepper(tokens, pool.state)[:, -1]                   # (B, V)
            if len(pool.layout) > len(pool.rows):   # finished rows ride along: their logits are dropped
                going = set(map(id, pool.rows))
                logits = logits[[b for b, r in enumerate(pool.layout) if id(r) in going]]
            if hasattr(self.stepper, "rest"):   # the step's pool sleeps while the tokens go out
                self.stepper.rest()
            self.timing["step_s"] += time.perf_counter() - t0
            self.timing["step_cpu_s"] += time.thread_time() - c0
            self.steps += 1
            done = [r for r, going in zip(pool.rows, self._emit(pool.rows, logits)) if not going]
        except Exception as e:   # noqa: BLE001 -- fails this batch only; the loop goes on
            self._fail(pool, pool.rows + pool.pending(), e)
            del self.pools[path]
            return
        self._drop(pool, done)

    def _drop(self, pool: Pool, gone: list) -> None:
        """Rows `gone` (finished or cancelled) stop being sent. Their state rows are dropped (the
        others copied into a new batch state) at once where that copy is cheap; while a going row holds
        a long KV cache (DEFER_DROP_FROM tokens: a 4k-token SmolLM2 row is ~190 MB) they stay in the
        state, decoded and ignored, until they are as many as the going rows (a join takes them along)."""
        if not gone:
            return
        gone_ids = set(map(id, gone))
        pool.rows = [r for r in pool.rows if id(r) not in gone_ids]
        if not pool.rows:
            pool.state, pool.layout = None, []
            return
        if pool.staging is not None:   # its row and slot are fixed until it is in: the rest ride along
            return
        going = set(map(id, pool.rows))
        keep = [b for b, r in enumerate(pool.layout) if id(r) in going]
        dead = len(pool.layout) - len(keep)
        slab = _is_slab(pool.state)
        moved = [b for b in keep if b >= len(keep)] if slab else keep   # a slab moves these only, into the holes
        if dead < len(keep) and self._long_kv(pool.state, moved):
            return
        if slab:
            pool.state, order = pool.state.keep_rows(keep)
            pool.layout = [pool.layout[b] for b in order]
            pool.rows = list(pool.layout)
            return
        # the kept rows' capacity stays enough: the slots trimmed are pads no kept row needs
        pool.state, pool.layout = pool.state.select_rows(keep), list(pool.rows)

    @staticmethod
    def _long_kv(state, rows: list[int]) -> bool:
        """Whether one of `rows` holds at least DEFER_DROP_FROM tokens of KV cache (a copy to avoid)."""
        return state.max_len is not None and bool(rows) and int(state.lengths[rows].max()) >= DEFER_DROP_FROM

    def _fail(self, pool: Pool, rows: list, error: Exception) -> None:
        self.failures += 1
        for r in rows:
            r.job.emit(Failure(f"decode step failed: {type(error).__name__}: {error}"))
        pool.rows, pool.state, pool.layout = [], None, []

    def _emit(self, runs: list[Running], logits: torch.Tensor) -> list[bool]:
        """Sample every run's next token from logits (B, V) (row b for runs[b]) in one pass, deliver
        each; False where the job is finished."""
        c0 = time.thread_time()
        tokens = sample_rows([r.sampler for r in runs], logits)
        want = [b for b, r in enumerate(runs) if r.job.logprobs is not None]
        logprobs = [(None, None)] * len(runs)
        if want:   # log p under the model (before the sampling filters), the rows that asked, at once
            lp = torch.log_softmax((logits if len(want) == len(runs) else logits[want]).float(), -1)   # (k, V)
            chosen = lp.gather(1, torch.tensor([[tokens[b]] for b in want], device=lp.device))[:, 0].tolist()
            for i, b in enumerate(want):
                k = runs[b].job.logprobs
                top = None
                if k:
                    values, ids = lp[i].topk(k)
                    top = list(zip(ids.tolist(), values.tolist()))
                logprobs[b] = (chosen[i], top)
        c1 = time.thread_time()
        going = [self._deliver(r, t, *lps) for r, t, lps in zip(runs, tokens, logprobs)]
        tm = self.timing
        tm["sample_cpu_s"] += c1 - c0
        tm["deliver_cpu_s"] += time.thread_time() - c1
        tm["tokens"] += len(runs)
        return going

    def _deliver(self, run: Running, tok: int, logprob: float | None, top) -> bool:
        """Record (in job.generated) and send one sampled token; False when the job is finished."""
        job = run.job
        text, reason = run.sequence.push(tok)
        if reason is not None:
            job.finish_reason = reason
        job.emit(Token(tok, text, reason, logprob, top, job.index))
        return reason is None
