"""Uneven splits in units (``UnitShard``, autoparallel/placement.py "Splits in units"): 25 heads
of 8 columns on 2 devices are 13 and 12 heads, 104 and 96 columns. The placement's arithmetic
and notation, the moves into and out of unit cuts on simulated ranks, and the layout
converter's paths."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from autoparallel.placement import (P, UnitShard, chunk_ok, is_valid, local_shape, piece_length, spec_from_json,
                                    spec_problem, spec_str, spec_to_json, uneven_dims)
from autoparallel.plan import Move
from test_rules import _check_all_strategies

R = Replicate()


def test_unit_pieces():
    spec = (UnitShard(2, 8), R)
    assert local_shape((3, 5, 200), spec, (2, 2)) == (3, 5, 104)  # 13 heads of 8; the other device 12
    assert piece_length(200, 4, 8) == 56  # 25 units on 4: 7, 7, 7, 4 units
    assert uneven_dims((3, 5, 200), (R, UnitShard(2, 8)), (2, 4)) == (2,)  # 200 / 4 is even, 25 / 4 is not
    assert is_valid(spec, (3, 5, 200), (2, 2))
    assert not is_valid((UnitShard(2, 8), R), (3, 5, 192), (2, 2))  # 24 heads: the plain Shard(2) cuts them
    assert not is_valid((UnitShard(1, 8),), (3, 60), (2,))  # 8 does not divide 60
    assert not is_valid((UnitShard(0, 8), Shard(0)), (200, 3), (2, 2))  # uneven over two axes
    assert not is_valid((UnitShard(0, 4),), (20,), (4,))  # 5 units on 4: 2, 2, 1, 0
    assert chunk_ok(200, 2, 8) and not chunk_ok(20, 4, 4) and not chunk_ok(60, 2, 8)
    assert "in units" in spec_problem((UnitShard(0, 8),), (60, 3), (2,))
    assert UnitShard(1, 8) != Shard(1) and Shard(1) != UnitShard(1, 8) and isinstance(UnitShard(1, 8), Shard)
    assert len({UnitShard(1, 8), UnitShard(1, 8), Shard(1), UnitShard(1, 4)}) == 3
    with pytest.raises(ValueError, match="at least 2"):
        UnitShard(0, 1)


def test_unit_notation_round_trips():
    spec = (Shard(0), UnitShard(2, 8))
    assert spec_str(spec, 3) == "S0 R S1u8"
    assert spec_to_json(spec) == ["S0", "S2u8"]
    assert spec_from_json(["S0", "S2u8"]) == spec
    for bad in ("S2u1", "S2u08", "S2u", "Su8"):
        with pytest.raises(ValueError, match="unit"):
            spec_from_json([bad])
    m = Move("slice", 1, None, 2, 0, 8)
    assert m.to_json() == ["slice", 1, None, 2, 0, 8]
    assert Move("slice", 1, None, 2, 0).to_json() == ["slice", 1, None, 2, 0]  # plain cuts as before


def test_engine_cuts_views_and_candidates_in_units():
    from autoparallel.strategies.engine import DimMap, enumerate_strategies
    from autoparallel.strategies.rules import view_dims

    lin, lout, units = view_dims((3, 200), (3, 25, 8))
    assert units == {lout[1]: {200: 8, 25: 1}}
    dm = DimMap([lin], [lout], [(3, 200)], [(3, 25, 8)], uneven=1, units=units)
    cuts = {(s.inputs[0], s.outputs[0]): s.split for s in enumerate_strategies(dm, (2,))}
    assert cuts[((UnitShard(1, 8),), (Shard(1),))] == pytest.approx(25 / 13)  # 13 and 12 heads
    assert ((Shard(1),), (Shard(1),)) not in cuts  # 100 | 100 columns are not whole heads
    assert view_dims((2, 8, 200), (16, 200))[2] == {"g0": {2: 1, 16: 8}}  # [B, S] -> [B·S]: units of S
    mm = DimMap([("m", "k"), ("k", "n")], [("m", "n")], [(3, 20), (20, 20)], [(3, 20)], reduce=frozenset({"k"}),
                uneven=2)
    plain = {s.outputs[0] for s in enumerate_strategies(mm, (2,))}
    offered = {s.outputs[0]: s for s in enumerate_strategies(mm, (2,), {20: (4,)})}
    assert set(offered) - plain == {(UnitShard(1, 4),)}  # n in 5 heads of 4: 12 | 8 columns
    contracted = next(s for s in offered.values() if s.inputs == ((UnitShard(1, 4),), (UnitShard(0, 4),)))
    assert contracted.outputs == ((P,),)  # k cut in units: partial sums
    assert all(s.outputs[0] != (UnitShard(1, 4),) for s in enumerate_strategies(mm, (4,), {20: (4,)}))  # 2,2,1,0


# on a (2, 2) mesh, as test_layout_moves.CASES; a move is (kind, axis, src dim, dst dim[, unit])
UNIT_MOVES = {
    "slice dim 1 in units of 4 (5 units: 12, 8 rows)": ((3, 20), (Shard(0), R), ("slice", 1, None, 1, 4),
                                                       (Shard(0), UnitShard(1, 4))),
    "slice dim 0 in units of 3": ((15, 4), (R, R), ("slice", 0, None, 0, 3), (UnitShard(0, 3), R)),
    "all_gather dim 1 in units": ((4, 10, 3), (Shard(0), UnitShard(1, 2)), ("all_gather", 1, 1, None),
                                  (Shard(0), R)),
    "all_gather dim 0 in units, dim 1 split": ((6, 4), (UnitShard(0, 2), Shard(1)), ("all_gather", 0, 0, None),
                                               (R, Shard(1))),
    "reduce_scatter dim 2 in units": ((2, 3, 20), (P, Shard(0)), ("reduce_scatter", 0, None, 2, 4),
                                      (UnitShard(2, 4), Shard(0))),
    "reduce_scatter dim 0 in units": ((10, 3), (R, P), ("reduce_scatter", 1, None, 0, 2), (R, UnitShard(0, 2))),
    "plain even cut to units: all_gather then slice": ((2, 20), (R, Shard(1)),
                                                       [("all_gather", 1, 1, None), ("slice", 1, None, 1, 4)],
                                                       (R, UnitShard(1, 4))),
}


@pytest.mark.parametrize("case", UNIT_MOVES)
def test_unit_move(case, sim_mesh, monkeypatch):
    """Every rank gets its piece of whole units, contiguous (test_layout_moves.test_move)."""
    import test_layout_moves

    monkeypatch.setitem(test_layout_moves.CASES, case, UNIT_MOVES[case])
    test_layout_moves.test_move(case, sim_mesh)


def test_redistributor_reaches_unit_cuts():
    from autoparallel.mesh import MeshSpec
    from autoparallel.solver.costs import CostModel
    from autoparallel.solver.layout import Redistributor

    rd = Redistributor(CostModel().bind(MeshSpec((2,))))
    _, moves = rd.redistribute((3, 200), 4, True, (R,), (UnitShard(1, 8),), True)
    assert [(m.kind, m.unit) for m in moves] == [("slice", 8)]
    _, moves = rd.redistribute((3, 200), 4, True, (P,), (UnitShard(1, 8),), True)
    assert [(m.kind, m.unit, m.nbytes) for m in moves] == [("reduce_scatter", 8, 3 * 200 * 4)]
    _, moves = rd.redistribute((3, 200), 4, True, (UnitShard(1, 8),), (R,), True)
    assert [(m.kind, m.nbytes) for m in moves] == [("all_gather", 3 * 104 * 4 * 2)]  # 2 pieces of 13 heads
    _, moves = rd.redistribute((3, 200), 4, True, (Shard(1),), (UnitShard(1, 8),), True)
    assert [m.kind for m in moves] == ["all_gather", "slice"]  # 100 | 100 columns to 104 | 96


def _heads(x, w_in, w_out):
    """A projection to 5 heads of 4, per-head work, the heads merged and projected back."""
    b, s = x.shape[:2]
    h = F.linear(x, w_in).view(b, s, 5, 4).transpose(1, 2)  # [b, 5 heads, s, 4]
    h = (h * 2.0).tanh().transpose(1, 2).reshape(b, s, 20)
    return F.linear(h, w_out)


def _heads_addmm(x, w, b):
    """GPT-2's Conv1D: flattened rows through addmm, viewed back, split into heads."""
    y = torch.addmm(b, x.view(-1, 20), w).view(3, 5, 20).view(3, 5, 5, 4)
    return y.permute(0, 2, 1, 3).relu()


