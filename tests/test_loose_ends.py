"""Loose ends a user meets: constraints read every placement the plan prints (splits in units
included), the summary follows a fused projection's slices and a policy's cast, the FSDP
recipes gather in ``param_dtype`` under a bf16 policy, the parallel module refuses pickling
with a message naming what to save (and deep-copies), its state dict round-trips through
``torch.save``, and a record's ``first_row`` is right for splits in units."""

import copy
import fnmatch
import io
import math
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Partial, Replicate, Shard

import autoparallel
from autoparallel.constraints import ConstraintError, parse_spec
from autoparallel.placement import UnitShard, format_spec, local_shape
from models import CheapComm, MLP, ShardParams, batch_for, hf_model, to_meta, whole

R = Replicate()
MESH = autoparallel.MeshSpec((2, 2), ("dp", "tp"))
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)


# ---------------------------------------------------------------- constraints read units
def test_unit_notation_parses_and_is_checked():
    names = ("dp", "tp")
    assert parse_spec("S2u8(tp)", names) == (R, UnitShard(2, 8))
    assert parse_spec("S1u8 S0", names) == (UnitShard(1, 8), Shard(0))
    for spec in [(UnitShard(2, 8), Shard(0)), (Partial(), UnitShard(0, 16)), (R, Shard(1)), (R, R)]:
        assert parse_spec(format_spec(spec, names), names) == spec
    for bad in ("S2u1(tp)", "S2u08(tp)", "Su8(tp)", "S2u(tp)", "S2v8(tp)"):
        with pytest.raises(ConstraintError, match="S<dim>u<unit>"):
            parse_spec(bad, names)


class _Heads(torch.nn.Module):
    """5 heads of 4 columns computed per head and merged back ([2, 4, 20]): the merged heads
    are the output of module ``attn``, a tensor that can be split 3 | 2 heads on 2 devices."""

    def __init__(self):
        super().__init__()
        self.attn = _Attention()

    def forward(self, x):
        return self.attn(x).sum()


class _Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(20, 20)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 5, 4).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape(b, s, 20)


def test_a_unit_constraint_is_honoured_and_checked():
    """``"attn": "S2u4"`` (the merged heads cut 3 | 2 heads, 12 | 8 columns) is planned as
    pinned; a unit that does not divide the dim, one the axis divides evenly, and a parameter
    stored in units are refused with the tensor and the reason."""
    meta = (torch.empty(2, 4, 20, device="meta"),)
    p = autoparallel.plan(_Heads(), meta, mesh_shape=(2,), constraints={"attn": "S2u4"}, cost_model=CheapComm("cpu"),
                          cache_dir=False)
    merged = [n for n in p.nodes.values() if n.op == "reshape.default"]
    assert [n.output_specs[0] for n in merged] == [(UnitShard(2, 4),)]
    for text in ("S2u3", "S1u3", "S2u10"):  # 3 does not divide 20 nor 4; 2 units of 10 are an even cut
        with pytest.raises(ConstraintError, match=f"module attn .* cannot be placed {text}.*no device layout holds"):
            autoparallel.plan(_Heads(), meta, mesh_shape=(2,), constraints={"attn": text}, cache_dir=False)
    with pytest.raises(ConstraintError, match="attn.q.weight cannot be stored S0u4.*no split in units"):
        autoparallel.plan(_Heads(), meta, mesh_shape=(2,), constraints={"attn.q.weight": "S0u4"}, cache_dir=False)


def test_printed_placements_pin_back_the_same_plan():
    """GPT-2 with 25 heads of 8 on (2, 2): every placement ``plan.table()`` prints (the merged
    heads cut ``S2u8``) reads back as the same spec; pinning every parameter as ``str(plan)``
    prints it yields the same placements and objective (the heads still cut in units), and
    pinning every module output too yields the same placements and step."""
    pytest.importorskip("transformers")
    from test_uneven_units import _gpt2_25_heads

    from autoparallel.tracer import capture
    from autoparallel.constraints import module_outputs

    meta = {k: torch.empty(2, 8, dtype=torch.long, device="meta") for k in ("input_ids", "labels")}
    kw = dict(mesh_shape=(2, 2), cost_model=CheapComm("cpu"), cache_dir=False)
    p = autoparallel.plan(_gpt2_25_heads(), meta, **kw)
    names = p.mesh.axis_names
    specs = {s for n in p.nodes.values() for s in n.input_specs + n.output_specs}
    assert any(isinstance(x, UnitShard) for s in specs for x in s), "the plan should cut the heads in units"
    for spec in specs:
        assert parse_spec(format_spec(spec, names), names) == spec
        assert format_spec(spec, names) in p.table(by="node", all_nodes=True)
    cut = next(n for n in p.nodes.values() if any(isinstance(x, UnitShard) for x in n.output_specs[0]))
    assert format_spec(cut.output_specs[0], names) in p.explain(cut.name)  # explain prints it as well

    pins = {names_[0]: format_spec(p.param_placements[names_[0]], names)
            for names_ in p.inspection.state_nodes.values()}
    again = autoparallel.plan(_gpt2_25_heads(), meta, constraints=pins, **kw)
    assert again.param_placements == p.param_placements
    assert again.solver_stats.objective_s == pytest.approx(p.solver_stats.objective_s, rel=1e-9)
    assert any(isinstance(x, UnitShard) for n in again.nodes.values() for s in n.output_specs for x in s)

    outputs = {path: node.name for path, node in module_outputs(capture(_gpt2_25_heads(), meta).gm).items()}
    pins.update({path: format_spec(p.nodes[name].output_specs[0], names) for path, name in outputs.items()})
    again = autoparallel.plan(_gpt2_25_heads(), meta, constraints=pins, **kw)
    assert again.param_placements == p.param_placements
    assert all(again.nodes[name].output_specs == p.nodes[name].output_specs for name in outputs.values())
    # pinning lm_head's output (P S2) where the free plan has it adds 0.2 µs (3e-5 relative) to the ILP objective:
    # noted in docs/design.md, "Loose ends a user meets"
    assert again.estimate.step_time_s == pytest.approx(p.estimate.step_time_s, rel=1e-3)


