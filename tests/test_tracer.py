"""Tier 1: the tracer's graph and annotations."""

import pytest
import torch

import autoparallel
from autoparallel.errors import CaptureError
from autoparallel.placement import R
from autoparallel.solver import CostModel
from autoparallel.tracer import ColoTracer, node_info
from models import MLP, batch_for, hf_model, to_meta

aten = torch.ops.aten


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_gpt2_graph_keeps_high_level_ops_and_annotations(device):
    pytest.importorskip("transformers")
    with torch.device(device):
        model = hf_model("gpt2")
    before = {n: p.clone() for n, p in model.named_parameters()} if device == "cpu" else None
    traced = ColoTracer().trace(model, to_meta(batch_for("gpt2", 0)))
    targets = {n.target for n in traced.gm.graph.nodes if n.op == "call_function"}
    for op in (aten.addmm.default, aten.linear.default, aten.scaled_dot_product_attention.default,
               aten.layer_norm.default, aten.embedding.default, aten.cross_entropy_loss.default):
        assert op in targets, op
    assert aten._assert_tensor_metadata.default not in targets
    # parameters are get_attr nodes under their names; the tied embedding is one node with both names
    attrs = {n.target for n in traced.gm.graph.nodes if n.op == "get_attr"}
    assert "transformer.h.0.attn.c_attn.weight" in attrs
    tied = [names for names in traced.params.values() if len(names) > 1]
    assert tied and set(tied[0]) == {"transformer.wte.weight", "lm_head.weight"}
    # annotations
    addmm = next(n for n in traced.gm.graph.nodes if n.target == aten.addmm.default)
    info = node_info(addmm)
    (m, n), _ = info.outputs[0]
    k = addmm.args[1].meta["val"].shape[1]
    assert info.flops == 2 * m * k * n
    assert info.bytes == m * n * 4 and info.requires_grad
    assert info.module_path == "transformer.h.0.attn.c_attn"
    if before is not None:  # real weights untouched and still real
        for name, p in model.named_parameters():
            assert p.device.type == "cpu" and torch.equal(p, before[name])


class _NoGradRegion(torch.nn.Module):
    """A rotary-style table computed under ``torch.no_grad()`` (as Llama's rotary embedding was in
    transformers releases before 5.2x), then used by a trained projection."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():
            table = torch.arange(8, dtype=x.dtype, device=x.device).cos()
        return (self.proj(x) * table).sum()


def test_no_grad_region_is_inlined_and_detached():
    traced = ColoTracer().trace(_NoGradRegion(), (torch.empty(4, 8, device="meta"),))
    targets = [n.target for n in traced.gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.higher_order.wrap_with_set_grad_enabled not in targets
    detached = [n for n in traced.gm.graph.nodes if n.target == aten.detach.default]
    assert detached and all(not node_info(n).requires_grad for n in detached)


def test_user_cost_model_changes_the_plan():
    class NoCollectives(CostModel):
        """Collectives are prohibitively slow: the plan must not need any."""

        def collective_time(self, kind, axis, nbytes):
            return 1.0

    pytest.importorskip("transformers")
    with torch.device("meta"):
        model = hf_model("gpt2")
    inputs = to_meta(batch_for("gpt2", 0))
    default = autoparallel.plan(model, inputs, mesh_shape=(4,), cost_model=CostModel("cpu"))
    assert default.collectives
    plan = autoparallel.plan(model, inputs, mesh_shape=(4,), cost_model=NoCollectives("cpu"))
    assert plan.collectives == []


class HuberMLP(MLP):
    """The MLP trained with a Huber loss: an op with no rule and no strategy in DTensor's registry."""

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x))
        return torch.nn.functional.huber_loss(x, y)


def test_coverage_report_lists_every_op_and_its_source():
    report = autoparallel.coverage(HuberMLP(), to_meta(batch_for("mlp", 0)))
    by_op = {r.op: r for r in report.rows}
    assert by_op["aten.linear.default"].source == "rule" and by_op["aten.linear.default"].nodes == 4
    assert by_op["aten.huber_loss.default"].source == "replicate fallback"
    assert report.rows[0].source == "replicate fallback"  # what needs attention comes first
    assert "layers.0" in by_op["aten.linear.default"].modules
    assert report.counts()["replicate fallback"] == 1 and "ops:" in str(report)


def test_mse_loss_is_decomposed_into_ops_with_rules():
    """F.mse_loss captures as broadcast_tensors + mse_loss, neither with a split strategy: the
    tracer rewrites them into expand, sub, mul and mean (autoparallel.tracer.decompose)."""
    traced = ColoTracer().trace(MLP(), to_meta(batch_for("mlp", 0)))
    targets = {n.target for n in traced.gm.graph.nodes if n.op == "call_function"}
    assert not targets & {aten.mse_loss.default, aten.broadcast_tensors.default}
    assert {aten.sub.Tensor, aten.mul.Tensor, aten.mean.default} <= targets
    assert not autoparallel.coverage(MLP(), to_meta(batch_for("mlp", 0))).counts().get("replicate fallback")


@pytest.mark.slow  # 4-15 s: in the full tier (make test), not the everyday one
def test_cli_plan_and_coverage(tmp_path, capsys):
    pytest.importorskip("transformers")
    from autoparallel.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama", "--mesh", "2x2", "--cost-model", "cpu", "--json", str(out)]) == 0
    assert "estimated step" in capsys.readouterr().out
    plan = autoparallel.Plan.from_json(out.read_text())
    assert plan.mesh.shape == (2, 2)
    assert main(["coverage", "--model", "bert"]) == 0
    assert "aten.scaled_dot_product_attention.default" in capsys.readouterr().out


class _Masked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 16))

    def forward(self, x):
        return self.w[x > 0].sum()


class _HasMasked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Masked()

    def forward(self, x):
        return self.inner(x)


def test_boolean_mask_indexing_is_a_clear_capture_error():
    """x[mask] has a shape that depends on values: a CaptureError naming the node, op and
    module path and what to write instead (it was a raw GuardOnDataDependentSymNode)."""
    with pytest.raises(CaptureError) as err:
        autoparallel.plan(_HasMasked(), (torch.empty(4, 16, device="meta"),), mesh_shape=(2,), cache_dir=False)
    msg = str(err.value)
    assert "node index (aten.index.Tensor, module inner)" in msg and "depends on tensor values" in msg
    assert "torch.where(mask, x, 0)" in msg


class _ItemScaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 16))

    def forward(self, x):
        return (x * self.w.sum().item() + self.w).sum()


def test_item_as_a_scalar_multiplier_plans():
    """.item() produces no tensor: it saves nothing for backward in the memory model (it was
    `KeyError: item`) and reads its input replicated (checked numerically in test_rules)."""
    plan = autoparallel.plan(_ItemScaled(), (torch.empty(4, 16, device="meta"),), mesh_shape=(2,), cache_dir=False)
    assert plan.nodes["item"].input_specs == [(R,)] and plan.nodes["item"].output_specs == []
    assert plan.estimate.memory.breakdown.activations == 0
