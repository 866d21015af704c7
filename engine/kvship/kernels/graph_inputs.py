"""A decode step's inputs written into a CUDA graph's static buffers in one launch.

The step arrives as views of the runner's two packed tensors (token ids, positions, slots as
int64; lengths and the block table as int32). A decode whose input token the step in flight is
still sampling takes it from that step's tokens on the device (``InFlightInputs``). Rows [n, bs)
of a graph of ``bs`` rows become padding (slot -1, length 1, and a hybrid model's recurrent-state
slot the scratch one, which padding rows may overwrite); table columns past the batch's width
keep what they held (kernels read a table only up to its length). ``stage_inputs_torch``
is the reference (some ten small launches); ``stage_inputs_triton`` one kernel, a program a row."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvship.kernels._triton import next_pow2, tl, triton, use_triton


@dataclass
class InFlightInputs:
    """Decode inputs the step in flight is still sampling: input row ``at[i]`` is ``tokens[rows[i]]``."""

    at: torch.Tensor  # [m] int64
    rows: torch.Tensor  # [m] int64
    tokens: torch.Tensor  # the in-flight step's sampled tokens, int64 on the device

    def fill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` with the in-flight rows written in (in place)."""
        return input_ids.index_put_((self.at,), self.tokens.index_select(0, self.rows))


@dataclass
class StaticInputs:
    """A decode graph's input buffers, sized for its largest batch."""

    input_ids: torch.Tensor  # [max_bs] int64
    positions: torch.Tensor  # [max_bs] int64
    slot_mapping: torch.Tensor  # [max_bs] int64
    seq_lens: torch.Tensor  # [max_bs] int32
    block_tables: torch.Tensor  # [max_bs, max_blocks] int32
    state_slots: torch.Tensor | None = None  # [max_bs] int64, hybrid models only
    state_scratch: int = 0  # the recurrent-state slot padding rows read and write


@dataclass
class StepInputs:
    """One decode step as sent: n rows, the table [n, width]."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    in_flight: InFlightInputs | None = None
    state_slots: torch.Tensor | None = None  # [n] int64, hybrid models only


def stage_inputs_torch(dst: StaticInputs, src: StepInputs, bs: int) -> None:
    n, width = src.block_tables.shape
    dst.input_ids[:n].copy_(src.input_ids)
    if src.in_flight is not None:
        src.in_flight.fill(dst.input_ids)
    dst.positions[:n].copy_(src.positions)
    dst.slot_mapping[:n].copy_(src.slot_mapping)
    dst.slot_mapping[n:bs].fill_(-1)
    dst.seq_lens[:n].copy_(src.seq_lens)
    dst.seq_lens[n:bs].fill_(1)
    dst.block_tables[:n, :width].copy_(src.block_tables)
    if dst.state_slots is not None:
        dst.state_slots[:n].copy_(src.state_slots)
        dst.state_slots[n:bs].fill_(dst.state_scratch)


# Each step's sizes vary: specialized on their values (1, multiples of 16), a fresh server would
# compile a variant mid-serving at each new combination.
@triton.jit(do_not_specialize=["n", "width", "num_fix", "stride_bt"])
def _stage_kernel(ids_ptr, pos_ptr, slot_ptr, lens_ptr, bt_ptr, at_ptr, rows_ptr, tok_ptr,
                  s_ids_ptr, s_pos_ptr, s_slot_ptr, s_lens_ptr, s_bt_ptr, state_ptr, s_state_ptr,
                  n, width, num_fix, stride_bt, stride_sbt, scratch,
                  BLOCK_FIX: tl.constexpr, BLOCK_W: tl.constexpr, HAS_STATE: tl.constexpr):
    row = tl.program_id(0)
    if row < n:
        # the row's entry in the fix list, if any (rows are unique there): found by a vector
        # compare rather than scattered by the fix's own program, so no two programs write a row
        f = tl.arange(0, BLOCK_FIX)
        at = tl.load(at_ptr + f, mask=f < num_fix, other=-1)
        src = tl.sum(tl.where(at == row, tl.load(rows_ptr + f, mask=f < num_fix, other=0) + 1, 0), 0) - 1
        token = tl.load(ids_ptr + row)
        if src >= 0:
            token = tl.load(tok_ptr + src)
        tl.store(s_ids_ptr + row, token)
        tl.store(s_pos_ptr + row, tl.load(pos_ptr + row))
        tl.store(s_slot_ptr + row, tl.load(slot_ptr + row))
        tl.store(s_lens_ptr + row, tl.load(lens_ptr + row))
        if HAS_STATE:
            tl.store(s_state_ptr + row, tl.load(state_ptr + row))
        row64 = row.to(tl.int64)
        for c0 in range(0, width, BLOCK_W):
            c = c0 + tl.arange(0, BLOCK_W)
            m = c < width
            tl.store(s_bt_ptr + row64 * stride_sbt + c, tl.load(bt_ptr + row64 * stride_bt + c, mask=m), mask=m)
    else:  # padding: stores nothing, reads one (never stored) token
        tl.store(s_slot_ptr + row, -1)
        tl.store(s_lens_ptr + row, 1)
        if HAS_STATE:
            tl.store(s_state_ptr + row, scratch)


def stage_inputs_triton(dst: StaticInputs, src: StepInputs, bs: int) -> None:
    n, width = src.block_tables.shape
    f = src.in_flight
    m = 0 if f is None else f.at.shape[0]
    fix_at, fix_rows, tokens = (f.at, f.rows, f.tokens) if m else (src.input_ids,) * 3
    has_state = dst.state_slots is not None
    state, s_state = (src.state_slots, dst.state_slots) if has_state else (src.positions, dst.positions)
    _stage_kernel[(bs,)](
        src.input_ids, src.positions, src.slot_mapping, src.seq_lens, src.block_tables, fix_at, fix_rows, tokens,
        dst.input_ids, dst.positions, dst.slot_mapping, dst.seq_lens, dst.block_tables, state, s_state,
        n, width, m, src.block_tables.stride(0), dst.block_tables.stride(0), dst.state_scratch,
        # the fix list holds at most one entry per row of the graph (a power of two: no recompiles per batch)
        BLOCK_FIX=next_pow2(max(dst.input_ids.shape[0], 16)), BLOCK_W=256, HAS_STATE=has_state, num_warps=1,
    )


def stage_inputs(dst: StaticInputs, src: StepInputs, bs: int) -> None:
    """Rows [0, n) of ``dst`` from ``src`` (its sampled inputs filled in), rows [n, bs) as padding."""
    if use_triton(dst.input_ids):
        stage_inputs_triton(dst, src, bs)
    else:
        stage_inputs_torch(dst, src, bs)


def stage_padding(dst: StaticInputs, bs: int) -> None:
    """Rows [0, bs) of ``dst`` as padding: a step of no rows, staged at start-up so that the
    kernel is compiled there and not in a request's first decode step."""
    table = dst.block_tables[:0, :1]
    empty = StepInputs(dst.input_ids[:0], dst.positions[:0], dst.slot_mapping[:0], dst.seq_lens[:0], table,
                       state_slots=None if dst.state_slots is None else dst.state_slots[:0])
    stage_inputs(dst, empty, bs)
