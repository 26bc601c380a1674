"""ParallelModule: the emitted module, a recompiled GraphModule on local shards."""

from __future__ import annotations

from dataclasses import dataclass

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


Signature = tuple[tuple[tuple[int, ...], torch.dtype], ...]
"""Per tensor input (flattened ``(args, kwargs)`` order), its global ``(shape, dtype)``."""


def input_signature(input_meta) -> Signature:
    """The :data:`Signature` of a traced model's ``input_meta``."""
    return tuple((tuple(shape) if shape is not None else None, dtype) for shape, dtype in input_meta)


@dataclass
class Variant:
    """One per-device graph of a :class:`ParallelModule` and what it was made for.

    Attributes:
        graph_module: the per-device ``fx.GraphModule``, reading the module's parameters.
        plan: its :class:`~autoparallel.Plan`.
        in_spec / out_spec: pytree specs of ``(args, kwargs)`` and of the output.
        input_meta: global ``(shape, dtype)`` of each flattened input.
        buffer_mutations: flat output index → buffer the forward updates (written back).
    """

    graph_module: fx.GraphModule
    plan: Plan
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    input_meta: list
    buffer_mutations: dict[int, str]


class ParallelModule(nn.Module):
    """The parallel module: same call signature and outputs as the original model.

    Parameters are ``nn.Parameter``s holding DTensors on ``device_mesh``, registered under
    the original model's names (tied parameters stay one object), so ``torch.optim``,
    ``clip_grad_norm_`` and ``state_dict()`` work unchanged. Inputs are the global batch,
    the same on every rank; outputs are whole (replicated) tensors in the model's output
    structure (e.g. a Hugging Face ``ModelOutput``). Buffers the forward updates in place
    (BatchNorm's running statistics) are graph outputs (``buffer_mutations``: flat output
    index → buffer name), copied into the buffers' local tensors after every forward.

    With ``autoparallelize(..., replan=True)``, a call whose tensor inputs have other shapes
    or dtypes than planned (same structure and keywords) captures and plans the model again
    for them, every parameter pinned to the placement it has here, and caches the new graph
    by input signature (:attr:`plans`); later calls with any of these shapes reuse it.

    Attributes:
        plan: the :class:`~autoparallel.Plan` made for the planned input shapes.
        graph_module: the per-device ``fx.GraphModule`` of that plan;
            ``print(pmodel.graph_module.code)`` shows its collectives.
        plans / graph_modules: input signature → plan / graph module, re-plans included.

    Raises (on call):
        InputMismatchError: inputs whose structure or keywords differ from the planned ones,
            or (without ``replan=True``) whose shapes or dtypes do.
        AutoParallelError (a subclass): when re-planning fails, e.g. CaptureError, or
            InfeasiblePlanError under a memory budget the new shapes do not fit.
    """

    def __init__(self, model: nn.Module, graph: fx.Graph | None, plan: Plan, device_mesh, *, in_spec=None,
                 out_spec=None, input_meta=None, param_names: dict[str, list[str]],
                 buffer_names: dict[str, list[str]], constants: dict[str, torch.Tensor],
                 buffer_mutations: dict[int, str] | None = None):
        super().__init__()
        self.plan = plan
        self.device_mesh = device_mesh
        self.__dict__["_variants"] = {}  # input signature -> Variant; the first is the planned one
        self.__dict__["_replanner"] = None  # set by autoparallelize(..., replan=True)
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
        # buffers registered with persistent=False (e.g. rotary inv_freq) stay out of state_dict()
        transient = {f"{m}.{b}" if m else b for m, mod in model.named_modules(remove_duplicate=False)
                     for b in mod._non_persistent_buffers_set}
        repl = (Replicate(),) * device_mesh.ndim
        for tid, (orig, names) in groups.items():
            target = target_of.get(tid)
            spec = plan.param_placements.get(target, repl) if target else repl  # unused: replicated
            dt = distribute_tensor(orig.detach().to(device), device_mesh, list(spec))
            dt = DTensor.from_local(per_rank(dt.to_local()), device_mesh, list(spec), run_check=False)
            value = nn.Parameter(dt, requires_grad=orig.requires_grad) if isinstance(orig, nn.Parameter) else dt
            for name in names + ([target] if target and target not in names else []):
                set_attr(self, name, value, persistent=name not in transient)
        for target, value in constants.items():  # lifted by capture: not the model's state
            set_attr(self, target, value.to(device), persistent=False)
        self.__dict__["_coord"] = _mesh_coord(device_mesh)
        if graph is not None:  # else the caller adds the first variant (autoparallel.api.emit does)
            self.add_variant(fx.GraphModule(self, graph, class_name="ParallelGraph"), plan, in_spec=in_spec,
                             out_spec=out_spec, input_meta=input_meta, buffer_mutations=buffer_mutations)

    def graph_root(self, constants: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What ``get_attr`` nodes of a re-planned graph read: this module's parameters and
        buffers (the same objects, by every name) and that graph's own lifted ``constants``
        (moved to the device), which take precedence over the first graph's constants of the
        same name without replacing them. Pass it as the root of ``fx.GraphModule``."""
        device = self.device_mesh.device_type
        root = dict(self.named_parameters(remove_duplicate=False))
        root.update(self.named_buffers(remove_duplicate=False))
        root.update({k: v.to(device) for k, v in constants.items()})
        return root

    def add_variant(self, graph_module: fx.GraphModule, plan: Plan, *, in_spec, out_spec, input_meta,
                    buffer_mutations: dict[int, str] | None = None) -> Variant:
        """Register ``graph_module`` (made for ``plan``) to run inputs of ``input_meta``'s shapes
        and dtypes. The first variant added is :attr:`plan` / :attr:`graph_module`; later ones
        are re-plans for other input shapes (``autoparallelize(..., replan=True)``), over the same
        parameter objects.

        Raises:
            ValueError: a buffer the forward updates is not planned replicated, or the plan
                places a parameter otherwise than this module holds it.
        """
        mutations = dict(buffer_mutations or {})
        for target in mutations.values():
            if any(p != Replicate() for p in plan.param_placements.get(target, ())):
                raise ValueError(f"buffer {target} is updated by the forward and must be planned replicated, "
                                 f"not {plan.param_placements[target]}")
        if self._variants:
            moved = [n for n, s in plan.param_placements.items()
                     if tuple(s) != tuple(self.plan.param_placements.get(n, s))]
            if moved:
                raise ValueError(f"a re-planned graph must keep every parameter where the module holds it; "
                                 f"{moved[0]} is placed {plan.param_placements[moved[0]]}, not "
                                 f"{self.plan.param_placements[moved[0]]}")
        variant = Variant(graph_module, plan, in_spec, out_spec, list(input_meta), mutations)
        if not self._variants:
            self.plan = plan
            self.__dict__["graph_module"] = graph_module  # not a submodule: parameters listed once, by model names
            self._in_spec, self._out_spec, self._input_meta = in_spec, out_spec, variant.input_meta
        self._variants[input_signature(variant.input_meta)] = variant
        return variant

    @property
    def plans(self) -> dict[Signature, Plan]:
        """Input signature (per tensor input, ``(shape, dtype)``) → the plan that runs it: the
        planned shapes first, then every shape re-planned for (``replan=True``)."""
        return {sig: v.plan for sig, v in self._variants.items()}

    @property
    def graph_modules(self) -> dict[Signature, fx.GraphModule]:
        """Input signature → the per-device graph module that runs it (see :attr:`plans`)."""
        return {sig: v.graph_module for sig, v in self._variants.items()}

    def _flat_inputs(self, args, kwargs) -> tuple[list, Variant]:
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
        sig = tuple((tuple(t.shape), t.dtype) for t in tensors)
        variant = self._variants.get(sig)
        if variant is not None:
            return tensors, variant
        if self._replanner is not None:
            return tensors, self._replanner(self, args, kwargs)
        for path, t, (shape, dtype) in zip(paths, tensors, self._input_meta):
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                name = pytree.keystr(path[1:]) if path else "?"
                raise InputMismatchError(
                    f"input {name} has shape {tuple(t.shape)} and dtype {t.dtype}, but the plan was made for "
                    f"shape {tuple(shape)} and dtype {dtype}; call autoparallelize again with meta_inputs "
                    "of the new shape, or pass replan=True to autoparallelize to re-plan on each new shape")
        raise InputMismatchError(f"inputs of shapes and dtypes {sig} have no plan")  # unreachable

    def forward(self, *args, **kwargs):
        tensors, variant = self._flat_inputs(args, kwargs)
        outs = variant.graph_module(self._coord, *tensors)
        if variant.buffer_mutations:
            with torch.no_grad():
                for i, target in variant.buffer_mutations.items():
                    buf = get_attr(self, target)  # replicated (planned so): every device holds it whole
                    (buf.to_local() if isinstance(buf, DTensor) else buf).copy_(outs[i])
            outs = [o for i, o in enumerate(outs) if i not in variant.buffer_mutations]
        return pytree.tree_unflatten(list(outs), variant.out_spec)
