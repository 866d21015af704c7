"""The decode graphs' input staging kernel (kernels/graph_inputs.py) against its torch reference:
rows as sent, in-flight inputs taken from the previous step's tokens, padding rows, a table
narrower than the graph's (its other columns untouched), a hybrid model's recurrent-state slots
(padding rows on the scratch slot), and the eager ``fill`` the other paths use. In the
interpreter on CPU, on the device with a GPU; and compiled for sm_90."""
from __future__ import annotations

import pytest
import torch

from kvship.kernels import graph_inputs as gi
from kvship.kernels._triton import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _static(max_bs: int, max_blocks: int, g: torch.Generator) -> gi.StaticInputs:
    """Buffers holding an earlier step's values (junk the staging must overwrite or leave alone)."""
    def junk(*shape, dtype):
        return torch.randint(-5, 1000, shape, generator=g, dtype=dtype).to(DEV)
    return gi.StaticInputs(junk(max_bs, dtype=torch.int64), junk(max_bs, dtype=torch.int64),
                           junk(max_bs, dtype=torch.int64), junk(max_bs, dtype=torch.int32),
                           junk(max_bs, max_blocks, dtype=torch.int32))


def _step(n: int, width: int, fix: list[tuple[int, int]], g: torch.Generator) -> gi.StepInputs:
    ids = torch.randint(0, 50_000, (n,), generator=g)
    for at, _ in fix:
        ids[at] = 0  # what prepare leaves where the input is in flight
    tokens = torch.randint(0, 50_000, (max([r for _, r in fix], default=0) + 3,), generator=g)
    in_flight = gi.InFlightInputs(torch.tensor([a for a, _ in fix], dtype=torch.int64).to(DEV),
                                  torch.tensor([r for _, r in fix], dtype=torch.int64).to(DEV),
                                  tokens.to(DEV)) if fix else None
    return gi.StepInputs(ids.to(DEV), torch.randint(0, 8000, (n,), generator=g).to(DEV),
                         torch.randint(0, 10**6, (n,), generator=g).to(DEV),
                         torch.randint(1, 8000, (n,), generator=g, dtype=torch.int32).to(DEV),
                         torch.randint(0, 4000, (n, width), generator=g, dtype=torch.int32).to(DEV), in_flight)


@pytest.mark.parametrize("n,bs,width,fix", [
    (1, 1, 3, [(0, 0)]),  # batch 1 in steady state: its input is the in-flight step's token
    (1, 1, 1, []),  # the first decode after a prefill read on the host
    (5, 8, 7, [(0, 2), (3, 0), (4, 4)]),  # padding rows, rows out of order in the previous step
    (16, 16, 300, [(i, 15 - i) for i in range(16)]),  # a table wider than one BLOCK_W chunk
    (3, 16, 2, []),
    (0, 8, 1, []),  # no rows: what the graphs stage at start-up (stage_padding), all padding
])
def test_stage_matches_reference(n, bs, width, fix):
    g = torch.Generator().manual_seed(n * 1000 + bs + width)
    dst_ref = _static(32, 320, g)
    dst = gi.StaticInputs(*(t.clone() for t in (dst_ref.input_ids, dst_ref.positions, dst_ref.slot_mapping,
                                                  dst_ref.seq_lens, dst_ref.block_tables)))
    before = dst.block_tables.clone()
    src = _step(n, width, fix, g)
    gi.stage_inputs_torch(dst_ref, src, bs)
    gi.stage_inputs_triton(dst, src, bs)
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables"):
        assert torch.equal(getattr(dst, name), getattr(dst_ref, name)), name
    # what the reference itself must have done
    want_ids = src.input_ids.clone()
    for at, row in fix:
        want_ids[at] = src.in_flight.tokens[row]
    assert torch.equal(dst.input_ids[:n], want_ids)
    assert (dst.slot_mapping[n:bs] == -1).all() and (dst.seq_lens[n:bs] == 1).all()
    assert torch.equal(dst.block_tables[:n, :width], src.block_tables)
    assert torch.equal(dst.block_tables[:, width:], before[:, width:])  # columns past the batch's width
    assert torch.equal(dst.input_ids[bs:], dst_ref.input_ids[bs:])  # rows past the graph untouched


@pytest.mark.parametrize("n,bs", [(1, 1), (5, 8), (3, 16)])
def test_stage_state_slots_pad_to_the_scratch_slot(n, bs):
    """A hybrid model's graph: rows [0, n) take the sequences' state slots, padding rows the
    scratch slot (whatever an earlier, larger step left there), rows past the graph untouched."""
    g = torch.Generator().manual_seed(n + bs)
    scratch = 41
    dsts = []
    for _ in range(2):
        dst = _static(32, 8, torch.Generator().manual_seed(5))
        dst.state_slots, dst.state_scratch = torch.arange(100, 132, device=DEV), scratch
        dsts.append(dst)
    src = _step(n, 3, [], g)
    src.state_slots = torch.randperm(40, generator=g)[:n].to(DEV)
    gi.stage_inputs_torch(dsts[0], src, bs)
    gi.stage_inputs_triton(dsts[1], src, bs)
    for dst in dsts:
        assert torch.equal(dst.state_slots[:n], src.state_slots)
        assert (dst.state_slots[n:bs] == scratch).all()
        assert torch.equal(dst.state_slots[bs:], torch.arange(100 + bs, 132, device=DEV))


def test_fill_writes_in_flight_rows():
    g = torch.Generator().manual_seed(7)
    src = _step(4, 2, [(1, 2), (3, 0)], g)
    ids = src.input_ids.clone()
    out = src.in_flight.fill(ids)
    assert out.data_ptr() == ids.data_ptr()  # in place: the ids are the step's own fresh buffer
    t = src.in_flight.tokens
    assert out.tolist() == [src.input_ids[0].item(), t[2].item(), src.input_ids[2].item(), t[0].item()]


def test_stage_kernel_compiles_for_sm90():
    from sm90_compile import compile_in_child, ints
    types = {**{k: "*i64" for k in ("ids_ptr", "pos_ptr", "slot_ptr", "at_ptr", "rows_ptr", "tok_ptr",
                                    "s_ids_ptr", "s_pos_ptr", "s_slot_ptr", "state_ptr", "s_state_ptr")},
             **{k: "*i32" for k in ("lens_ptr", "bt_ptr", "s_lens_ptr", "s_bt_ptr")},
             **ints("n", "width", "num_fix", "stride_bt", "stride_sbt", "scratch")}
    compile_in_child([{"kernel": "kvship.kernels.graph_inputs:_stage_kernel", "types": types,
                       "constexprs": {"BLOCK_FIX": 512, "BLOCK_W": 256, "HAS_STATE": has_state},
                       "options": {"num_warps": 1}} for has_state in (False, True)])


def test_stage_padding_marks_rows_as_padding_and_leaves_the_rest():
    g = torch.Generator().manual_seed(7)
    dst = _static(16, 4, g)
    before = [t.clone() for t in (dst.input_ids, dst.slot_mapping, dst.seq_lens, dst.block_tables)]
    gi.stage_padding(dst, 8)
    assert torch.equal(dst.slot_mapping[:8].cpu(), torch.full((8,), -1)) and torch.equal(dst.slot_mapping[8:], before[1][8:])
    assert torch.equal(dst.seq_lens[:8].cpu(), torch.ones(8, dtype=torch.int32)) and torch.equal(dst.seq_lens[8:], before[2][8:])
    assert torch.equal(dst.input_ids, before[0]) and torch.equal(dst.block_tables, before[3])
