"""Compute costs of single ops (solver/costs.py ``compute_time``, the planner's node costs):
SDPA's FLOPs and rate, views that move no data, a pointwise backward per gradient it computes,
autograd's accumulation of a gradient over several uses, and the measured step efficiency."""

import pytest
import torch
import torch.nn.functional as F

import autoparallel
from autoparallel.solver.costs import CostModel, DevicePreset
from autoparallel.tracer import ColoTracer
from autoparallel.tracer.annotate import node_info

aten = torch.ops.aten
O = 1e-6  # op overhead of the test device
BW = 1e9  # its bytes/s
DEVICE = DevicePreset("test", 1e15, 1e15, BW, 2**30, op_overhead=O)


class Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def test_sdpa_flops_are_counted_with_grouped_kv_heads():
    """4·B·Hq·S²·D (two products), for 4 query heads over 2 key/value heads; FlopCounterMode
    alone gives 0 for the CPU kernel SDPA dispatches to."""
    meta = tuple(torch.empty(s, device="meta") for s in ((2, 4, 16, 8), (2, 2, 16, 8), (2, 2, 16, 8)))
    traced = ColoTracer().trace(Attention(), meta)
    sdpa = next(n for n in traced.gm.graph.nodes if n.target is aten.scaled_dot_product_attention.default)
    assert node_info(sdpa).flops == 4 * 2 * 4 * 16 * 16 * 8


def test_sdpa_runs_at_attention_efficiency_with_a_heavier_backward():
    sdpa = aten.scaled_dot_product_attention.default
    cm = CostModel(DevicePreset("d", 1e12, 1e12, 1e15, 2**30, attention_efficiency=0.5))
    assert cm.compute_time(sdpa, 1e9, 0, torch.float32, False) == pytest.approx(2e-3)
    assert cm.compute_time(sdpa, 1e9, 0, torch.float32, True) == pytest.approx(2e-3 * 3.5)


def test_step_efficiency_divides_every_op():
    mm, mul = aten.mm.default, aten.mul.Tensor
    base = CostModel(DevicePreset("d", 1e12, 1e12, 1e11, 2**30, op_overhead=O))
    slow = CostModel(DevicePreset("d", 1e12, 1e12, 1e11, 2**30, op_overhead=O, step_efficiency=0.8))
    for op in (mm, mul):
        assert slow.compute_time(op, 1e9, 1e6, torch.float32, True) == \
            pytest.approx(base.compute_time(op, 1e9, 1e6, torch.float32, True) / 0.8)
    assert DevicePreset.from_json(slow.device.to_json()) == slow.device


def test_experts_efficiency_divides_the_routed_experts_op_only():
    """The routed experts' op is priced as a matmul of its FLOPs over ``experts_efficiency``
    (its sorts, gathers and small per-expert products run below a GEMM's rate); every other
    op is priced as before."""
    from autoparallel.runtime_kernels.experts import ROUTED_EXPERTS

    base = CostModel(DevicePreset("d", 1e12, 1e12, 1e11, 2**30, op_overhead=O, step_efficiency=0.8))
    slow = CostModel(DevicePreset("d", 1e12, 1e12, 1e11, 2**30, op_overhead=O, step_efficiency=0.8,
                                  experts_efficiency=0.5))
    for grads in (False, True):
        assert slow.compute_time(ROUTED_EXPERTS, 1e9, 1e6, torch.float32, grads) == \
            pytest.approx(2 * base.compute_time(ROUTED_EXPERTS, 1e9, 1e6, torch.float32, grads))
    assert slow.compute_time(aten.mm.default, 1e9, 1e6, torch.float32, True) == \
        base.compute_time(aten.mm.default, 1e9, 1e6, torch.float32, True)
    assert DevicePreset.from_json(slow.device.to_json()) == slow.device


@pytest.mark.parametrize("field", ["attention_efficiency", "step_efficiency", "experts_efficiency"])
def test_efficiencies_must_be_positive(field):
    with pytest.raises(ValueError, match=f"{field} must be positive"):
        DevicePreset("d", 1e12, 1e12, 1e11, 2**30, **{field: 0.0})


class Ops(torch.nn.Module):
    """``h = x @ w`` read three times (a view and both operands of a square), a view that moves
    no data, a reshape of a transposed view that copies, and a sum."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 64))

    def forward(self, x):
        h = x @ self.w
        t = h.view(32, 8, 8).transpose(1, 2).reshape(32, 64)
        return (t + h * h).sum()


def _node_costs():
    plan = autoparallel.plan(Ops(), (torch.empty(32, 64, device="meta"),), mesh_shape=(1,),
                             cost_model=CostModel(DEVICE), cache_dir=False)
    return {n.op: n.compute_s for n in plan.nodes.values()}


def test_views_that_move_no_data_cost_their_calls_only():
    costs = _node_costs()
    assert costs["view.default"] == pytest.approx(2 * O)  # forward and backward calls
    assert costs["transpose.int"] == pytest.approx(2 * O)
    nbytes = 32 * 64 * 4
    assert costs["reshape.default"] == pytest.approx(2 * (2 * nbytes / BW + O))  # a copy, both ways


def test_pointwise_backward_and_gradient_accumulation():
    """``h * h`` computes a gradient for each operand (two backward calls); ``h`` is read three
    times, so autograd adds its gradient twice; ``t + h*h`` passes its gradient on as it is."""
    costs = _node_costs()
    nbytes = 32 * 64 * 4
    fwd = 3 * nbytes / BW + O
    assert costs["mul.Tensor"] == pytest.approx(3 * fwd)
    assert costs["add.Tensor"] == pytest.approx(fwd)
    matmul = max(2 * 32 * 64 * 64 / 1e15, (64 * 64 * 4 + 2 * nbytes) / BW) + O  # x @ w, memory-bound here
    assert costs["matmul.default"] == pytest.approx(3 * matmul + 2 * fwd)
