"""What the emitted module runs beside DDP's forward and backward (issue 13, docs/design.md
"Forward and backward as fast as DDP's"): behaviour, never time.

* a sum returned whole (a loss) is all-reduced once, over the world when its mesh axes span
  it, and waited when its value is read or the backward ends, not in the forward;
* its value and gradient are those of the blocking all-reduce;
* a value summed over several mesh axes in a row (a loss's label count on a 2-D mesh) is one
  collective, issued before the forward's compute.
"""

import io

import pytest
import torch
import torch.distributed as dist

from autoparallel.passes.overlap import overlap_collectives
from autoparallel.runtime_kernels import returned
from autoparallel.runtime_kernels.grad_reduction import PendingSum, deferred_reduced_output, sum_over_axes

_c10d = torch.ops._c10d_functional


def _sum_chain(groups):
    """A graph returning ``x.sum()`` all-reduced over ``groups`` one after the other (as
    apply_plan emits a pending sum made whole over several mesh axes)."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten.sum.default, (x,))
    for group in groups:
        y = g.call_function(_c10d.wait_tensor.default, (g.call_function(_c10d.all_reduce.default, (y, "sum", group)),))
    g.output((g.call_function(returned, (y, 4)),))
    return g


@pytest.mark.parametrize("groups", [("1",), ("1", "2"), ("1", "2", "3")])
def test_returned_sum_over_axes_is_one_deferred_reduction(groups):
    g = _sum_chain(groups)
    stats = overlap_collectives(g)
    assert stats["fused_returned_sums"] == 1 and stats["merged_sums"] == len(groups) - 1, stats
    calls = [n for n in g.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [torch.ops.aten.sum.default, deferred_reduced_output]
    assert calls[-1].args[1:] == (groups, 4)


def test_label_count_over_two_axes_is_one_collective_issued_first():
    """A loss's count of labels reduced over two mesh axes (all_reduce, wait, all_reduce, wait)
    becomes one sum_over_axes issued right after the inputs and waited at the division."""
    g = torch.fx.Graph()
    x, labels = g.placeholder("x"), g.placeholder("labels")
    product = g.call_function(torch.ops.aten.mm.default, (x, g.get_attr("w")))
    part = g.call_function(torch.ops.aten.sum.default, (product,))
    count = g.call_function(torch.ops.aten.sum.default, (g.call_function(torch.ops.aten.ne.Scalar, (labels, -100)),))
    for group in ("1", "2"):
        reduced = g.call_function(_c10d.all_reduce.default, (count, "sum", group))
        count = g.call_function(_c10d.wait_tensor.default, (reduced,))
    g.output((g.call_function(torch.ops.aten.div.Tensor, (part, count)),))
    stats = overlap_collectives(g)
    assert stats["merged_sums"] == 1 and stats["hoisted"] == 1, stats
    calls = [n for n in g.nodes if n.op == "call_function"]
    targets = [n.target for n in calls]
    assert targets.count(sum_over_axes) == 1 and _c10d.all_reduce.default not in targets
    assert targets.count(_c10d.wait_tensor.default) == 1
    assert targets.index(sum_over_axes) < targets.index(torch.ops.aten.mm.default)  # issued before the compute
    assert targets.index(_c10d.wait_tensor.default) == targets.index(torch.ops.aten.div.Tensor) - 1  # waited last
    assert next(n for n in calls if n.target is sum_over_axes).args[1] == ("1", "2")


def test_sum_read_elsewhere_is_left_alone():
    """A collective whose result is also read by another op is not fused (its wait stays)."""
    g = _sum_chain(("1",))
    wait = next(n for n in g.nodes if n.target is _c10d.wait_tensor.default)
    out = next(n for n in g.nodes if n.op == "output")
    with g.inserting_before(out):
        other = g.call_function(torch.ops.aten.neg.default, (wait,))
    out.args = ((out.args[0][0], other),)
    assert overlap_collectives(g)["fused_returned_sums"] == 0


@pytest.fixture
def gloo_world_1(tmp_path):
    """A real 1-rank gloo process group: collectives run asynchronously on gloo's thread."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.FileStore(str(tmp_path / "store"), 1))
    from autoparallel.runtime_kernels import grad_reduction

    yield dist.group.WORLD.group_name
    grad_reduction._wait_in_flight()  # a sum nobody read: waited before the group goes
    dist.destroy_process_group()


def test_deferred_sum_reads_the_reduced_value_and_scales_the_seed(gloo_world_1):
    from autoparallel.runtime_kernels import grad_reduction

    w = torch.randn(5, requires_grad=True)
    loss = deferred_reduced_output((w * w).sum(), (gloo_world_1,), 2)
    assert isinstance(loss, PendingSum) and loss.requires_grad and loss.shape == ()
    assert grad_reduction._IN_FLIGHT  # launched, not waited by the forward
    doubled = loss * 2  # any op reads the reduced value and gives a plain tensor
    assert type(doubled) is torch.Tensor and torch.allclose(doubled, 2 * (w * w).sum())
    assert float(loss) == pytest.approx(float((w * w).sum()))
    want = float((w * w).sum())  # what a training loop prints, logs or saves: the plain value
    assert f"{loss:.4f}" == f"{want:.4f}" and loss.tolist() == pytest.approx(want)
    assert repr(loss).startswith("tensor(")
    buffer = io.BytesIO()
    torch.save({"loss": loss}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)["loss"]
    assert type(saved) is torch.Tensor and float(saved) == pytest.approx(want)
    loss.backward()
    assert torch.allclose(w.grad, 2 * w.detach() / 2)  # seed · world (1) / copies (2)

    w.grad = None
    again = deferred_reduced_output((3 * w).sum(), (gloo_world_1,), 1)
    again.backward()  # nothing read the value: the backward's end waits for it
    assert not grad_reduction._IN_FLIGHT or all(t is again._pending for t in grad_reduction._IN_FLIGHT)
    assert torch.equal(w.grad, torch.full((5,), 3.0))
    assert float(again.detach()) == pytest.approx(float((3 * w).sum()))
    with torch.no_grad():  # no autograd: waited at once, a plain tensor
        assert type(deferred_reduced_output(w.sum(), (gloo_world_1,), 1)) is torch.Tensor


def test_a_second_forward_waits_for_the_unread_sum(gloo_world_1):
    from autoparallel.runtime_kernels import grad_reduction

    w = torch.randn(3, requires_grad=True)
    first = deferred_reduced_output(w.sum(), (gloo_world_1,), 1)
    deferred_reduced_output((2 * w).sum(), (gloo_world_1,), 1)
    assert len(grad_reduction._IN_FLIGHT) == 1 and grad_reduction._IN_FLIGHT[0] is not first._pending
    assert float(first) == pytest.approx(float(w.sum()))
