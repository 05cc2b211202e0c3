"""Matmul weights reordered once, at load, for the CPU kernels, and read back from there.

A packing is a permutation of the plain weight's values (csrc/f32_linear.cpp's f32_pack,
csrc/amx_linear.cpp's amx_pack), so the plain [out, in] matrix can be rebuilt from it at
any time, and one of its rows read in place. Where a packing serves every matmul of its
weight, the plain copy is dropped once packed (`Linear.prepack`): the model then takes its
size once in memory, not twice. The rebuilt matrix serves the paths that run only while a
kernel is switched off (comparisons, benchmarks), and an embedding tied to the LM head
looks its rows up in the LM head's packing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import quant_formats
from .kernels import unavailable_reason

BLOCK = 16  # output columns per packed block, in both kernels' layouts
AMX_PAIRS = 16  # k-pairs per tile row of the bf16 layout: a tile spans 32 values of k


def gate_up_alternating(weight: torch.Tensor) -> torch.Tensor:
    """[gate; up] with their 16-row blocks interleaved: gate block i, then up block i."""
    half = weight.shape[0] // 2
    blocks = weight.reshape(2, half // BLOCK, BLOCK, weight.shape[1]).transpose(0, 1)
    return blocks.reshape(weight.shape)


@dataclass(frozen=True)
class PackedWeight:
    """A weight [out, in] reordered once for a matmul: `layout` "amx" (csrc/amx_linear.cpp's
    tiles), "f32" (csrc/f32_linear.cpp's blocks), either "_gated" (gate and up blocks
    alternating, `gated_linear`), "onednn" (oneDNN's blocked layout, opaque here), or a
    quantized format's name (quant_formats.FORMATS; the rows in csrc/quant_panels.h's panels,
    a [gate; up] weight in that order). `shape`: the plain weight's [out, in]."""

    data: torch.Tensor
    layout: str
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def quant(self) -> quant_formats.QuantFormat | None:
        """The quantized format of these rows (None: a float packing)."""
        return quant_formats.FORMATS.get(self.layout)

    @property
    def readable(self) -> bool:
        """Whether `unpack` and `rows` can read the plain values back from this layout."""
        return self.layout.removesuffix("_gated") in ("f32", "amx") or self.quant is not None

    def _blocks(self) -> torch.Tensor:
        """The packing as [out/16, in, 16] (f32) or [out/16, in/32, 16, 16, 2] (amx) views:
        block, k (in pairs for amx), column within the block."""
        n, k = self.shape
        if self.layout.startswith("f32"):
            return self.data.view(n // BLOCK, k, BLOCK)
        if self.layout.startswith("amx"):
            return self.data.view(n // BLOCK, k // (2 * AMX_PAIRS), AMX_PAIRS, BLOCK, 2)
        raise ValueError(f"the {self.layout} packing cannot be read back")

    def unpack(self) -> torch.Tensor:
        """The plain weight [out, in], in a new tensor: float32 column-major, as the loader
        stores float32 matmul weights (loader._column_major_matmul_weights), bf16 row-major."""
        n, k = self.shape
        if self.quant is not None:  # float32 row-major
            return self._quant_rows(torch.arange(n))
        blocks = self._blocks()
        if self.layout.endswith("_gated"):  # gate 0, up 0, gate 1, ...: the gates first again
            blocks = blocks.unflatten(0, (-1, 2)).transpose(0, 1).flatten(0, 1)
        if blocks.dim() == 3:
            return blocks.permute(1, 0, 2).reshape(k, n).t()
        return blocks.permute(0, 3, 1, 2, 4).reshape(n, k)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the plain weight (an embedding lookup), read from the packing, in one
        call to csrc/packed_rows.cpp where the kernels run; ids in [0, out), as the engine
        checks them."""
        if self.layout.endswith("_gated"):
            raise ValueError("rows of a gated packing are not looked up")
        if self.quant is not None:
            return self._quant_rows(ids)
        if self.readable and self.data.device.type == "cpu" and unavailable_reason() is None:
            return torch.ops.stallfree.packed_rows(self.data, ids.long(), *self.shape,
                                                   self.layout == "amx")
        return self.rows_by_index(ids)

    def _quant_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of a quantized packing (csrc/quant_panels.h's panels), dequantized to
        float32 [*ids.shape, in]."""
        n, k = self.shape
        flat = ids.reshape(-1)
        rows = torch.ops.stallfree.quant_panel_rows(self.data, flat, n, k, self.quant.code)
        return quant_formats.dequantize(rows, self.quant, k).reshape(*ids.shape, k)

    def rows_by_index(self, ids: torch.Tensor) -> torch.Tensor:
        """`rows` in torch index ops, the reference (a negative id would wrap around)."""
        flat = ids.reshape(-1)
        block, column = flat // BLOCK, flat % BLOCK
        blocks = self._blocks()
        # Index arrays apart from each other put their dimension first: [ids, in...].
        picked = (blocks[block, :, column] if blocks.dim() == 3
                  else blocks[block, :, :, column])
        return picked.reshape(*ids.shape, self.shape[1])
