"""The checkpoint pass on its own: nested regions recompute as scheduled and change no number."""

import pytest
import torch
import torch.fx as fx

from autoparallel.passes.checkpoint import apply_checkpointing
from autoparallel.plan import Region

CALLS = {"n": 0}


@fx.wrap
def counted_tanh(x):
    CALLS["n"] += 1
    return torch.tanh(x)


class LinearLayers(torch.nn.Module):
    def __init__(self, n=6, width=16):
        super().__init__()
        self.w = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(width, width) / 4) for _ in range(n)])

    def forward(self, x):
        for w in self.w:
            x = counted_tanh(x @ w) + x
        return x.pow(2).sum()


def _traced(seed=0):
    torch.manual_seed(seed)
    model = LinearLayers()
    gm = fx.symbolic_trace(model)
    ops = [n for n in gm.graph.nodes if n.op == "call_function" or n.op == "call_method"]
    stage_of = {n: i // 3 for i, n in enumerate(ops[:18])}  # matmul, tanh, add per layer
    return model, gm, stage_of


@pytest.mark.parametrize("regions, runs", [
    ((), 6),
    ((Region(1, 5),), 6 + 4),
    ((Region(0, 1), Region(3, 6)), 6 + 1 + 3),
    ((Region(1, 5, (Region(2, 4),)),), 6 + 4 + 2),
    ((Region(1, 2, selective=True), Region(3, 6, (Region(4, 5, selective=True),))), 6 + 1 + 3 + 1),
])
def test_nested_regions_recompute_and_keep_gradients(regions, runs):
    model, gm, stage_of = _traced()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    model(x).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    apply_checkpointing(gm, stage_of, regions)
    assert gm.code.count("checkpoint(") == len(regions)
    assert gm.code.count("selective_checkpoint(") == sum(r.selective for r in regions)
    CALLS["n"] = 0
    gm(x).backward()
    assert CALLS["n"] == runs
    for p, g in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, g)


def test_checkpointing_saves_memory():
    def saved_bytes(gm, x):
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            gm(x)
        return total[0]

    x = torch.randn(64, 16)
    _, plain, _ = _traced()
    _, ck, stage_of = _traced()
    apply_checkpointing(ck, stage_of, [Region(i, i + 1) for i in range(6)])
    assert saved_bytes(ck, x) < saved_bytes(plain, x)


def test_selective_regions_keep_matmul_outputs_and_recompute_the_rest():
    """A selective stage runs its tanh again in the backward but not its matmul (its output
    comes from the selective cache); a full region runs both again."""
    def run(regions):
        _, gm, stage_of = _traced()
        apply_checkpointing(gm, stage_of, regions)
        mms = []

        class CountMM(torch.utils._python_dispatch.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten.mm.default:
                    mms.append(func)
                return func(*args, **(kwargs or {}))

        CALLS["n"] = 0
        with CountMM():
            gm(torch.randn(64, 16)).backward()
        return CALLS["n"], len(mms)

    every = range(6)
    tanh_plain, mm_plain = run(())
    tanh_sel, mm_sel = run([Region(i, i + 1, selective=True) for i in every])
    tanh_full, mm_full = run([Region(i, i + 1) for i in every])
    assert (tanh_plain, tanh_sel, tanh_full) == (6, 12, 12)
    assert mm_sel == mm_plain == mm_full - 6


def test_region_interleaved_with_a_reader_is_refused():
    _, gm, stage_of = _traced()
    ops = [n for n in gm.graph.nodes if n in stage_of]
    stage_of[ops[4]] = 5  # block 1's tanh belongs to a later stage, yet block 1's add reads it
    with pytest.raises(ValueError, match="not contiguous"):
        apply_checkpointing(gm, stage_of, [Region(1, 2)])


def test_single_op_regions():
    model, gm, stage_of = _traced()
    x = torch.randn(8, 16)
    model(x).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ops = [n for n in gm.graph.nodes if n in stage_of]
    one_op = {n: i for i, n in enumerate(ops)}  # every op its own stage and region
    apply_checkpointing(gm, one_op, [Region(i, i + 1) for i in range(len(ops))])
    gm(x).backward()
    for p, g in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, g)