def _heads_matmul(q, k):
    """Attention scores per head: the heads are a batch dim of both operands."""
    q = q.view(2, 4, 5, 4).transpose(1, 2)
    k = k.view(2, 4, 5, 4).transpose(1, 2)
    return (q @ k.transpose(-1, -2)).softmax(-1)


def _attention(x, wq, wk, wv, wo):
    """Multi-head causal attention on 5 heads of 4 (Llama's layout without rotary); the
    result scaled down so that float32's rounding stays within the checks' absolute tolerance."""
    q, k, v = (F.linear(x, w).view(2, 4, 5, 4).transpose(1, 2) for w in (wq, wk, wv))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.linear(a.transpose(1, 2).reshape(2, 4, 20), wo) * 0.1


# 20 columns, 5 heads of 4: on 2 devices 3 and 2 heads (12 and 8 columns, not 10 and 10)
UNIT_SAMPLES = {
    "heads_linear_view": (_heads, [(3, 5, 20), (20, 20), (20, 20)]),
    # batch and sequence even: on (2, 2) a 3-d linear's backward on an uneven batch compares
    # per-rank sizes, which LocalTensorMode does not implement (plain uneven splits, not units)
    "heads_linear_view_even_rows": (_heads, [(2, 4, 20), (20, 20), (20, 20)]),
    "heads_addmm_view": (_heads_addmm, [(3, 5, 20), (20, 20), (20,)]),
    "heads_matmul": (_heads_matmul, [(2, 4, 20), (2, 4, 20)]),
    "heads_attention": (_attention, [(2, 4, 20)] + [(20, 20)] * 4),
}


