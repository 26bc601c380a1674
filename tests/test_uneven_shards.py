"""Uneven splits (``torch.chunk`` pieces, see autoparallel/placement.py "Uneven splits"): every
uneven strategy checked against the dense op, the moves into and out of uneven specs on
simulated ranks, and GPT-2 with its 50257-row vocabulary split over 4 devices."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Replicate, Shard

from autoparallel.options import PlanOptions
from autoparallel.solver.pipeline import plan_traced
from autoparallel.placement import P, chunk_ok, is_valid, local_shape, spec_problem, uneven_dims
from autoparallel.strategies.engine import DimMap, enumerate_strategies
from test_rules import _check_all_strategies
from models import whole

# shapes no mesh axis of 2 or 4 divides (7 → 2,2,2,1 on 4; 10 → 3,3,3,1; 5 → 3,2 on 2)
UNEVEN_SAMPLES = {
    "linear_bias": (lambda x, w, b: F.linear(x, w, b), [(7, 10), (5, 10), (5,)]),
    "addmm_views": (lambda b, x, w: torch.addmm(b, x.view(-1, 10), w).view(7, 3, 5) * 2.0,
                    [(5,), (7, 3, 10), (10, 5)]),
    "matmul_permute": (lambda a, b: (a @ b).transpose(1, 2).relu() + 1.0, [(3, 7, 10), (10, 5)]),
    "pointwise_broadcast": (lambda x, y: (x * y - y, torch.where(x > 0, x, y), x.exp()), [(7, 10), (10,)]),
    "view_expand": (lambda x, y: (x.view(7, 2, 5) + y.expand(7, 2, 5), x.reshape(70), x.unsqueeze(1).squeeze(1)),
                    [(7, 10), (1, 2, 5)]),
    "norm_slice_select": (lambda x, w: (F.layer_norm(x, (10,), w), F.rms_norm(x, (3, 10)), x[:, 1:3], x[:, :, :7],
                                        x.select(1, 0)), [(7, 3, 10), (10,)]),
    "split_cat_stack": (lambda x, y: (*torch.split(x, 3, dim=1), torch.cat([x, y], dim=1), torch.stack([x, x], 1),
                                      *x.chunk(2, dim=1)), [(7, 6), (7, 2)]),
}


def test_chunk_pieces():
    assert chunk_ok(50257, 4) and chunk_ok(25, 2) and chunk_ok(8, 4)
    assert not chunk_ok(5, 4)  # 2, 2, 1, 0: a device would hold nothing
    assert local_shape((50257, 8), (Shard(0),), (4,)) == (12565, 8)  # the largest shard
    assert is_valid((Shard(0),), (50257, 8), (4,))
    assert uneven_dims((50257, 8), (Shard(0),), (4,)) == (0,)
    assert not is_valid((Shard(0), Shard(0)), (10, 8), (2, 2))  # uneven over two axes
    assert "uneven over several mesh axes" in spec_problem((Shard(0), Shard(0)), (10, 8), (2, 2))
    assert spec_problem((Shard(1), Shard(0)), (10, 7), (2, 2)) is None


def test_engine_lists_uneven_splits_only_where_the_rule_allows():
    dm = DimMap([("a", "b")], [("a", "b")], [(7, 8)], [(7, 8)])
    specs = {s.outputs[0] for s in enumerate_strategies(dm, (4,))}
    assert (Shard(0),) not in specs and (Shard(1),) in specs  # uneven not declared
    dm.uneven = 1
    strategies = {s.outputs[0]: s for s in enumerate_strategies(dm, (4,))}
    assert strategies[(Shard(0),)].split == pytest.approx(7 / 2)  # priced by the largest piece
    assert (Shard(0), Shard(0)) not in {s.outputs[0] for s in enumerate_strategies(dm, (2, 2))}


@pytest.mark.parametrize("name,mesh_shape", [(n, (4,)) for n in sorted(UNEVEN_SAMPLES)] +
                         [pytest.param(n, (2, 2), marks=pytest.mark.slow) for n in ("linear_bias", "view_expand")],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v)
def test_every_uneven_strategy_matches_the_dense_op(name, mesh_shape, sim_mesh):
    gen = _check_all_strategies(name, mesh_shape, sim_mesh, set(), samples=UNEVEN_SAMPLES)
    assert gen is not None


R_, P_ = Replicate(), P
UNEVEN_MOVES = {  # on a (2, 2) mesh, as test_layout_moves.CASES; 5 and 3 split over 2: 3, 2 and 2, 1
    "all_gather uneven dim 1": ((4, 5, 3), (Shard(0), Shard(1)), ("all_gather", 1, 1, None), (Shard(0), R_)),
    "all_gather uneven dim 0, dim 1 uneven": ((5, 3, 2), (Shard(0), Shard(1)), ("all_gather", 0, 0, None),
                                              (R_, Shard(1))),
    "all_gather dim 2, dim 0 uneven": ((5, 2, 4), (Shard(0), Shard(2)), ("all_gather", 1, 2, None), (Shard(0), R_)),
    "all_gather uneven dim 2, dim 0 uneven": ((5, 2, 3), (Shard(0), Shard(2)), ("all_gather", 1, 2, None),
                                              (Shard(0), R_)),
    "slice uneven dim 2": ((4, 6, 5), (Shard(0), R_), ("slice", 1, None, 2), (Shard(0), Shard(2))),
    "slice uneven dim 0": ((5, 4), (R_, R_), ("slice", 0, None, 0), (Shard(0), R_)),
    "reduce_scatter uneven dim 1": ((4, 5), (Shard(0), P_), ("reduce_scatter", 1, None, 1), (Shard(0), Shard(1))),
    "reduce_scatter uneven dim 0, dim 1 uneven": ((3, 5), (P_, Shard(1)), ("reduce_scatter", 0, None, 0),
                                                  (Shard(0), Shard(1))),
    "all_gather dim 1, dim 0 uneven, joined by a copy": ((5, 4, 3), (Shard(0), Shard(1)), ("all_gather", 1, 1, None),
                                                         (Shard(0), R_)),
    "all_gather uneven dim 0 then slice dim 1": ((5, 4), (Shard(0), R_),
                                                 [("all_gather", 0, 0, None), ("slice", 0, None, 1)], (Shard(1), R_)),
}


@pytest.mark.parametrize("case", UNEVEN_MOVES)
def test_uneven_move(case, sim_mesh, monkeypatch):
    """The move gives every rank its ``torch.chunk`` piece, contiguous (test_layout_moves.test_move)."""
    import test_layout_moves

    monkeypatch.setitem(test_layout_moves.CASES, case, UNEVEN_MOVES[case])
    test_layout_moves.test_move(case, sim_mesh)


def test_redistributor_reaches_uneven_specs_without_all_to_all():
    from autoparallel.mesh import MeshSpec
    from autoparallel.solver.costs import CostModel
    from autoparallel.solver.layout import Redistributor

    rd = Redistributor(CostModel().bind(MeshSpec((4,))))
    _, moves = rd.redistribute((7, 8), 4, True, (Shard(1),), (Shard(0),), True)
    assert [m.kind for m in moves] == ["all_gather", "slice"]  # no all-to-all into an uneven dim
    _, moves = rd.redistribute((7, 8), 4, True, (P,), (Shard(0),), True)
    assert [(m.kind, m.nbytes) for m in moves] == [("reduce_scatter", 7 * 8 * 4)]
    _, moves = rd.redistribute((7, 8), 4, True, (Shard(0),), (R_,), True)
    assert [(m.kind, m.nbytes) for m in moves] == [("all_gather", 2 * 8 * 4 * 4)]  # 4 pieces padded to 2 rows
    assert rd.redistribute((5, 8), 4, True, (R_,), (Shard(0),), True)[0] == float("inf")  # 2, 2, 1, 0


def _gpt2_vocab_50257():
    import transformers as T

    T.logging.set_verbosity_error()
    torch.manual_seed(0)
    return T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=50257, n_positions=16,
                                          resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, use_cache=False))


def _vocab_split_nodes(plan, vocab):
    """Nodes whose output splits a dim of size ``vocab``."""
    return [n.name for n in plan.nodes.values() if n.op not in ("placeholder", "output") and any(
        isinstance(p, Shard) and shape[p.dim] == vocab for shape, spec in zip(n.out_shapes, n.output_specs)
        for p in spec)]


def _parity(ref, batches, mesh, cost_model, loss=lambda out: out.loss):
    """Train a copy of ``ref`` on ``mesh`` (simulated) beside ``ref`` on one device, an SGD step
    after each batch: the loss and every gradient agree on every rank. Returns the module."""
    import autoparallel
    from test_parity import train_side_by_side

    model = copy.deepcopy(ref)
    ranks = frozenset(range(mesh.size()))
    with LocalTensorMode(ranks):
        pmodel = autoparallel.autoparallelize(
            model, {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in batches[0].items()},
            device_mesh=mesh, cost_model=cost_model)
    train_side_by_side(ref, pmodel, batches, ranks, loss)
    return pmodel


@pytest.mark.slow
def test_gpt2_vocabulary_50257_split_over_4(sim_mesh):
    """GPT-2's whole vocabulary (50257 = 4 · 12564 + 1) on (4,) with communication nearly free:
    the plan splits the vocabulary dim (the logits' linear, on a slice of the tied embedding
    that the lookup reads whole), and the loss and every gradient equal one device's, before
    and after SGD steps; token ids at the pieces' edges included."""
    pytest.importorskip("transformers")
    from models import CheapComm

    vocab = 50257
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, vocab, (4, 8), generator=g),
                "labels": torch.randint(0, vocab, (4, 8), generator=g)} for _ in range(2)]
    batches[0]["input_ids"][0, :4] = torch.tensor([0, vocab - 1, 3 * 12565, 3 * 12565 - 1])
    batches[0]["labels"][0, :4] = torch.tensor([vocab - 1, 0, 3 * 12565 - 1, 3 * 12565])
    pmodel = _parity(_gpt2_vocab_50257(), batches, sim_mesh((4,)), CheapComm("cpu"))
    assert _vocab_split_nodes(pmodel.plan, vocab), "the plan should split the vocabulary dim"


