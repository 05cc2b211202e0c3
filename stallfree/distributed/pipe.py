"""Hidden states from one pipeline stage to the next (point-to-point, same TP rank)."""
from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist


class StagePipe:
    def __init__(self, rank: int, tp_size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.prev, self.next = rank - tp_size, rank + tp_size
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        # Sends complete only when the next stage receives; keeping them pending lets
        # this stage start its next micro-batch meanwhile (that overlap is the pipeline).
        self._pending: deque[tuple[dist.Work, torch.Tensor]] = deque()

    def recv(self, num_tokens: int) -> torch.Tensor:
        buf = torch.empty(num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        dist.recv(buf, self.prev)
        return buf

    def send(self, hidden: torch.Tensor) -> None:
        while self._pending and self._pending[0][0].is_completed():
            self._pending.popleft()[0].wait()
        hidden = hidden.contiguous()
        self._pending.append((dist.isend(hidden, self.next), hidden))

    def flush(self) -> None:
        while self._pending:
            self._pending.popleft()[0].wait()
