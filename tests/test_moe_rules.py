"""Mixture-of-experts routing: the records of :mod:`autoparallel.strategies.moe` and the
router's ops in :mod:`autoparallel.strategies.rules` (samples of the ATen ops are in
tests/test_rules.py), Hugging Face's grouped expert matmul against the dense op on simulated
ranks, and tiny Mixtral and Qwen2-MoE models: planned without a fallback, and equal to one
device on (4,) and (2, 2)."""

import pytest
import torch
from torch.distributed.tensor import Partial, Shard

import autoparallel
from autoparallel.placement import R
from autoparallel.strategies import RECORDS, generator
from autoparallel.strategies.coverage import FALLBACK, REGISTRY, RULE
from models import MOE, batch_for, hf_model, to_meta
from test_parity import run_parity
from test_rules import _captured, _check_all_strategies, _int

pytest.importorskip("transformers.integrations.moe")  # defines transformers::grouped_mm_fallback

aten = torch.ops.aten


def _grouped_mm(x, w, offs):
    return torch.ops.transformers.grouped_mm_fallback(x, w, offs)


SAMPLES = {
    # offsets as Hugging Face's experts count them (histc of the sorted expert ids; ids 4 and 5
    # are dropped, so the last rows belong to no expert and stay zero), and given: experts 0 and
    # 2 empty, rows 6 and 7 zero
    "grouped_mm": (lambda x, w, i: (
        _grouped_mm(x, w, torch.histc(i.sort().values.float(), 4, 0, 3).cumsum(0, dtype=torch.int32)),
        _grouped_mm(x, w, torch.tensor([0, 3, 3, 6], dtype=torch.int32))),
        [(8, 16), (4, 16, 12), _int(6, 8)]),
}


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["4", "2x2"])
def test_grouped_mm_every_strategy_matches_the_dense_op(mesh_shape, sim_mesh):
    seen: set = set()
    _check_all_strategies("grouped_mm", mesh_shape, sim_mesh, seen, samples=SAMPLES)
    assert "transformers.grouped_mm_fallback.default" in {str(op) for op in seen}


def test_every_library_op_with_a_record_has_a_sample():
    """Records keyed by a library op's name (tests/test_rules.py covers the ATen ones)."""
    seen = set()
    for fn, specs in SAMPLES.values():
        _, traced = _captured(fn, tuple(specs))
        seen.update(str(n.target) for n in traced.gm.graph.nodes if n.op == "call_function")
    missing = sorted(op for op in RECORDS if isinstance(op, str) and op not in seen)
    assert not missing, f"library ops with a rule but no sample in tests/test_moe_rules.py: {missing}"


def _strategies(fn, specs, target, mesh_shape=(4,)):
    """The strategies and their source of each ``target`` node of ``fn``'s captured graph."""
    _, traced = _captured(fn, tuple(specs))
    return [generator.node_strategies(n, mesh_shape) for n in traced.gm.graph.nodes if n.target == target]


def test_histc_splits_only_over_a_given_range():
    """``min == max`` takes the range from the data (each piece's own): replicated only, though
    ``min`` and ``max`` are passed (DTensor's registry splits whenever they are); a range
    splits every input dim into a Partial count."""
    fn = lambda x: (torch.histc(x.detach(), 4, 0, 0), torch.histc(x.detach(), 4, 1.0, 1.0),  # noqa: E731
                    torch.histc(x.detach(), 4, 0, 1))
    whole, same, ranged = _strategies(fn, [(4, 8)], aten.histc.default)
    for strategies, source in (whole, same):
        assert source == RULE and [s.inputs for s in strategies] == [((R,),)]
    assert ranged[1] == RULE
    assert {(s.inputs, s.outputs) for s in ranged[0]} == {
        (((R,),), ((R,),)), (((Shard(0),),), ((Partial(),),)), (((Shard(1),),), ((Partial(),),))}


def test_scatter_add_and_index_add_split_their_terms_with_self_partial():
    """The terms (index and src along ``dim``) split with ``self`` and the output Partial;
    a dim on which ``src`` is larger than ``index`` stays whole (DTensor's registry splits it)."""
    fn = lambda x, i, s, u: (x.scatter_add(1, i, s), x.scatter_add(1, i, u), x.index_add(1, i[0], s))  # noqa: E731
    specs = [(4, 8), _int(8, 4, 4), (4, 4), (8, 4)]
    (fits, _), (larger, _) = _strategies(fn, specs, aten.scatter_add.default)
    assert {(s.inputs, s.outputs) for s in fits} == {
        (((R,), (R,), (R,)), ((R,),)), (((Shard(0),),) * 3, ((Shard(0),),)),
        (((Partial(),), (Shard(1),), (Shard(1),)), ((Partial(),),)),
        (((Partial(),), (R,), (Partial(),)), ((Partial(),),))}
    assert larger and all(Shard(0) not in s.inputs[2] for s in larger)
    [(index_add, _)] = _strategies(fn, specs, aten.index_add.default)
    assert (((Partial(),), (Shard(0),), (Shard(1),)), ((Partial(),),)) in {(s.inputs, s.outputs) for s in index_add}


@pytest.mark.parametrize("name", sorted(MOE))
def test_moe_plans_without_a_fallback(name):
    """The router (topk, the sort by expert, histc's token counts) and the grouped expert
    matmul take strategies from rules of ours, and nothing runs replicated for want of one."""
    report = autoparallel.coverage(hf_model(name), to_meta(batch_for(name, 0)))
    sources = {}
    for row in report.rows:
        sources.setdefault(row.op, set()).add(row.source)
    assert not any(FALLBACK in s for s in sources.values()), str(report)
    router = ("aten.topk.default", "aten.sort.default", "aten.histc.default")
    for op in router + ("transformers.grouped_mm_fallback.default",):
        assert sources[op] == {RULE}, f"{op}: {sources.get(op)}"
    assert not any(REGISTRY in s for op, s in sources.items() if "grouped_mm" in op or "histc" in op)


@pytest.mark.slow  # 20-45 s each on 2 shared cores
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["4", "2x2"])
@pytest.mark.parametrize("name", sorted(MOE))
def test_moe_parity(name, mesh_shape, sim_mesh):
    """Loss and every gradient equal one device's over two SGD steps, with communication nearly
    free so that the plan splits the experts' matmuls too."""
    pmodel = run_parity(name, mesh_shape, "cheap-comm", sim_mesh, steps=2)
    assert not pmodel.plan.inspection.fallback_ops
    experts = [n for n in pmodel.plan.nodes.values() if "grouped_mm" in n.op]
    assert experts and any(p != R for n in experts for spec in n.input_specs for p in spec), \
        "the plan should split the experts' grouped matmuls"
