"""ParallelModule: the emitted module, a recompiled GraphModule on local shards."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from ..errors import InputMismatchError
from ..fqn import get_attr, set_attr
from ..plan import Plan
from ..runtime_kernels import per_rank


def _mesh_coord(device_mesh) -> torch.Tensor:
    """This device's coordinate on each mesh axis (a LocalTensor under LocalTensorMode)."""
    from torch.distributed._local_tensor import local_tensor_mode

    mode = local_tensor_mode()
    mesh = device_mesh.mesh
    if mode is not None:
        def coord(rank: int) -> torch.Tensor:
            return (mesh == rank).nonzero()[0].to(torch.int64)
        with mode.disable():
            per_rank = {r: coord(r) for r in mode.ranks}
        return mode.rank_map(lambda r: per_rank[r].clone())
    return torch.tensor(device_mesh.get_coordinate(), dtype=torch.int64, device=device_mesh.device_type)


class ParallelModule(nn.Module):
    """The parallel module: same call signature and outputs as the original model.

    Parameters are ``nn.Parameter``s holding DTensors on ``device_mesh``, registered under
    the original model's names (tied parameters stay one object), so ``torch.optim``,
    ``clip_grad_norm_`` and ``state_dict()`` work unchanged. Inputs are the global batch,
    the same on every rank; outputs are whole (replicated) tensors in the model's output
    structure (e.g. a Hugging Face ``ModelOutput``).

    Attributes:
        plan: the :class:`~autoparallel.Plan` the module runs.
        graph_module: the per-device ``fx.GraphModule``; ``print(pmodel.graph_module.code)``
            shows its collectives.

    Raises (on call):
        InputMismatchError: inputs whose structure, shapes or dtypes differ from the
            planned ones.
    """

    def __init__(self, model: nn.Module, graph: fx.Graph, plan: Plan, device_mesh, *, in_spec, out_spec,
                 input_meta, param_names: dict[str, list[str]], buffer_names: dict[str, list[str]],
                 constants: dict[str, torch.Tensor]):
        super().__init__()
        self.plan = plan
        self.device_mesh = device_mesh
        self._in_spec, self._out_spec, self._input_meta = in_spec, out_spec, input_meta
        device = device_mesh.device_type
        # every parameter and buffer of the model, tied names grouped; the graph reads one name of each
        groups: dict[int, tuple[torch.Tensor, list[str]]] = {}
        for name, t in list(model.named_parameters(remove_duplicate=False)) + \
                list(model.named_buffers(remove_duplicate=False)):
            groups.setdefault(id(t), (t, []))[1].append(name)
        target_of: dict[int, str] = {}
        for target in list(param_names) + list(buffer_names):
            t = get_attr(model, target)
            groups.setdefault(id(t), (t, []))
            target_of[id(t)] = target
        repl = (Replicate(),) * device_mesh.ndim
        for tid, (orig, names) in groups.items():
            target = target_of.get(tid)
            spec = plan.param_placements.get(target, repl) if target else repl  # unused: replicated
            dt = distribute_tensor(orig.detach().to(device), device_mesh, list(spec))
            dt = DTensor.from_local(per_rank(dt.to_local()), device_mesh, list(spec), run_check=False)
            value = nn.Parameter(dt, requires_grad=orig.requires_grad) if isinstance(orig, nn.Parameter) else dt
            for name in names + ([target] if target and target not in names else []):
                set_attr(self, name, value)
        for target, value in constants.items():
            set_attr(self, target, value.to(device))
        gm = fx.GraphModule(self, graph, class_name="ParallelGraph")
        self.__dict__["graph_module"] = gm  # not a submodule: parameters are listed once, under model names
        self.__dict__["_coord"] = _mesh_coord(device_mesh)

    def _flat_inputs(self, args, kwargs) -> list:
        expected_kw = self._in_spec.child(1).context if self._in_spec.num_children > 1 else []
        if set(kwargs) != set(expected_kw or []):
            raise InputMismatchError(f"keyword arguments {sorted(kwargs)} differ from the planned ones "
                                     f"{sorted(expected_kw or [])}")
        kwargs = {k: kwargs[k] for k in expected_kw}
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != self._in_spec:
            raise InputMismatchError(f"input structure {spec} differs from the planned {self._in_spec}")
        paths = [p for p, x in pytree.tree_flatten_with_path((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        if len(tensors) != len(self._input_meta):
            raise InputMismatchError(f"{len(tensors)} tensor inputs given, {len(self._input_meta)} planned")
        for path, t, (shape, dtype) in zip(paths, tensors, self._input_meta):
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                name = pytree.keystr(path[1:]) if path else "?"
                raise InputMismatchError(
                    f"input {name} has shape {tuple(t.shape)} and dtype {t.dtype}, but the plan was made for "
                    f"shape {tuple(shape)} and dtype {dtype}; call autoparallelize again with meta_inputs "
                    "of the new shape")
        return tensors

    def forward(self, *args, **kwargs):
        tensors = self._flat_inputs(args, kwargs)
        outs = self.graph_module(self._coord, *tensors)
        return pytree.tree_unflatten(list(outs), self._out_spec)
