"""Grammar compilation off the engine thread, cached by the constraint's text."""
from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xgrammar as xgr

from ..structured_outputs import StructuredOutputs
from .grammar import build_grammar

# Compiled grammars kept (least recently used dropped): a few hundred KB to a few MB
# each, depending on the grammar and the vocabulary.
CACHE_ENTRIES = 256


class GrammarCompileService:
    """Compiles constraints for one tokenizer in a background thread.

    `submit` builds the grammar at once (fast: a bad schema raises ValueError in the
    caller, before anything is queued) and returns a future of the compiled grammar.
    The tokenizer-dependent compile (milliseconds to seconds) runs on the service's
    thread, never on the caller's; xgrammar releases the GIL while it works. Equal
    constraints share one compile, finished or in progress. Thread-safe; the tokenizer
    passed in is never read again after construction.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int],
                 threads: int = 2) -> None:
        # A private copy, made here on the constructing thread: the compile thread reads
        # the vocabulary while the caller's thread (the engine's) may be detokenizing, and
        # an HF tokenizer used by two threads at once can fail ("Already borrowed").
        self.tokenizer = copy.deepcopy(tokenizer)
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.threads = threads  # xgrammar's own threads within one compile
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._compiler: xgr.GrammarCompiler | None = None  # made by the pool thread

    def submit(self, spec: StructuredOutputs) -> Future:
        """A future of `spec`'s compiled grammar; ValueError if `spec` is invalid."""
        key = spec.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
        grammar = build_grammar(spec)  # outside the lock: it may take a few milliseconds
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                return future  # another thread submitted it meanwhile
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="stallfree-grammar")
            future = self._pool.submit(self._compile, grammar)
            self._cache[key] = future
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        # Outside the lock: the callback runs at once if the compile is already done.
        future.add_done_callback(lambda f: self._forget_failure(key, f))
        return future

    def _compile(self, grammar: xgr.Grammar) -> xgr.CompiledGrammar:
        if self._compiler is None:  # only the pool's one thread gets here
            # Reading the vocabulary takes a moment for a large one: done here, lazily.
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            # Our cache (of futures) replaces xgrammar's own.
            self._compiler = xgr.GrammarCompiler(info, max_threads=self.threads,
                                                 cache_enabled=False)
        return self._compiler.compile_grammar(grammar)

    def _forget_failure(self, key: str, future: Future) -> None:
        if future.cancelled() or future.exception() is not None:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    def shutdown(self) -> None:
        """Stops the compile thread (queued compiles are cancelled)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