def _unit_cuts(gen_strategies) -> int:
    return sum(1 for ss in gen_strategies.values() for s in ss for spec in s.inputs + s.outputs
               if any(isinstance(p, UnitShard) for p in spec))


@pytest.mark.parametrize("name,mesh_shape", [(n, (2,)) for n in sorted(UNIT_SAMPLES) if "even_rows" not in n] +
                         [pytest.param(n, (2, 2), marks=pytest.mark.slow) for n in ("heads_linear_view_even_rows",)],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v)
def test_every_unit_strategy_matches_the_dense_op(name, mesh_shape, sim_mesh):
    """Every strategy of every node, unit cuts included, against the dense op (test_rules)."""
    from test_rules import _captured

    gen = _check_all_strategies(name, mesh_shape, sim_mesh, set(), samples=UNIT_SAMPLES)
    fn, specs = UNIT_SAMPLES[name]
    _, traced = _captured(fn, tuple(specs))
    assert _unit_cuts(gen.generate(traced.gm)) > 0  # the samples exercise cuts in units


def _llama_25_heads():
    """An unfused Llama with 25 heads of 8 (hidden 200): q, k, v projections of 200 each."""
    import transformers as T

    T.logging.set_verbosity_error()
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(hidden_size=200, intermediate_size=256, num_hidden_layers=2,
                                            num_attention_heads=25, num_key_value_heads=25, head_dim=8, vocab_size=64,
                                            max_position_embeddings=32, use_cache=False))


def _gpt2_25_heads():
    """GPT-2 with 25 heads of 8 (n_embd 200): the fused ``c_attn`` split into q, k, v at capture
    (autoparallel/tracer/fused.py)."""
    import transformers as T

    T.logging.set_verbosity_error()
    torch.manual_seed(0)
    return T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=200, n_head=25, vocab_size=64, n_positions=16,
                                          resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, use_cache=False))


