"""Mixture-of-experts routing: the records of :mod:`autoparallel.strategies.moe` and the
router's ops in :mod:`autoparallel.strategies.rules` (samples of the ATen ops are in
tests/test_rules.py), Hugging Face's grouped expert matmul and the routed experts captured as
one op against the dense op on simulated ranks, and tiny Mixtral, Qwen2-MoE (a shared expert)
and DeepSeek-V3 (shared and routed experts, top-4) models: planned without a fallback, and
equal to one device on (4,) and (2, 2), with the planner's choice and with expert parallelism
forced."""

import re

import pytest
import torch
from torch.distributed.tensor import Partial, Shard

import autoparallel
from autoparallel.placement import R
from autoparallel.runtime_kernels.experts import ROUTED_EXPERTS
from autoparallel.strategies import RECORDS, generator
from autoparallel.strategies.coverage import FALLBACK, RULE
from models import EXPERT_PARALLEL, MOE, batch_for, hf_model, to_meta
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
    # 16 tokens of width 8, top-2 of 4 experts (a token may pick one expert twice), I = 6
    "routed_experts": (lambda x, i, w, gate_up, down: ROUTED_EXPERTS(x, i, w.softmax(-1), gate_up, down, "silu"),
                       [(16, 8), _int(4, 16, 2), (16, 2), (4, 12, 8), (4, 8, 6)]),
}


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["4", "2x2"])
def test_grouped_mm_every_strategy_matches_the_dense_op(mesh_shape, sim_mesh):
    seen: set = set()
    _check_all_strategies("grouped_mm", mesh_shape, sim_mesh, seen, samples=SAMPLES)
    assert "transformers.grouped_mm_fallback.default" in {str(op) for op in seen}


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["4", "2x2"])
def test_routed_experts_every_strategy_matches_the_dense_op(mesh_shape, sim_mesh):
    """Every role per axis (replicated, tokens split, expert parallel with all-to-all, experts
    split with a partial output), alone and combined on (2, 2): outputs and gradients."""
    seen: set = set()
    _check_all_strategies("routed_experts", mesh_shape, sim_mesh, seen, samples=SAMPLES)
    assert ROUTED_EXPERTS in seen


def test_every_op_outside_aten_with_a_record_has_a_sample():
    """Records of ops outside ATen: a library's, keyed by name, and ours (tests/test_rules.py
    covers the ATen ones)."""
    seen = set()
    for fn, specs in SAMPLES.values():
        _, traced = _captured(fn, tuple(specs))
        seen.update(str(n.target) for n in traced.gm.graph.nodes if n.op == "call_function")
    outside = [op for op in RECORDS if isinstance(op, str) or op.namespace != "aten"]
    missing = sorted(str(op) for op in outside if str(op) not in seen)
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
    """The router (topk) and the routed experts, captured as one op, take strategies from
    rules of ours, and nothing runs replicated for want of one."""
    report = autoparallel.coverage(hf_model(name), to_meta(batch_for(name, 0)))
    sources = {}
    for row in report.rows:
        sources.setdefault(row.op, set()).add(row.source)
    assert not any(FALLBACK in s for s in sources.values()), str(report)
    for op in ("aten.topk.default", "autoparallel.routed_experts.default"):
        assert sources[op] == {RULE}, f"{op}: {sources.get(op)}"


@pytest.mark.slow  # 20-45 s each on 2 shared cores
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["4", "2x2"])
@pytest.mark.parametrize("name", sorted(MOE))
def test_moe_parity(name, mesh_shape, sim_mesh):
    """Loss and every gradient equal one device's over two SGD steps, the planner's choice with
    gradient reduction made expensive, so that the experts are held split (by expert, or
    FSDP's way)."""
    pmodel = run_parity(name, mesh_shape, "shard-params", sim_mesh, steps=2)
    assert not pmodel.plan.inspection.fallback_ops
    held = {k: v for k, v in pmodel.plan.param_placements.items() if ".experts." in k}
    assert held and all(any(p != R for p in spec) for spec in held.values()), f"experts held whole: {held}"


@pytest.mark.slow  # 10-30 s each on 2 shared cores
@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["4", "2x2"])
@pytest.mark.parametrize("name", sorted(MOE))
def test_expert_parallel_parity(name, mesh_shape, sim_mesh):
    """Expert parallelism forced through constraints (each device holds its share of the experts
    and receives the tokens routed to them by all-to-all): loss and every gradient equal one
    device's over two SGD steps."""
    held, out = EXPERT_PARALLEL[mesh_shape]
    constraints = {"*.experts.gate_up_proj": held, "*.experts.down_proj": held, "*.mlp.experts": out}
    pmodel = run_parity(name, mesh_shape, "cpu", sim_mesh, steps=2, constraints=constraints)
    experts = [n for n in pmodel.plan.nodes.values() if "routed_experts" in n.op]
    assert experts and all(n.input_specs[0] == n.input_specs[3] == (Shard(0),) * len(mesh_shape) for n in experts)
    assert "per device; expert parallel over" in str(pmodel.plan)
    if len(mesh_shape) > 1:  # one all-to-all over the whole mesh (the world's group), not one per axis
        code = "\n".join(v.graph_module.code for v in pmodel._ap.variants.values())
        hops = set(re.findall(r"routed_experts\(.*\)", code))
        assert hops and all("('exchange', 4, None," in h for h in hops), hops
        assert "expert parallel over dim0,dim1 at once" in str(pmodel.plan)