# ---------------------------------------------------------------- the summary's "use in compute"
def _gpt2(batch=4):
    with torch.device("meta"):
        model = hf_model("gpt2")
    ids = torch.empty(batch, 16, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids.clone()}


def _use_column(plan, name: str) -> str:
    row = next(line for line in str(plan).splitlines() if line.strip().startswith(name + " "))
    return row.split("  ")[-1].strip()


def test_summary_follows_the_slices_of_a_fused_projection():
    """GPT-2's ``c_attn`` is read in three slices (tracer/fused.py). Under Megatron's
    constraints (stored split by output features, which a slice cannot keep) the summary says
    the weight is gathered and its slices split for compute, not "as stored"."""
    from autoparallel.tracer import capture
    from autoparallel.recipes import recipes

    model, inputs = _gpt2()
    tp = next(r for r in recipes(capture(model, inputs), MESH) if r.name.startswith("Megatron"))
    p = autoparallel.plan(model, inputs, mesh_spec=MESH, constraints=tp.constraints,
                          cache_dir=False)
    use = _use_column(p, "transformer.h.{0..1}.attn.c_attn.weight")
    slices = {n for through in p.inspection.state_reads.values() for n in through}
    moved = {m.kind for c in p.redistributions if c.src in slices for m in c.moves}
    assert moved, "the slices should be redistributed for compute"
    assert "slices split over tp" in use and use != "as stored", use


def test_summary_follows_a_policy_cast():
    """Under a bf16 policy a parameter is read through its cast: FSDP's gathered weights show
    as all-gathered (the cast copy is), not "as stored"."""
    model, inputs = _gpt2()
    p = autoparallel.plan(model, inputs, mesh_spec=MESH, mp_policy=BF16, constraints={"*.weight": "S0(dp) S0(tp) -> R"},
                          cache_dir=False)
    assert _use_column(p, "transformer.h.{0..1}.mlp.c_fc.weight") == "all-gathered over dp,tp"


# ---------------------------------------------------------------- recipes under bf16
def test_fsdp_recipes_gather_param_dtype_under_bf16():
    """FSDP and FSDP + TP under a bf16 policy cast each weight pinned ``STORED -> USED`` on its
    shard and all-gather the bf16 copy, as FSDP2 does: no all-gather leaves such a parameter
    (fp32), and every all-gather of its cast or of the cast's slices (GPT-2's fused ``c_attn``)
    moves 2 bytes per element. (FSDP + TP leaves the parameters Megatron replicates, and the
    fused bias, to the planner: no use clause.)"""
    from autoparallel.tracer import capture
    from autoparallel.constraints import read_through
    from autoparallel import compare

    model, inputs = _gpt2()
    traced = capture(model, inputs, mp_policy=BF16)
    c = compare(model, inputs, mesh_spec=MESH, mp_policy=BF16)
    for name in ("FSDP (ZeRO-3)", "FSDP + TP"):
        plan = next(r for r in c.rows if r.name == name).plan
        assert plan is not None, name
        used = [pattern for pattern, text in plan.inspection.placement_constraints.items() if "->" in text]
        params, copies = set(), set()  # the parameters pinned STORED -> USED, and their casts and slices
        for n in traced.gm.graph.nodes:
            if n.op == "get_attr" and any(fnmatch.fnmatchcase(t, p) for t in traced.params.get(n.target, ())
                                          for p in used):
                params.add(n.name)
                copies |= {x.name for x in read_through(n)}
        assert copies, name
        gathers = []  # (source, bytes per element of the gathered piece)
        for r in plan.redistributions:
            if r.src not in params | copies:
                continue
            spec = list(plan.nodes[r.src].output_specs[r.src_index])
            for m in r.moves:
                if m.kind in ("all_gather", "mask"):  # whole, or masked into a pending sum (a row-parallel bias)
                    spec[m.axis] = R if m.kind == "all_gather" else Partial()
                else:
                    spec[m.axis] = Shard(m.dst_dim)
                if m.kind == "all_gather":
                    gathers.append((r.src, m.nbytes / math.prod(local_shape(r.shape, tuple(spec), MESH.shape))))
        assert gathers, name
        assert all(src in copies and per == 2.0 for src, per in gathers), (name, gathers)