def _heads_split(plan) -> list[str]:
    """SDPA nodes whose 25 heads are split by one mesh axis (13 and 12 heads on 2 devices)."""
    return [n.name for n in plan.nodes.values() if n.op == "scaled_dot_product_attention.default"
            and n.out_shapes[0][1] == 25 and any(isinstance(p, Shard) and p.dim == 1 for p in n.output_specs[0])]


@pytest.mark.slow
@pytest.mark.parametrize("build", [_llama_25_heads, _gpt2_25_heads], ids=["llama", "gpt2"])
def test_25_heads_split_on_2x2(build, sim_mesh):
    """25 heads of 8 on (2, 2) with communication nearly free: attention splits its heads 13/12,
    the heads are merged back in units of 8 (104 and 96 columns), the plan (units included)
    survives JSON and validation (``plan=`` validates it against the captured graph), and the
    loss and every gradient equal one device's over two SGD steps."""
    pytest.importorskip("transformers")
    import copy

    import autoparallel
    from models import CheapComm
    from test_parity import train_side_by_side
    from torch.distributed._local_tensor import LocalTensorMode

    ref = build()
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 64, (2, 8), generator=g),
                "labels": torch.randint(0, 64, (2, 8), generator=g)} for _ in range(2)]
    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in batches[0].items()}
    mesh = sim_mesh((2, 2))
    ranks = frozenset(range(4))
    with LocalTensorMode(ranks):
        planned = autoparallel.autoparallelize(copy.deepcopy(ref), meta, device_mesh=mesh,
                                               cost_model=CheapComm("cpu"), cache_dir=False)
        text = planned.plan.to_json()
        pmodel = autoparallel.autoparallelize(copy.deepcopy(ref), meta, device_mesh=mesh, plan=text)
    assert '"S2u8"' in text, "the plan should cut the merged heads in units of 8"
    assert _heads_split(pmodel.plan), "attention should split the 25 heads"
    train_side_by_side(ref, pmodel, batches, ranks, lambda out: out.loss)


def test_plan_with_unit_cuts_round_trips_and_validates():
    """A plan whose projection, view and attention cut 5 heads of 4 on 2 devices (``S2u4``
    columns, ``S1`` heads) survives JSON and plan validation; the same plan with a parameter
    stored in a unit cut, which DTensor cannot hold, is refused."""
    import json

    from autoparallel.errors import PlanMismatchError
    from autoparallel.mesh import MeshSpec
    from autoparallel.plan import Plan
    from autoparallel.solver import CostModel
    from autoparallel.solver.planner import Planner
    from autoparallel.strategies import StrategyGenerator
    from autoparallel.validate import validate_plan
    from test_rules import _captured

    fn, specs = UNIT_SAMPLES["heads_attention"]
    _, traced = _captured(fn, tuple(specs))
    gen = StrategyGenerator((2,))
    strategies = gen.generate(traced.gm)
    planner = Planner(traced.gm, strategies, gen.aliases, MeshSpec((2,)), CostModel(),
                      dict(traced.params, **traced.buffers))
    cut = (UnitShard(2, 4),)
    choice = {n: next(s for s in ss if all(x == (R,) for x in s.inputs + s.outputs)) for n, ss in strategies.items()}
    for n, ss in strategies.items():  # the q, k, v projections' columns cut in heads of 4
        if n.target == torch.ops.aten.linear.default and n.meta["val"].shape[-1] == 20 and n.users and \
                next(iter(n.users)).target == torch.ops.aten.view.default:
            choice[n] = next(s for s in ss if s.outputs[0] == cut)
    plan = planner.make_plan(choice)
    text = plan.to_json()
    assert '"S2u4"' in text
    assert any(m.unit == 4 for c in plan.redistributions for m in c.moves)  # each weight sliced in heads
    again = Plan.from_json(text)
    assert again == plan
    validate_plan(again, traced)
    d = json.loads(text)
    w = next(n for n in d["nodes"] if n["name"] == "t1")
    w["output_specs"] = [["S0u4"]]
    d["param_placements"]["t1"] = ["S0u4"]
    with pytest.raises(PlanMismatchError, match="t1"):
        validate_plan(Plan.from_json(json.dumps(d)), traced)
