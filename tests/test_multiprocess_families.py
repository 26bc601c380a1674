"""Tier 3 for every model family: 4 real gloo processes on a 2 x 2 mesh run each model of
the zoo (the MLP, the CNN, GPT-2, LLaMA, BERT, T5, every entry of ``FAMILIES``, timm's ViT
and ResNet-18 in training mode, and the mixture-of-experts models of ``MOE``, also with expert
parallelism forced: ``<name>-ep``, the constraints ``EXPERT_PARALLEL``, and ``<name>-ep4`` the
same on the 1-D mesh of the 4 ranks, where one all-to-all spans all of them) through
``autoparallelize`` and check parity with a single-device copy through real c10d.

For each family every rank builds the model with the same seed, plans and emits it with the
``ShardParams`` cost model (gradient reduction priced high, so the planner splits the
parameters: tensor parallelism, whose all-gathers, reduce-scatters and all-to-alls then go
through real c10d; the worker checks that the emitted graph really holds ``_c10d_functional``
collectives), runs one forward+backward on a batch identical on every rank, and compares the
loss and every ``whole(p.grad)`` with the single-device model (fp32, rtol 1e-4,
atol 1e-5); then one SGD step on both and a second forward whose loss must agree too.

All families share ONE spawn: starting 4 processes and their process group costs ~2 s, and
planning (on rank 0, broadcast to the others) dominates the rest. A family that fails is
recorded (family, rank, what differed) and the loop goes on, so one broken family hides no
other; rank 0 writes the gathered results to a file that the per-family tests below read
(a broken family fails its own test, and ``test_all_families`` lists every failure at once).
"""

from __future__ import annotations

import copy
import json
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import autoparallel
from models import EXPERT_PARALLEL, FAMILIES, MOE, ShardParams, TIMM, batch_for, placements_of, to_meta, whole
from gloo_ranks import spawn
from test_multiprocess import ATOL, MESH_SHAPE, RTOL, WORLD
from test_parity import build, loss_of

pytest.importorskip("transformers")

EP = "-ep"  # a MOE model's name with this suffix: expert parallelism forced
EP_1D = "-ep4"  # ... forced on the mesh (4,)
# every model of tests/models.py: the plain ones, the four of test_parity, FAMILIES, timm's, then MOE's,
# with the planner's choice and with expert parallelism forced
NAMES = (["mlp", "cnn", "gpt2", "llama", "bert", "t5"] + sorted(FAMILIES) + sorted(TIMM) + sorted(MOE)
         + [f"{n}{EP}" for n in sorted(MOE)] + [f"{n}{EP_1D}" for n in sorted(MOE)])
LR = 0.1
TIME_LIMIT = 5.0  # seconds for the ILP solver per family (these plans solve at the LP relaxation)
PG_TIMEOUT = 90  # seconds: a rank stuck in a collective fails instead of hanging the run
C10D = "_c10d_functional"


def _collectives(gm) -> list[str]:
    """Names of the c10d functional collectives in the emitted graph (waits left out)."""
    ops = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
                and node.target.namespace == C10D and node.target.__name__.split(".")[0] != "wait_tensor":
            ops.append(node.target.__name__.split(".")[0])
    return ops


def _grad_diffs(pmodel, ref_params: dict) -> list[str]:
    """Every parameter whose gradient differs from the single-device one (all ranks call
    ``full_tensor`` in the same order: it is a collective)."""
    names = dict(pmodel.named_parameters())
    if set(names) != set(ref_params):
        return [f"parameter names differ: {sorted(set(names) ^ set(ref_params))}"]
    out = []
    for name, p in names.items():
        ref = ref_params[name].grad
        if p.grad is None or ref is None:
            if (p.grad is None) != (ref is None):
                out.append(f"grad of {name}: {'none' if p.grad is None else 'one'} here, "
                           f"{'none' if ref is None else 'one'} on one device")
            continue
        full = whole(p.grad)
        if full.shape != ref.shape:
            out.append(f"grad of {name}: shape {tuple(full.shape)}, single-device {tuple(ref.shape)}")
        elif not torch.allclose(full, ref, rtol=RTOL, atol=ATOL):
            err = (full - ref).abs().max().item()
            out.append(f"grad of {name} ({placements_of(p.grad)}): max abs err {err:.3g} "
                       f"(max abs {ref.abs().max().item():.3g})")
    return out


def _buffer_diffs(pmodel, ref) -> list[str]:
    """Every buffer of the model (BatchNorm's running statistics) that differs from the
    single-device one after the forward (``full_tensor`` is a collective: all ranks call it in
    the same order), and the state_dict keys, which must be the model's."""
    ref_buffers = dict(ref.named_buffers())
    out = []
    buffers = dict(pmodel.named_buffers())
    if set(pmodel.state_dict()) != set(ref.state_dict()):
        out.append(f"state_dict keys differ: {sorted(set(pmodel.state_dict()) ^ set(ref.state_dict()))}")
    for name in ref_buffers:
        b = buffers[name]
        full = b.full_tensor() if isinstance(b, DTensor) else b
        if not torch.allclose(full.double(), ref_buffers[name].double(), rtol=RTOL, atol=ATOL):
            out.append(f"buffer {name}: max abs err {(full.double() - ref_buffers[name].double()).abs().max():.3g}")
    return out


def _loss_diff(when: str, got, want) -> list[str]:
    got, want = got.detach(), want.detach()
    if isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want, rtol=RTOL,
                                                                                    atol=ATOL):
        return []
    return [f"{when}: loss {got} != single-device {want.item():.8f}"]


