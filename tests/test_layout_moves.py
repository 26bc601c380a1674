"""Each one-step layout move of ``passes.apply_plan._Emitter`` on simulated ranks, and the
two-step redistributions it emits with fewer copies (gathers of one dim joined once, pieces a
collective leaves at the front taken as they are by the next): the right local piece on every
rank, in contiguous memory (what any next op can take, a ``view`` included), and a 0-d tensor
kept 0-d."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.fx as fx
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.tensor import Partial, Replicate, Shard

from autoparallel.codegen.module import _mesh_coord
from autoparallel.mesh import MeshSpec
from autoparallel.passes.apply_plan import _Emitter, process_groups
from autoparallel.placement import dim_unit
from autoparallel.solver.layout import Move

R, P = Replicate(), Partial()
MESH = (2, 2)
CASES = {  # (global shape, source spec, move (kind, axis, src_dim, dst_dim[, unit]), destination spec)
    "all_gather dim 1": ((4, 6, 8), (Shard(0), Shard(1)), ("all_gather", 1, 1, None), (Shard(0), R)),
    "all_gather dim 1 of 2 axes": ((2, 8, 6), (Shard(1), Shard(1)), ("all_gather", 1, 1, None), (Shard(1), R)),
    "all_gather dim 0": ((4, 6), (Shard(0), R), ("all_gather", 0, 0, None), (R, R)),
    "reduce_scatter dim 2": ((4, 6, 8), (P, Shard(0)), ("reduce_scatter", 0, None, 2), (Shard(2), Shard(0))),
    "reduce_scatter dim 0": ((4, 6), (R, P), ("reduce_scatter", 1, None, 0), (R, Shard(0))),
    "all_reduce": ((4, 6), (P, Shard(1)), ("all_reduce", 0, None, None), (R, Shard(1))),
    "all_to_all dim 1 to 2": ((4, 6, 8), (Shard(0), Shard(1)), ("all_to_all", 1, 1, 2), (Shard(0), Shard(2))),
    "all_to_all dim 2 to 0": ((4, 6, 8), (R, Shard(2)), ("all_to_all", 1, 2, 0), (R, Shard(0))),
    "all_to_all dim 0 to 1": ((4, 6, 8), (Shard(0), R), ("all_to_all", 0, 0, 1), (Shard(1), R)),
    "slice dim 1": ((4, 6, 8), (Shard(0), R), ("slice", 1, None, 1), (Shard(0), Shard(1))),
    "mask 0-d": ((), (R, R), ("mask", 0, None, None), (P, R)),
    # two moves: (kind, axis, src_dim, dst_dim) each
    "all_gather dim 1 over both axes": ((2, 8, 6), (Shard(1), Shard(1)),
                                        [("all_gather", 1, 1, None), ("all_gather", 0, 1, None)], (R, R)),
    "all_gather dim 2 then all_to_all dim 0 to 2": ((4, 6, 8), (Shard(0), Shard(2)),
                                                     [("all_gather", 1, 2, None), ("all_to_all", 0, 0, 2)],
                                                     (Shard(2), R)),
}


def piece(full: torch.Tensor, spec, coord) -> torch.Tensor:
    """The local tensor of ``full`` placed by ``spec`` on the device at ``coord`` (a dim split
    over several axes in ascending axis order, ``torch.chunk`` pieces of its units for a
    ``UnitShard``); a pending sum: the value on coordinate 0."""
    for d in range(full.dim()):
        axes = [a for a, p in enumerate(spec) if isinstance(p, Shard) and p.dim == d]
        idx = 0
        for a in axes:
            idx = idx * MESH[a] + coord[a]
        unit = dim_unit(spec, d)
        units = full.unflatten(d, [full.shape[d] // unit, unit])
        full = units.chunk(math.prod(MESH[a] for a in axes), d)[idx].flatten(d, d + 1)
    partial = [a for a, p in enumerate(spec) if p == P]
    return full if all(coord[a] == 0 for a in partial) else torch.zeros_like(full)


@pytest.mark.parametrize("case", CASES)
def test_move(case, sim_mesh):
    shape, src, moves, dst = CASES[case]
    moves = [Move(*m[:4], 0, *m[4:]) for m in (moves if isinstance(moves, list) else [moves])]
    mesh = sim_mesh(MESH)
    ranks = range(mesh.size())
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    graph = fx.Graph()
    coord_node, x = graph.placeholder("mesh_coord"), graph.placeholder("x")
    spec = MeshSpec(MESH)
    em = _Emitter(graph, coord_node, SimpleNamespace(mesh=spec),
                  process_groups(spec.axis_names, [mesh.get_group(a).group_name for a in range(len(MESH))]))
    graph.output(em.redistribute(x, shape, src, moves))
    module = fx.GraphModule(torch.nn.Module(), graph)
    with LocalTensorMode(frozenset(ranks)):
        coord = _mesh_coord(mesh)
    coords = {r: coord._local_tensors[r].tolist() for r in ranks}
    addends = {r: piece(full, src, coords[r]) for r in ranks}
    if P in src:  # a pending sum: every device holds a share (the addends sum to the value)
        addends = {r: piece(full, [R if p == P else p for p in src], coords[r]) / MESH[moves[0].axis]
                   for r in ranks}
    with LocalTensorMode(frozenset(ranks)):
        out = module(coord, LocalTensor(addends))
    for r in ranks:
        got, want = out._local_tensors[r], piece(full, dst, coords[r])
        assert got.shape == want.shape, f"rank {r}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
        torch.testing.assert_close(got, want, msg=lambda m: f"rank {r}: {m}")
        assert got.is_contiguous(), f"rank {r}: strides {got.stride()} of shape {tuple(got.shape)}"