class _MLP(torch.nn.Module):
    """Two linears around a hidden size no mesh axis divides."""

    def __init__(self, hidden):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(24, hidden), torch.nn.Linear(hidden, 24)

    def forward(self, x, y):
        return F.mse_loss(self.down(F.gelu(self.up(x))), y)


@pytest.mark.parametrize("mesh_shape,hidden", [((4,), 250), ((2, 2), 251)], ids=["4-hidden250", "2x2-hidden251"])
def test_mlp_parameters_split_unevenly(mesh_shape, hidden, sim_mesh):
    """Tensor parallelism on a hidden size no axis divides (250 on 4: 63, 63, 63, 61 rows of
    ``up.weight``; 251 on 2: 126, 125, beside a split of the other axis): parameters
    distributed in uneven ``torch.chunk`` pieces, parity after SGD steps."""
    from models import ShardParams

    g = torch.Generator().manual_seed(0)
    batches = [{"x": torch.randn(4, 24, generator=g), "y": torch.randn(4, 24, generator=g)} for _ in range(3)]
    pmodel = _parity(_MLP(hidden), batches, sim_mesh(mesh_shape), ShardParams("cpu"), loss=lambda out: out)
    placements = pmodel.plan.param_placements
    assert any(Shard(0) in placements[n] for n in ("up.weight", "up.bias")), \
        f"the hidden dim should be split: {placements}"