def _run_family(name: str, rank: int, meshes: dict, info: dict) -> list[str]:
    """Plan, emit, one step and the check after it; returns what differed (empty if nothing).
    ``meshes``: mesh shape → DeviceMesh, the 2 x 2 one and the 1-D one of the ``-ep4`` names."""
    constraints, mesh = None, meshes[MESH_SHAPE]
    for suffix, shape in ((EP, MESH_SHAPE), (EP_1D, (WORLD,))):
        if not name.endswith(suffix):
            continue
        name, mesh = name[:-len(suffix)], meshes[shape]
        held, out = EXPERT_PARALLEL[shape]
        constraints = {"*.experts.gate_up_proj": held, "*.experts.down_proj": held, "*.mlp.experts": out}
    model = build(name)  # torch.manual_seed(0) inside: the same weights on every rank
    ref = copy.deepcopy(model)
    ref_params = dict(ref.named_parameters())
    batch = batch_for(name, 0)  # seeded generator: the same batch on every rank
    t0 = time.perf_counter()
    try:
        pmodel = autoparallel.autoparallelize(model, to_meta(batch), device_mesh=mesh, constraints=constraints,
                                               cost_model=ShardParams("cpu"), time_limit=TIME_LIMIT)
    except Exception as e:
        # planning runs on rank 0 alone, the others wait for its plan in a broadcast: release
        # them with no plan, so that they fail too instead of hanging
        if rank == 0 and any(f.name == "plan_traced" for f in traceback.extract_tb(e.__traceback__)):
            dist.broadcast_object_list([None], src=0)
        raise
    info["plan_s"] = round(time.perf_counter() - t0, 2)
    problems = []
    colls = _collectives(pmodel.graph_module)
    info["collectives"] = sorted(set(colls))
    if not colls:
        problems.append("the emitted graph holds no c10d collective")
    split = [n for n, p in pmodel.named_parameters() if any(type(x).__name__ == "Shard" for x in placements_of(p))]
    info["split_params"] = f"{len(split)}/{len(list(pmodel.parameters()))}"
    if not split:
        problems.append("ShardParams split no parameter")

    t0 = time.perf_counter()
    loss = loss_of(pmodel(**batch))
    loss.backward()
    ref_loss = loss_of(ref(**batch))
    ref_loss.backward()
    problems += _loss_diff("step 0", loss, ref_loss)
    problems += [f"step 0: {d}" for d in _grad_diffs(pmodel, ref_params)]
    problems += [f"step 0: {d}" for d in _buffer_diffs(pmodel, ref)]

    torch.optim.SGD(pmodel.parameters(), lr=LR).step()
    torch.optim.SGD(ref.parameters(), lr=LR).step()
    batch = batch_for(name, 1)
    with torch.no_grad():
        problems += _loss_diff("after one SGD step", loss_of(pmodel(**batch)), loss_of(ref(**batch)))
    info["run_s"] = round(time.perf_counter() - t0, 2)
    return problems


def _worker(rank: int, names: list[str], out_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {MESH_SHAPE: init_device_mesh("cpu", MESH_SHAPE, mesh_dim_names=("dp", "tp")),
              (WORLD,): init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))}
    results = {}
    for name in names:
        info: dict = {}
        try:
            problems = _run_family(name, rank, meshes, info)
        except Exception as e:
            problems = [f"{type(e).__name__}: {e}".strip()[:2000] + "\n" + traceback.format_exc()[-1500:]]
        # one gather per family: every rank's findings, and the ranks kept in step
        gathered: list = [None] * WORLD
        dist.all_gather_object(gathered, {"rank": rank, "problems": problems, "info": info})
        results[name] = {"failures": [{"rank": g["rank"], "what": p} for g in gathered for p in g["problems"]],
                         "info": gathered[0]["info"]}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()


@pytest.fixture(scope="module")
def family_results(request, tmp_path_factory):
    """One spawn for the families selected in this module (all of them unless ``-k``)."""
    selected = {item.callspec.params["name"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}
    names = [n for n in NAMES if n in selected] or NAMES
    out = tmp_path_factory.mktemp("families") / "results.json"
    t0 = time.perf_counter()
    spawn(_worker, WORLD, names, str(out), timeout_s=PG_TIMEOUT)
    results = json.loads(out.read_text())
    print(f"\n{len(names)} families on 4 gloo ranks in {time.perf_counter() - t0:.1f} s")
    for name, r in results.items():
        print(f"  {name:12s} {r['info']} {'FAILED' if r['failures'] else 'ok'}")
    return results


def _report(name: str, result: dict) -> str:
    return "\n".join(f"{name}, rank {f['rank']}: {f['what']}" for f in result["failures"])


@pytest.mark.multiprocess
@pytest.mark.timeout(600)  # the first test pays for the spawn of every family
@pytest.mark.parametrize("name", NAMES)
def test_family_parity_4_gloo_ranks_2x2_mesh(name, family_results):
    result = family_results[name]
    assert not result["failures"], _report(name, result)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_all_families(family_results):
    """Every failure of every family at once, and the collectives the
    families exercise together: all-gather, reduce-scatter and all-to-all through real c10d."""
    unexpected = [_report(n, r) for n, r in family_results.items() if r["failures"]]
    assert not unexpected, "families differ from one device:\n" + "\n".join(unexpected)
    seen = set().union(*(r["info"].get("collectives", []) for r in family_results.values()))
    if set(family_results) == set(NAMES):
        missing = {"all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"} - seen
        assert not missing, f"no family's graph runs {sorted(missing)}; seen {sorted(seen)}"
