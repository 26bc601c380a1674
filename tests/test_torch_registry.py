"""Strategies from DTensor's sharding registry (autoparallel.strategies.torch_registry).

The adapter reads private torch API: these tests fail loudly when a torch upgrade moves it
(every op of the model zoo is asked, and ops known to be registered must get split
strategies), check every registry strategy of ops we have no rule for on simulated ranks
against the dense op (the harness of tests/test_rules.py), and check the generator and
coverage report use the registry between our rules and the replicate fallback.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from autoparallel.errors import ShardingRuleError
from autoparallel.placement import R
from autoparallel.strategies import StrategyGenerator
from autoparallel.strategies.coverage import coverage_of
from autoparallel.strategies.records import RECORDS
from autoparallel.strategies.rules import REPLICATE_ONLY
from autoparallel.strategies.torch_registry import registry_strategies
from autoparallel.tracer import ColoTracer
from models import FAMILIES, TIMM, batch_for, build_model, to_meta
from test_rules import _bool, _check_all_strategies, _int

aten = torch.ops.aten
MESHES = [(4,), (2, 2)]
ZOO = ["mlp", "cnn", "gpt2", "llama", "bert", "t5"] + sorted(FAMILIES) + sorted(TIMM)

# ops of the zoo that DTensor registers with split strategies (ours or not)
KNOWN_REGISTERED = {aten.addmm.default, aten.add.Tensor, aten.gelu.default, aten.mul.Tensor,
                    aten.permute.default, aten.transpose.int, aten.embedding.default, aten.min.other,
                    aten.masked_fill_.Scalar, aten.add_.Tensor}


def _split(strategies, mesh_shape):
    repl = (R,) * len(mesh_shape)
    return [s for s in strategies or [] if any(x != repl for x in s.inputs + s.outputs)]


@pytest.fixture(scope="module")
def zoo_graphs():
    pytest.importorskip("transformers")
    pytest.importorskip("timm")
    graphs = {}
    for name in ZOO:
        with torch.device("meta"):
            model = build_model(name)
        graphs[name] = ColoTracer().trace(model, to_meta(batch_for(name, 0))).gm
    return graphs


@pytest.mark.slow  # 4-15 s: in the full tier (make test), not the everyday one
def test_every_zoo_op_asks_the_registry(zoo_graphs):
    pg_before = dist.is_initialized()
    best: dict = {}  # op → mesh → most split strategies over its nodes (-1: no registry entry)
    nodes = 0
    for gm in zoo_graphs.values():
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            nodes += 1
            for mesh_shape in MESHES:
                got = registry_strategies(node, mesh_shape)
                n = -1 if got is None else len(_split(got, mesh_shape))
                per_op = best.setdefault(node.target, {})
                per_op[mesh_shape] = max(per_op.get(mesh_shape, -1), n)
    registered = sorted(str(op) for op, v in best.items() if max(v.values()) > 0)
    without_rule = sorted(str(op) for op, v in best.items()
                          if max(v.values()) > 0 and op not in RECORDS and op not in REPLICATE_ONLY)
    print(f"\n{nodes} op nodes, {len(best)} ops; split strategies from the registry for {len(registered)}; "
          f"ops without our rule among them: {without_rule}")
    assert KNOWN_REGISTERED <= set(best), "the zoo no longer uses these ops: update KNOWN_REGISTERED"
    for op in KNOWN_REGISTERED:
        for mesh_shape in MESHES:
            assert best[op][mesh_shape] > 0, f"{op} on {mesh_shape}: no split strategy from DTensor's registry"
    assert len(registered) >= 30
    assert dist.is_initialized() == pg_before, "the adapter must not initialize a process group"


def test_strategy_shapes_and_order():
    """Inputs in tensor_inputs order, one spec per mesh axis, evenly split; cached."""

    class Scatter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.src = torch.nn.Parameter(torch.randn(4, 3))
            self.register_buffer("idx", torch.randint(0, 8, (4, 3)))
            self.x = torch.nn.Parameter(torch.randn(4, 8))

        def forward(self):
            return self.x.scatter_add(1, self.idx, self.src)

    gm = ColoTracer().trace(Scatter(), ()).gm
    node = next(n for n in gm.graph.nodes if n.target == aten.scatter_add.default)
    for mesh_shape in MESHES:
        got = registry_strategies(node, mesh_shape)
        assert got is registry_strategies(node, mesh_shape)
        assert _split(got, mesh_shape)
        for s in got:
            assert len(s.inputs) == 3 and len(s.outputs) == 1
            assert all(len(spec) == len(mesh_shape) for spec in s.inputs + s.outputs)
            # scatter_add keeps dim 0 aligned across self, index, src and the output
            assert s.inputs[0] == s.inputs[1] == s.inputs[2] == s.outputs[0]
    assert registry_strategies(next(n for n in gm.graph.nodes if n.op == "get_attr"), (4,)) is None


REGISTRY_SAMPLES = {
    # pointwise (single-dim rules), with broadcasting
    "min_other": (lambda a, b: torch.min(a, b), [(8, 16), (16,)]),
    "atan2": (lambda a, b: torch.atan2(a, b), [(4, 8), (8,)]),
    "logaddexp_xlogy": (lambda a, b: torch.logaddexp(a, b) * torch.xlogy(a, b.abs()), [(4, 8), (4, 8)]),
    # in place (the output is the written tensor)
    "add_": (lambda a, b: (a * 2).add_(b), [(4, 8), (4, 8)]),
    "masked_fill_": (lambda a, m: (a * 2).masked_fill_(m, 0.5), [(4, 8), _bool(4, 8)]),
    "copy_": (lambda a, b: (a * 2).copy_(b), [(4, 8), (4, 8)]),
    # strategy functions: multi-output, scans, index inputs, contraction, repeat, norms
    "kthvalue": (lambda a: torch.kthvalue(a, 3, dim=1).values, [(4, 8, 6)]),
    "cummax": (lambda a: torch.cummax(a, 1).values, [(4, 8)]),
    "logcumsumexp": (lambda a: torch.logcumsumexp(a, 1), [(4, 8)]),
    "dot": (lambda a, b: torch.dot(a, b), [(16,), (16,)]),
    "repeat": (lambda a: a.repeat(2, 1, 3), [(4, 8)]),
    "vector_norm": (lambda a: torch.linalg.vector_norm(a, dim=1), [(4, 8)]),
}
REGISTRY_TARGETS = {"min_other": {aten.min.other}, "atan2": {aten.atan2.default},
                    "logaddexp_xlogy": {aten.logaddexp.default, aten.xlogy.Tensor},
                    "add_": {aten.add_.Tensor}, "masked_fill_": {aten.masked_fill_.Scalar},
                    "copy_": {aten.copy_.default}, "kthvalue": {aten.kthvalue.default}, "cummax": {aten.cummax.default},
                    "logcumsumexp": {aten.logcumsumexp.default},
                    "dot": {aten.dot.default}, "repeat": {aten.repeat.default},
                    "vector_norm": {aten.linalg_vector_norm.default}}


@pytest.mark.parametrize("mesh_shape", MESHES, ids=["4", "2x2"])
@pytest.mark.parametrize("name", sorted(REGISTRY_SAMPLES))
def test_every_registry_strategy_matches_the_dense_op(name, mesh_shape, sim_mesh):
    targets = REGISTRY_TARGETS[name]
    assert not targets & set(RECORDS), f"{name}: we have a rule now; pick another op without one"
    seen: set = set()
    gen = _check_all_strategies(name, mesh_shape, sim_mesh, seen, samples=REGISTRY_SAMPLES)
    assert targets <= seen
    assert {str(op) for op in targets} <= set(gen.registry_ops), f"{name}: not from the registry"


class LogAddExp(torch.nn.Module):
    def __init__(self, loss=False):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(8, 16))
        self.b = torch.nn.Parameter(torch.randn(8, 16))
        self.loss = loss

    def forward(self):
        y = torch.logaddexp(self.a, self.b)
        return F.huber_loss(y, self.b) if self.loss else y


def test_generator_and_coverage_use_the_registry():
    gm = ColoTracer().trace(LogAddExp(), ()).gm
    node = next(n for n in gm.graph.nodes if n.target == aten.logaddexp.default)
    gen = StrategyGenerator((4,), strict=True)
    strategies = gen.generate(gm)  # no rule of ours, but DTensor's: strict does not raise
    assert len(_split(strategies[node], (4,))) >= 2
    assert dict(gen.registry_ops) == {"aten.logaddexp.default": {""}} and not gen.fallbacks
    row = next(r for r in coverage_of(gm).rows if r.op == "aten.logaddexp.default")
    assert row.source == "torch registry" and row.nodes == 1
    assert "torch registry" in str(coverage_of(gm))

    # huber_loss has no rule and no registry entry: still a replicate fallback, and strict names only it
    gm = ColoTracer().trace(LogAddExp(loss=True), ()).gm
    with pytest.raises(ShardingRuleError) as err:
        StrategyGenerator((4,), strict=True).generate(gm)
    assert "aten.huber_loss.default" in str(err.value) and "logaddexp" not in str(err.value)
    rows = coverage_of(gm).rows
    assert [r.source for r in rows] == ["replicate fallback", "torch registry", "rule"]