# ---------------------------------------------------------------- saving and copying the module
def test_parallel_module_refuses_pickling_and_deep_copies(sim_mesh):
    torch.manual_seed(0)
    batch = batch_for("mlp", 0)
    ranks = frozenset(range(2))
    mesh = sim_mesh((2,))
    with LocalTensorMode(ranks):
        pmodel = autoparallel.autoparallelize(MLP(), to_meta(batch), device_mesh=mesh, cost_model=ShardParams("cpu"),
                                              cache_dir=False)
        for obj in (pmodel, pmodel.graph_module):
            for save in (lambda o: torch.save(o, io.BytesIO()), pickle.dumps):
                with pytest.raises(TypeError, match=r"cannot be pickled.*pmodel\.state_dict\(\).*"
                                                    r"torch\.distributed\.checkpoint.*plan\.to_json"):
                    save(obj)
        twin = copy.deepcopy(pmodel)
        assert all(a is not b for a, b in zip(twin.parameters(), pmodel.parameters()))
        losses = []
        for m in (pmodel, twin):
            loss = m(**batch)
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1])
        for (name, a), b in zip(pmodel.named_parameters(), twin.parameters()):
            torch.testing.assert_close(whole(a.grad), whole(b.grad), msg=name)
        with torch.no_grad():
            next(twin.parameters()).mul_(0)  # the copy owns its weights
        assert whole(next(pmodel.parameters())).abs().sum() > 0


@pytest.fixture
def gloo_rank(tmp_path):
    """A 1-rank gloo process group in this process (its collectives are real c10d calls)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    yield
    dist.destroy_process_group()


def test_state_dict_round_trips_through_torch_save(gloo_rank, tmp_path):
    """``torch.save(pmodel.state_dict())`` writes the module's tensors (plain ones on one device,
    where every plan replicates, as the model's own); ``load_state_dict(torch.load(...))`` into
    a module of another initialization gives back the weights and the loss."""
    from torch.distributed.tensor import DTensor, init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    batch = batch_for("mlp", 0)
    torch.manual_seed(0)
    first = autoparallel.autoparallelize(MLP(), to_meta(batch), device_mesh=mesh, cost_model=autoparallel.CostModel("cpu"),
                                         cache_dir=False)
    torch.save(first.state_dict(), tmp_path / "weights.pt")
    torch.manual_seed(1)
    second = autoparallel.autoparallelize(MLP(), to_meta(batch), device_mesh=mesh, plan=first.plan.to_json())
    assert not torch.equal(whole(next(second.parameters())), whole(next(first.parameters())))
    loaded = torch.load(tmp_path / "weights.pt")
    assert not any(isinstance(v, DTensor) for v in loaded.values())
    result = second.load_state_dict(loaded)
    assert not result.missing_keys and not result.unexpected_keys
    for (name, a), b in zip(first.named_parameters(), second.parameters()):
        torch.testing.assert_close(whole(a), whole(b), msg=name)
    torch.testing.assert_close(second(**batch), first(**batch))
    with pytest.raises(TypeError, match="cannot be pickled"):
        torch.save(first, tmp_path / "module.pt")


# ---------------------------------------------------------------- records: the first row of a piece
@pytest.mark.parametrize("spec,size,unit_rows", [((UnitShard(0, 8),), 200, 8), ((Shard(0),), 50257, 1),
                                                 ((UnitShard(0, 4),), 20, 4)],
                         ids=["25-heads-of-8", "plain-uneven", "5-heads-of-4"])
def test_first_row_of_each_piece(spec, size, unit_rows):
    """``LocalCall.first_row`` on each device equals where ``torch.chunk`` of the dim's units
    starts that device's piece (104 for 25 heads of 8 on the second of 2 devices)."""
    import torch.fx as fx

    from autoparallel.strategies.records import LocalCall

    n = 2
    graph = fx.Graph()
    coord = graph.placeholder("coord")
    call = LocalCall(node=coord, args=(), kwargs={}, in_shapes=[(size, 3)], out_shapes=[(size, 3)],
                     input_specs=[spec], output_specs=[spec], mesh_shape=(n,), graph=graph,
                     all_reduce=None, coord=lambda axis: coord)
    graph.output(call.first_row(0, 0))
    fn = fx.GraphModule(torch.nn.Module(), graph)
    units = torch.arange(size).view(size // unit_rows, unit_rows)
    starts = [int(piece[0, 0]) for piece in units.chunk(n)]
    assert [int(fn(torch.tensor([i]))) for i in range(n)] == starts