def test_uneven_plan_round_trips_and_validates():
    """A plan with uneven splits survives JSON and plan validation; the same plan with the
    uneven dim split over both mesh axes (no device layout) is refused."""
    import json

    import autoparallel
    from autoparallel.errors import PlanMismatchError
    from autoparallel.plan import Plan
    from autoparallel.tracer import ColoTracer
    from autoparallel.validate import validate_plan
    from models import ShardParams

    model = _MLP(251)
    inputs = {"x": torch.empty(4, 24, device="meta"), "y": torch.empty(4, 24, device="meta")}
    traced = ColoTracer().trace(model, inputs)
    plan = plan_traced(traced, autoparallel.MeshSpec((2, 2)),
                       PlanOptions(cost_model=ShardParams("cpu"), time_limit=30, cache_dir=False))
    spec = plan.param_placements["up.weight"]
    assert uneven_dims((251, 24), spec, (2, 2)) == (0,), spec
    again = Plan.from_json(plan.to_json())
    assert again == plan
    validate_plan(again, traced)
    d = json.loads(plan.to_json())
    d["param_placements"]["up.weight"] = ["S0", "S0"]
    next(n for n in d["nodes"] if n["name"] == "up_weight")["output_specs"] = [["S0", "S0"]]
    with pytest.raises(PlanMismatchError, match="uneven over several mesh axes"):
        validate_plan(Plan.from_json(json.dumps(d)), traced)


