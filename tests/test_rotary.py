"""Rotary embeddings' ``rotate_half(x) * sin`` is captured as ``roll(x) * signed sin``
(autoparallel/tracer/rotary.py): bitwise the same values; only the exact pattern is rewritten;
the loss and every gradient still equal one device's."""

import copy

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import autoparallel
from autoparallel.tracer import ColoTracer
from autoparallel.tracer.rotary import roll_rotate_half
from models import to_meta
from test_parity import train_side_by_side

aten = torch.ops.aten


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def not_rotate_half(x):  # the halves in the other order: not a roll by h with the sign on the lower half
    h = x.shape[-1] // 2
    return torch.cat((x[..., :h], -x[..., h:]), dim=-1)


class Rope(torch.nn.Module):
    """Queries of 2 heads of 8 rotated by a position table ``[1, 1, seq, 8]`` (``sin_width`` 1:
    a table broadcast along the last dim); ``read_rotated`` also adds the rotated queries to
    the output (a user of ``rotate_half`` that is not a product)."""

    def __init__(self, rotate=rotate_half, sin_width=8, read_rotated=False):
        super().__init__()
        self.rotate, self.sin_width, self.read_rotated = rotate, sin_width, read_rotated
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.proj(x).view(b, s, 2, 8).transpose(1, 2)
        pos = torch.arange(s, dtype=x.dtype, device=x.device)[:, None] * torch.ones(self.sin_width, device=x.device)
        cos, sin = pos.cos()[None, None], pos.sin()[None, None]
        rotated = self.rotate(q)
        out = q * cos + rotated * sin
        if self.read_rotated:
            out = out + rotated
        return out.square().mean()


def _ops(model, example):
    traced = ColoTracer().trace(model, to_meta(example))
    return [n.target for n in traced.gm.graph.nodes if n.op == "call_function"]


def test_rotate_half_is_captured_as_a_roll():
    ops = _ops(Rope(), {"x": torch.randn(2, 6, 16)})
    assert ops.count(aten.roll.default) == 1
    assert ops.count(aten.neg.default) == 1  # on the sin table only
    assert ops.count(aten.cat.default) == 1


@pytest.mark.parametrize("model", [Rope(rotate=not_rotate_half), Rope(sin_width=1), Rope(read_rotated=True)],
                         ids=["other-halves", "sin-broadcast", "rotated-read-elsewhere"])
def test_look_alikes_are_left_as_they_are(model):
    ops = _ops(model, {"x": torch.randn(2, 6, 16)})
    assert aten.roll.default not in ops


def test_rewrite_keeps_every_value_bitwise():
    """The rewritten graph returns the same values and input gradient, bit for bit."""
    def rope(x, cos, sin):
        return x * cos + rotate_half(x) * sin

    torch.manual_seed(0)
    x, cos, sin = torch.randn(2, 3, 6, 8), torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    gm = make_fx(rope, tracing_mode="fake")(x, cos, sin)
    before = copy.deepcopy(gm)
    assert roll_rotate_half(gm.graph) == 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    assert aten.roll.default in [n.target for n in gm.graph.nodes]
    grad = torch.randn(2, 3, 6, 8)
    outs = []
    for module in (before, gm):
        xi = x.clone().requires_grad_()
        out = module(xi, cos, sin)
        outs.append((out, *torch.autograd.grad(out, xi, grad)))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_rope_trains_as_on_one_device(sim_mesh):
    torch.manual_seed(0)
    ref = Rope()
    batches = [{"x": torch.randn(4, 6, 16)} for _ in range(2)]
    mesh = sim_mesh((2,))
    ranks = frozenset(range(mesh.size()))
    with LocalTensorMode(ranks):
        pmodel = autoparallel.autoparallelize(copy.deepcopy(ref), to_meta(batches[0]), device_mesh=mesh,
                                              cost_model=autoparallel.CostModel("cpu"))
    assert aten.roll.default in [n.target for n in pmodel.graph_module.graph.nodes]
    train_side_by_side(ref, pmodel, batches, ranks, loss=lambda out: out)