def test_expert_parallel_pricing_and_imbalance():
    """Only the exchange role communicates: four all-to-alls of the pairs' rows and one of the
    counts per expert, the rows scaled by ``CostModel.expert_imbalance`` (part of the cost model's key); the mask
    role leaves a Partial output and the data role replicates the experts. The imbalance also
    scales the compute of the roles that split the experts (the busiest device's pairs)."""
    from autoparallel.mesh import MeshSpec
    from autoparallel.solver.costs import CostModel
    from autoparallel.solver.pricing import Pricing
    from autoparallel.strategies.moe import routed_experts_cost

    fn, specs = SAMPLES["routed_experts"]
    (node_strategies, _), = _strategies(fn, specs, ROUTED_EXPERTS)
    node = next(n for n in _captured(fn, tuple(specs))[1].gm.graph.nodes if n.target is ROUTED_EXPERTS)
    by_role = {(s.inputs[0][0] != R, s.inputs[3][0] != R): s for s in node_strategies}
    assert set(by_role) == {(False, False), (True, False), (True, True), (False, True)}
    assert by_role[(False, True)].outputs[0] == (Partial(),) and by_role[(True, True)].split == 4
    cm = CostModel("a100").bind(MeshSpec((4,)))
    costs = {role: routed_experts_cost(node, s, cm) for role, s in by_role.items()}
    assert costs[(False, False)] == costs[(True, False)] == costs[(False, True)] == 0 < costs[(True, True)]
    pairs = 4 * 2  # this device's 4 tokens x top-2
    a2a = lambda nbytes: cm.collective_time("all_to_all", 0, nbytes)  # noqa: E731
    # the counts (an int64 per expert), the pairs' rows of 8 float32 four times
    assert costs[(True, True)] == pytest.approx(a2a(8 * 4) + 4 * a2a(pairs * 8 * 4))
    skewed = CostModel("a100")
    skewed.expert_imbalance = 2.0
    assert routed_experts_cost(node, by_role[(True, True)], skewed.bind(MeshSpec((4,)))) > costs[(True, True)]
    assert skewed.key() != CostModel("a100").key()
    # the busiest device's compute: imbalanced where an axis splits the experts (exchange, mask)
    compute = {name: {role: Pricing(node.graph.owning_module, [node], {}, MeshSpec((4,)), model).node_cost(node, s)[0]
                      for role, s in by_role.items()} for name, model in (("even", CostModel("a100")), ("skewed", skewed))}
    for role in by_role:
        assert (compute["skewed"][role] > compute["even"][role]) == role[1], role


def test_fsdp_ep_recipe_splits_the_experts_by_expert_over_the_last_axis():
    """The FSDP + EP recipe: routed experts held by expert over the last axis and along dim 1 over
    the other, read by expert; their output split over both axes; the rest as FSDP."""
    from autoparallel.mesh import MeshSpec
    from autoparallel.recipes import recipes
    from autoparallel.tracer import capture

    traced = capture(hf_model("mixtral"), to_meta(batch_for("mixtral", 0)))
    by_name = {r.name: r for r in recipes(traced, MeshSpec((2, 2)))}
    ep, fsdp = by_name["FSDP + EP over dim1"].constraints, by_name["FSDP (ZeRO-3)"].constraints
    assert ep["model.layers.*.mlp.experts.gate_up_proj"] == "S1(dim0) S0(dim1) -> S0(dim1)"
    assert ep["model.layers.*.mlp.experts"] == "S0(dim0) S0(dim1)"
    rest = lambda recipe: {k: v for k, v in recipe.items() if ".experts" not in k}  # noqa: E731
    assert rest(ep) == rest(fsdp)
    plan = autoparallel.plan(hf_model("mixtral"), to_meta(batch_for("mixtral", 0)), mesh_shape=(2, 2), constraints=ep)
    assert "experts, 2 per device; expert parallel over dim1" in str(plan)


def test_imbalance_sizes_the_busiest_devices_saved_pairs():
    """Under forced expert parallelism, ``expert_imbalance`` 2 makes the busiest device hold
    twice the routed pairs' saved tensors: more activation bytes at the peak, the rest alike."""
    from autoparallel.solver.costs import CostModel

    held, out = EXPERT_PARALLEL[(4,)]
    constraints = {"*.experts.gate_up_proj": held, "*.experts.down_proj": held, "*.mlp.experts": out}
    peaks = {}
    for imbalance in (1.0, 2.0):
        cm = CostModel("cpu")
        cm.expert_imbalance = imbalance
        plan = autoparallel.plan(hf_model("mixtral"), to_meta(batch_for("mixtral", 0)), mesh_shape=(4,),
                                 constraints=constraints, cost_model=cm, cache_dir=False)
        peaks[imbalance] = plan.estimate.memory.breakdown
    assert peaks[2.0].activations > peaks[1.0].activations
    assert peaks[2.0].parameters == peaks[1.0].parameters
