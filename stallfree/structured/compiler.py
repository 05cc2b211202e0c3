"""Grammar compilation in compile processes, bounded, cancellable, cached by constraint text."""
from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import xgrammar as xgr

from ..structured_outputs import CompileLimits, ConstraintError, StructuredOutputs
from .grammar import build_grammar
from .pool import CompileCancelled, CompileJob, CompilePool, CompileRefused

# Entries kept at most (compiled grammars and refusals), besides their bytes' bound.
CACHE_ENTRIES = 256
_CHECKED = 64  # grammars checked (built) and not yet submitted: e.g. then refused
OUTCOMES = ("compiled", "refused", "cancelled", "failed")


@dataclass(eq=False)
class _Entry:
    job: CompileJob
    refs: int = 0  # waiting views that hold it: at 0 the compile is cancelled
    size: int = 0  # bytes of the compiled grammar, once compiled


@dataclass
class GrammarCacheStats:
    entries: int  # compiled grammars and refusals kept
    bytes: int  # of the compiled grammars kept
    compiling: int  # compiles queued or running
    running: int  # compiles in a compile process now
    compiles: dict[str, int] = field(default_factory=dict)  # by outcome (OUTCOMES)


class GrammarCompileService:
    """Compiles constraints for one tokenizer, never on the caller's thread.

    `check` refuses a bad or oversized constraint at once (ConstraintError naming the
    field). `submit` returns a future of the compiled grammar; cancelling it gives the
    compile up, and the compile stops (its process killed) once no one waits for it.
    Equal constraints share one compile. The cache holds compiled grammars up to
    `limits.grammar_cache_bytes` (least recently used dropped) and refusals (a hostile
    constraint sent again is refused at once). Thread-safe; the tokenizer passed in is
    never read again after construction.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int],
                 threads: int = 2, processes: int = 2,
                 limits: CompileLimits | None = None) -> None:
        # A private copy, made here on the constructing thread: an HF tokenizer used by
        # two threads at once can fail ("Already borrowed").
        self.tokenizer = copy.deepcopy(tokenizer)
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.limits = limits or CompileLimits()
        self._lock = threading.Lock()
        self._info: xgr.TokenizerInfo | None = None
        self._info_lock = threading.Lock()  # not _lock: building the info takes a while
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._checked: OrderedDict[str, str] = OrderedDict()  # key -> grammar JSON
        self._bytes = 0
        self._compiles = dict.fromkeys(OUTCOMES, 0)
        self._pool = CompilePool(self._info_json, self._load, processes, threads)

    # ---- the callers' side ----------------------------------------------------------
    def check(self, spec: StructuredOutputs) -> None:
        """ConstraintError (a ValueError) naming the field if `spec` is invalid or larger
        than --max-constraint-bytes; quick (milliseconds), tokenizer-free. The grammar
        built is kept a while for `submit`."""
        with self._lock:
            if spec.key in self._checked or spec.key in self._entries:
                return  # checked already (by the server, before the engine)
        grammar_json = self._build(spec)
        with self._lock:
            self._checked[spec.key] = grammar_json
            while len(self._checked) > _CHECKED:
                self._checked.popitem(last=False)

    def _build(self, spec: StructuredOutputs) -> str:
        key = spec.key
        size, most = len(key.encode()), self.limits.max_constraint_bytes
        if size > most:
            raise ConstraintError(spec.field(), f"is {size} bytes; at most {most} (this "
                                                f"server's --max-constraint-bytes)")
        return build_grammar(spec).serialize_json()

    def submit(self, spec: StructuredOutputs) -> Future:
        """A future of `spec`'s compiled grammar (ConstraintError if a bound stopped it);
        cancel it to give the compile up. ValueError at once if `spec` is invalid."""
        key = spec.key
        with self._lock:
            entry = self._entries.get(key)
            grammar_json = self._checked.pop(key, None)
        if entry is None and grammar_json is None:
            grammar_json = self._build(spec)  # outside the lock: milliseconds
        with self._lock:
            entry = self._entries.get(key)
            new = entry is None
            if new:
                limits = self.limits
                entry = self._entries[key] = _Entry(CompileJob(
                    grammar_json, limits.max_grammar_bytes,
                    limits.max_grammar_compile_seconds))
            self._entries.move_to_end(key)
            entry.refs += 1
        if new:
            entry.job.future.add_done_callback(lambda _: self._done(key, entry))
            self._pool.run(entry.job)
        view = self._view(entry, spec)
        view.add_done_callback(lambda v: v.cancelled() and self._release(key, entry))
        return view

    def watch(self, spec: StructuredOutputs) -> Future | None:
        """A future of the compile `submit` started for `spec` (None if there is none)
        that does not keep it going: for a caller that wants its outcome."""
        with self._lock:
            entry = self._entries.get(spec.key)
        return None if entry is None else self._view(entry, spec)

    def stats(self) -> GrammarCacheStats:
        with self._lock:
            compiling = sum(not e.job.future.done() for e in self._entries.values())
            entries, compiles = len(self._entries) - compiling, dict(self._compiles)
        return GrammarCacheStats(entries, self._bytes, compiling, self._pool.running, compiles)

    def shutdown(self) -> None:
        """Stops the compile processes (queued compiles never finish)."""
        self._pool.shutdown()

    # ---- internals --------------------------------------------------------------------
    @staticmethod
    def _view(entry: _Entry, spec: StructuredOutputs) -> Future:
        """A future of its own on the entry's compile: a refusal names this caller's field."""
        view: Future = Future()

        def settle(job_future: Future) -> None:
            try:
                if job_future.cancelled():
                    view.set_exception(CompileCancelled("every request for it left"))
                elif isinstance(exc := job_future.exception(), CompileRefused):
                    view.set_exception(ConstraintError(spec.field(), str(exc)))
                elif exc is not None:
                    view.set_exception(exc)
                else:
                    view.set_result(job_future.result()[0])
            except InvalidStateError:
                pass  # the view was cancelled meanwhile
        entry.job.future.add_done_callback(settle)
        return view

    def _release(self, key: str, entry: _Entry) -> None:
        with self._lock:
            entry.refs -= 1
            if entry.refs > 0 or entry.job.future.done():
                return
            if self._entries.get(key) is entry:
                del self._entries[key]
        self._pool.cancel(entry.job)  # outside the lock: it runs _done's callback

    def _done(self, key: str, entry: _Entry) -> None:
        future = entry.job.future
        exc = CompileCancelled() if future.cancelled() else future.exception()
        outcome = ("compiled" if exc is None else "refused" if isinstance(exc, CompileRefused)
                   else "cancelled" if isinstance(exc, CompileCancelled) else "failed")
        with self._lock:
            self._compiles[outcome] += 1
            if self._entries.get(key) is not entry:
                return  # cancelled: already dropped
            if outcome == "compiled" and future.result()[1] <= self.limits.grammar_cache_bytes:
                entry.size = future.result()[1]
                self._bytes += entry.size
            elif outcome != "refused":  # a refusal is kept: the same request gets it at once
                del self._entries[key]  # failed, or too large to cache (its requests have it)
            self._evict()

    def _evict(self) -> None:
        """Drops the least recently used finished entries beyond the cache's bounds."""
        for key in list(self._entries):
            if self._bytes <= self.limits.grammar_cache_bytes and len(
                    self._entries) <= CACHE_ENTRIES:
                return
            entry = self._entries[key]
            if entry.job.future.done():
                del self._entries[key]
                self._bytes -= entry.size

    def _info_json(self) -> str:
        return self._tokenizer_info().serialize_json()

    def _load(self, compiled_json: str) -> xgr.CompiledGrammar:
        return xgr.CompiledGrammar.deserialize_json(compiled_json, self._tokenizer_info())

    def _tokenizer_info(self) -> xgr.TokenizerInfo:
        with self._info_lock:
            if self._info is None:  # reading a large vocabulary takes a moment: done lazily
                self._info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids)
            return self._info
