"""A grammar compile process: `python -m stallfree.structured.worker READ_FD WRITE_FD`.

xgrammar's compile cannot be interrupted, so it runs here, where killing the process
cancels it (a timeout, or its request left) and gives back all the memory it took.
Messages (pickled, on two pipes): first the tokenizer's info (xgrammar's JSON) and the
compile threads; then, per grammar, (grammar JSON, largest compiled size in bytes),
answered by ("ok", compiled JSON, size), ("too_large", size) or ("error", message).
"""
from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection

# Below the engine's threads: a hostile compile then takes what decoding leaves over.
NICENESS = 5


def serve(inbox: Connection, outbox: Connection) -> None:
    import xgrammar as xgr

    info_json, threads = inbox.recv()
    info = xgr.TokenizerInfo.deserialize_json(info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
    outbox.send(("ready",))
    while True:
        try:
            grammar_json, max_bytes = inbox.recv()
        except EOFError:  # the service closed its end: shut down
            return
        try:
            compiled = compiler.compile_grammar(xgr.Grammar.deserialize_json(grammar_json))
        except Exception as exc:  # noqa: BLE001 - reported; the next grammar is unaffected
            outbox.send(("error", f"{type(exc).__name__}: {exc}"))
            continue
        size = compiled.memory_size_bytes
        if size > max_bytes:  # refused here: never serialized, never sent
            outbox.send(("too_large", size))
            continue
        outbox.send(("ok", compiled.serialize_json(), size))


def main() -> None:
    os.nice(NICENESS)
    read_fd, write_fd = int(sys.argv[1]), int(sys.argv[2])
    serve(Connection(read_fd, writable=False), Connection(write_fd, readable=False))


if __name__ == "__main__":
    main()
