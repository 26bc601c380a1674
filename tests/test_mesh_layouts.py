"""Meshes that list their ranks in another order than ascending.

A collective joins pieces in process-group rank order, and torch builds every process group of
a mesh with its ranks ascending, whatever order the ``DeviceMesh`` lists them in. The module's
local slices (by ``mesh_coord``) and its DTensor parameters (``distribute_tensor`` scatters in
group order) must use the same order: ``codegen.module._mesh_coord``.
"""

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import autoparallel
from autoparallel.codegen.module import _mesh_coord
from test_parity import run_parity

# a descending 1-D axis, both axes descending, and the transpose (axis 0 with stride 1)
LAYOUTS = {"1,0": [1, 0], "3,2|1,0": [[3, 2], [1, 0]], "0,2|1,3": [[0, 2], [1, 3]]}
# rank r's coordinate in each layout: its rank in the process group of each axis
COORDS = {"1,0": [[0], [1]], "3,2|1,0": [[0, 0], [0, 1], [1, 0], [1, 1]],
          "0,2|1,3": [[0, 0], [1, 0], [0, 1], [1, 1]]}


def layout_mesh(sim_mesh, layout):
    """A factory for run_parity: the fake process group of sim_mesh, the mesh of ``layout``."""
    def make(shape):
        sim_mesh(shape)
        return DeviceMesh("cpu", layout)
    return make


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_coordinate_is_where_distribute_tensor_puts_shards(layout, sim_mesh):
    shape = tuple(torch.tensor(LAYOUTS[layout]).shape)
    mesh = layout_mesh(sim_mesh, LAYOUTS[layout])(shape)
    with LocalTensorMode(frozenset(range(mesh.size()))):
        coord = _mesh_coord(mesh)
        shards = []
        for a, n in enumerate(shape):  # element i of an arange of n on the device of coordinate i
            placements = [Replicate()] * len(shape)
            placements[a] = Shard(0)
            shards.append(distribute_tensor(torch.arange(n), mesh, placements).to_local())
    for r, want in enumerate(COORDS[layout]):
        assert coord._local_tensors[r].tolist() == want
        assert [s._local_tensors[r].item() for s in shards] == want


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_parity_on_permuted_meshes(layout, sim_mesh):
    """The MLP with its parameters split (batch slices, Megatron column and row, all-reduces,
    gradient buckets); GPT-2 on such meshes runs in the real-process test."""
    shape = tuple(torch.tensor(LAYOUTS[layout]).shape)
    run_parity("mlp", shape, "shard-params", layout_mesh(sim_mesh, LAYOUTS[layout]), steps=2)


def test_mesh_whose_lines_order_ranks_differently_is_refused(sim_mesh):
    """Along axis 0, column [0, 2] ascends and column [3, 1] descends: no numbering of the
    devices agrees with both columns' process groups."""
    mesh = layout_mesh(sim_mesh, [[0, 3], [2, 1]])((2, 2))
    with LocalTensorMode(frozenset(range(4))), \
            pytest.raises(autoparallel.MeshMismatchError, match=r"lines along mesh axis 0 order their ranks"):
        _mesh_coord(mesh)