def _real_ranks_worker(rank: int) -> None:
    """One of 4 gloo ranks: the MLP with hidden 250 (parameters in uneven pieces) and GPT-2 with
    vocabulary 50257 (the logits split by vocabulary) at parity on a (4,) mesh, and GPT-2 with 25
    heads of 8 on (2, 2) (heads split 13/12, merged in units of 8: test_uneven_units), where
    the device's row counts are plain ints read from its coordinate."""
    import os
    import sys

    from torch.distributed.tensor import init_device_mesh

    sys.path.insert(0, os.path.dirname(__file__))
    import autoparallel
    from autoparallel.placement import UnitShard
    from models import CheapComm, ShardParams
    from test_uneven_units import _gpt2_25_heads

    mesh = init_device_mesh("cpu", (4,))
    g = torch.Generator().manual_seed(0)
    mlp = {"x": torch.randn(4, 24, generator=g), "y": torch.randn(4, 24, generator=g)}
    gpt = {"input_ids": torch.randint(0, 50257, (4, 8), generator=g),
           "labels": torch.randint(0, 50257, (4, 8), generator=g)}
    gpt["input_ids"][0, :4] = torch.tensor([0, 50256, 3 * 12565, 3 * 12565 - 1])
    heads = {"input_ids": torch.randint(0, 64, (2, 8), generator=g), "labels": torch.randint(0, 64, (2, 8), generator=g)}
    for ref, batch, cost, loss, on in [(_MLP(250), mlp, ShardParams("cpu"), lambda out: out, mesh),
                                       (_gpt2_vocab_50257(), gpt, CheapComm("cpu"), lambda out: out.loss, mesh),
                                       (_gpt2_25_heads(), heads, CheapComm("cpu"), lambda out: out.loss,
                                        init_device_mesh("cpu", (2, 2)))]:
        pmodel = autoparallel.autoparallelize(
            copy.deepcopy(ref), {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in batch.items()},
            device_mesh=on, cost_model=cost, cache_dir=False)
        want = loss(ref(**batch))
        want.backward()
        got = loss(pmodel(**batch))
        got.backward()
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-4, atol=1e-5)
        for name, p in pmodel.named_parameters():
            torch.testing.assert_close(whole(p.grad), dict(ref.named_parameters())[name].grad,
                                       rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {rank}, grad of {name}: {m}")
        assert any(uneven_dims(n.out_shapes[0], n.output_specs[0], on.shape) for n in pmodel.plan.nodes.values()
                   if n.out_shapes), "the plan should split a dim unevenly"
    assert any(isinstance(p, UnitShard) for n in pmodel.plan.nodes.values() for spec in n.output_specs
               for p in spec), "GPT-2 with 25 heads should cut a dim in units"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_uneven_splits_on_real_processes():
    """The MLP and GPT-2 cases above through real c10d (gloo, 4 processes, one spawn)."""
    pytest.importorskip("transformers")
    from gloo_ranks import spawn

    spawn(_real_ranks_worker, 4)
