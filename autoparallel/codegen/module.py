"""ParallelModule: the emitted module, a recompiled GraphModule on local shards."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from ..errors import InputMismatchError
from ..fqn import get_attr, set_attr
from ..pickling import NotPicklable, ParallelGraph
from ..plan import Plan
from ..runtime_kernels import per_rank
from .batch_check import BatchCheck


def _mesh_coord(device_mesh) -> torch.Tensor:
    """This device's coordinate on each mesh axis, counted as the axis' process group counts its
    ranks (a LocalTensor under LocalTensorMode, one coordinate per simulated rank).

    A collective joins pieces in process-group rank order, and torch builds the group of every
    line of the mesh with its ranks ascending (``new_group`` and ``split_group`` sort them; an
    axis spanning the world reuses the default group), whatever order the mesh lists them in:
    on ``DeviceMesh("cpu", [1, 0])`` rank 0 is first in its group though ``get_coordinate()``
    says 1. Local slices must pick pieces in the same order as the collectives join them, and
    ``distribute_tensor`` scatters parameter shards in group order too, so that order is the
    coordinate. It is a coordinate system only when every line along an axis orders its
    positions alike (a descending axis, or any permutation applied to the whole axis).

    Raises:
        MeshMismatchError: lines along one mesh axis order their ranks differently (e.g.
            ``[[0, 3], [2, 1]]``): no numbering of the devices agrees with the collectives of
            every axis; or a process group of the mesh does not rank its members ascending.
    """
    import torch.distributed as dist
    from torch.distributed._local_tensor import local_tensor_mode, maybe_disable_local_tensor_mode

    from ..errors import MeshMismatchError

    mode = local_tensor_mode()
    with maybe_disable_local_tensor_mode():  # plain tensors, also under simulated ranks
        mesh = device_mesh.mesh.cpu()
        coords = torch.empty(*mesh.shape, mesh.ndim, dtype=torch.int64)  # per mesh position
        for a, n in enumerate(mesh.shape):
            lines = mesh.movedim(a, -1).reshape(-1, n)
            order = lines.argsort(dim=1)  # each line's positions, ascending by rank
            if not (order == order[0]).all():
                bad = next(line for line, o in zip(lines.tolist(), order) if not (o == order[0]).all())
                raise MeshMismatchError(
                    f"DeviceMesh {mesh.tolist()}: its lines along mesh axis {a} order their ranks differently "
                    f"({lines[0].tolist()} and {bad}); process groups rank their members ascending, so no "
                    "numbering of the devices agrees with the collectives of every axis. Use a mesh whose "
                    "lines along each axis list their ranks in the same relative order, e.g. one from "
                    "init_device_mesh or torch.arange(world).reshape(shape)")
            rank_in_group = torch.empty(n, dtype=torch.int64)
            rank_in_group[order[0]] = torch.arange(n)
            shape = [1] * mesh.ndim
            shape[a] = n
            coords[..., a] = rank_in_group.view(shape)
        ranks = mode.ranks if mode is not None else [dist.get_rank()]
        mine = {r: coords[mesh == r][0] for r in ranks}
    if mode is not None:
        return mode.rank_map(lambda r: mine[r].clone())
    rank = dist.get_rank()
    groups = [device_mesh.get_local_rank(a) for a in range(mesh.ndim)]
    if mine[rank].tolist() != groups:
        raise MeshMismatchError(f"DeviceMesh {mesh.tolist()}: rank {rank} has rank {groups} in the process "
                                f"groups of the mesh axes, not {mine[rank].tolist()} as groups of ascending "
                                "ranks give")
    return mine[rank].to(device_mesh.device_type)


Signature = tuple[tuple, ...]
"""Per flattened input (pytree leaves of ``(args, kwargs)``), the global ``(shape, dtype)`` of a
tensor or ``(None, value)`` of a non-tensor argument (``use_cache=False``, ``return_dict=True``)."""


def _hashable(value):
    try:
        hash(value)
        return value
    except TypeError:
        return ("repr", repr(value))


def input_signature(input_meta) -> Signature:
    """The :data:`Signature` of a traced model's ``input_meta``."""
    return tuple((tuple(a), b) if a is not None else (None, _hashable(b)) for a, b in input_meta)


def leaf_signature(leaves) -> Signature:
    """The :data:`Signature` of the flattened inputs of a call."""
    return tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else (None, _hashable(x))
                 for x in leaves)


def _describe(entry) -> str:
    shape, other = entry
    return f"shape {shape} and dtype {other}" if shape is not None else f"value {other!r}"


def _argument_name(path) -> str:
    """``labels`` for a keyword argument, ``positional argument 0`` for a positional one."""
    if path and getattr(path[0], "idx", None) == 1:
        return pytree.keystr(path[1:]).strip("[]'\"")
    return f"positional argument {pytree.keystr(path[1:])}"


@dataclass
class Variant:
    """One per-device graph of a :class:`ParallelModule` and what it was made for.

    Attributes:
        graph_module: the per-device ``fx.GraphModule``, reading the module's parameters.
        plan: its :class:`~autoparallel.Plan`.
        in_spec / out_spec: pytree specs of ``(args, kwargs)`` and of the output.
        input_meta: per flattened input, ``(shape, dtype)`` as the caller passes it (global;
            one rank's under ``plan.inputs == "local"``) or ``(None, value)``.
        buffer_mutations: flat output index → buffer the forward updates (written back).
        training: the module mode the graph was captured in (dropout, BatchNorm).
        returned: per flat output, ``(placements, global shape)`` of a value the graph returns
            sharded (returned as a DTensor), else ``None`` (the output node's ``meta["returned"]``,
            set by :func:`~autoparallel.passes.apply_plan`).
    """

    graph_module: fx.GraphModule
    plan: Plan
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    input_meta: list
    buffer_mutations: dict[int, str]
    training: bool = True
    returned: list = field(default_factory=list)

    @property
    def key(self) -> tuple[bool, Signature]:
        return self.training, input_signature(self.input_meta)


class ParallelModule(NotPicklable, nn.Module):
    """The parallel module: same call signature and outputs as the original model.

    Parameters are ``nn.Parameter``s holding DTensors on ``device_mesh`` (plain tensors, as
    under DDP, where the plan replicates every parameter and buffer on every device:
    ``holds_dtensors`` is then false, and the optimizer step runs without DTensor's dispatch),
    registered under the original model's names (tied parameters stay one object), so ``torch.optim``,
    ``clip_grad_norm_`` and ``state_dict()`` work unchanged; ``load_state_dict`` also takes
    a plain state dict (full tensors, e.g. the model's own or pretrained weights) and
    shards it like the module's parameters (rank 0's values). Inputs are the global batch,
    the same on every rank (checked, see ``check_batch_every``), or under a plan for local
    inputs each rank's own batch (not compared); outputs come in the model's
    output structure (e.g. a Hugging Face ``ModelOutput``): plain whole tensors where the
    plan returns them replicated (a loss; every output under ``outputs="replicated"``; a
    loss summed over devices that needs grad is a
    :class:`~autoparallel.runtime_kernels.grad_reduction.PendingSum`, whose all-reduce is
    waited when it is read or the backward ends), DTensors in the plan's placements where it
    returns them sharded (``.full_tensor()`` gives the whole value). Buffers the forward
    updates in place (BatchNorm's running statistics) are graph outputs
    (``buffer_mutations``: flat output index → buffer name), copied into the buffers' local
    tensors after every forward.

    One graph per mode and input signature. ``train()`` / ``eval()`` behave as on the model:
    the first call in a mode the module has no graph for captures the model again in that
    mode (dropout off and BatchNorm on running statistics in eval) and plans it with every
    parameter pinned where it is (seconds, once per mode and signature). Non-tensor
    arguments (``use_cache=False``) are part of the signature: another value raises
    InputMismatchError naming the argument, or is planned anew under ``replan=True``, like a
    tensor input of a new shape or dtype (the smaller last batch of an epoch).

    Attributes:
        plan: the :class:`~autoparallel.Plan` made for the planned inputs and mode.
        graph_module: the per-device ``fx.GraphModule`` of that plan;
            ``print(pmodel.graph_module.code)`` shows its collectives.
        plans / graph_modules: ``(training, input signature)`` → plan / graph module, every
            mode and re-plan included.
        holds_dtensors: whether parameters and buffers are DTensors (false: plain tensors,
            the plan replicating every one of them on every device).

    Raises (on call):
        InputMismatchError: inputs whose structure or keywords differ from the planned ones,
            (without ``replan=True``) whose shapes, dtypes or non-tensor values do, or ranks
            that pass different batches.
        AutoParallelError (a subclass): when capturing or planning a new mode or signature
            fails, e.g. CaptureError, or InfeasiblePlanError under a memory budget.
    """

    def __init__(self, model: nn.Module, graph: fx.Graph | None, plan: Plan, device_mesh, *, in_spec=None,
                 out_spec=None, input_meta=None, param_names: dict[str, list[str]],
                 buffer_names: dict[str, list[str]], constants: dict[str, torch.Tensor],
                 buffer_mutations: dict[int, str] | None = None, check_batch_every: int = 100):
        super().__init__()
        self.__dict__["_coord"] = _mesh_coord(device_mesh)  # first: it refuses meshes no numbering fits
        self.plan = plan
        self.device_mesh = device_mesh
        self.training = model.training
        self.__dict__["_variants"] = {}  # (training, input signature) -> Variant; the first is the planned one
        self.__dict__["_recapture"] = None  # set by autoparallelize: captures and plans a new mode or signature
        self.__dict__["_batch_check"] = BatchCheck(device_mesh, check_batch_every)
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
        self.__dict__["holds_dtensors"] = plan.holds_dtensors
        for tid, (orig, names) in groups.items():
            target = target_of.get(tid)
            spec = plan.param_placements.get(target, repl) if target else repl  # unused: replicated
            dt = _distribute(orig, device_mesh, spec, as_dtensor=self.holds_dtensors)
            value = nn.Parameter(dt, requires_grad=orig.requires_grad) if isinstance(orig, nn.Parameter) else dt
            for name in names + ([target] if target and target not in names else []):
                set_attr(self, name, value, persistent=name not in transient)
        for target, value in constants.items():  # lifted by capture: not the model's state
            set_attr(self, target, value.to(device), persistent=False)
        self._register_load_state_dict_pre_hook(_shard_plain_tensors, with_module=True)
        if graph is not None:  # else the caller adds the first variant (autoparallel.api.emit does)
            self.add_variant(ParallelGraph(self, graph, class_name="ParallelGraph"), plan, in_spec=in_spec,
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
                    buffer_mutations: dict[int, str] | None = None, training: bool | None = None) -> Variant:
        """Register ``graph_module`` (made for ``plan``) to run inputs of ``input_meta``'s
        signature in mode ``training`` (default: the module's mode now). The first variant
        added is :attr:`plan` / :attr:`graph_module`; later ones are other modes and re-plans
        for other inputs, over the same parameter objects.

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
        out = next(n for n in reversed(graph_module.graph.nodes) if n.op == "output")
        variant = Variant(graph_module, plan, in_spec, out_spec, list(input_meta), mutations,
                          self.training if training is None else training, out.meta.get("returned", []))
        if not self._variants:
            self.plan = plan
            self.__dict__["graph_module"] = graph_module  # not a submodule: parameters listed once, by model names
            self._in_spec, self._out_spec, self._input_meta = in_spec, out_spec, variant.input_meta
        self._variants[variant.key] = variant
        return variant

    @property
    def plans(self) -> dict[tuple[bool, Signature], Plan]:
        """``(training, input signature)`` → the plan that runs it: the planned inputs and
        mode first, then every mode and signature planned since."""
        return {key: v.plan for key, v in self._variants.items()}

    @property
    def graph_modules(self) -> dict[tuple[bool, Signature], fx.GraphModule]:
        """``(training, input signature)`` → the per-device graph module that runs it."""
        return {key: v.graph_module for key, v in self._variants.items()}

    def _flat_inputs(self, args, kwargs) -> tuple[list, Variant]:
        expected_kw = self._in_spec.child(1).context if self._in_spec.num_children > 1 else []
        if set(kwargs) != set(expected_kw or []):
            raise InputMismatchError(f"keyword arguments {sorted(kwargs)} differ from the planned ones "
                                     f"{sorted(expected_kw or [])}")
        kwargs = {k: kwargs[k] for k in expected_kw}
        with_paths, spec = pytree.tree_flatten_with_path((args, kwargs))
        if spec != self._in_spec:
            raise InputMismatchError(f"input structure {spec} differs from the planned {self._in_spec}")
        flat = [x for _, x in with_paths]
        sig = leaf_signature(flat)
        variant = self._variants.get((self.training, sig))
        if variant is not None:
            return flat, variant
        known = any(s == sig for _, s in self._variants)  # planned in the other mode: capture this one
        if not known and not (self._recapture is not None and self._recapture.replan):
            self._raise_mismatch([p for p, _ in with_paths], sig)
        if self._recapture is None:
            raise InputMismatchError(f"this module has no graph for {'training' if self.training else 'eval'} "
                                     "mode and cannot capture one (it was not built by autoparallelize); call "
                                     "autoparallelize with the model in this mode")
        return flat, self._recapture(self, args, kwargs)

    def _raise_mismatch(self, paths, sig: Signature):
        for path, got, want in zip(paths, sig, input_signature(self._input_meta)):
            if got != want:
                raise InputMismatchError(
                    f"argument {_argument_name(path)} has {_describe(got)}, but the plan was made for "
                    f"{_describe(want)}; call autoparallelize again with meta_inputs like these, or pass "
                    "replan=True to autoparallelize to plan each new input signature on first use")
        raise InputMismatchError(f"inputs {sig} have no plan")  # unreachable: sig differs somewhere

    def forward(self, *args, **kwargs):
        flat, variant = self._flat_inputs(args, kwargs)
        self._batch_check(flat)
        outs = variant.graph_module(self._coord, *flat)
        if variant.buffer_mutations:
            with torch.no_grad():
                for i, target in variant.buffer_mutations.items():
                    buf = get_attr(self, target)  # replicated (planned so): every device holds it whole
                    (buf.to_local() if isinstance(buf, DTensor) else buf).copy_(outs[i])
            outs = [o for i, o in enumerate(outs) if i not in variant.buffer_mutations]
        # buffer write-backs come after the user's outputs and are whole: indices agree
        outs = [self._as_dtensor(o, r) if r else o for o, r in zip(outs, variant.returned)] + \
            list(outs[len(variant.returned):])
        return pytree.tree_unflatten(list(outs), variant.out_spec)

    def _as_dtensor(self, local: torch.Tensor, returned) -> DTensor:
        """A value the graph returns sharded, as the DTensor of ``returned`` = (placements,
        global shape) over the module's mesh: ``.full_tensor()`` gives it whole."""
        spec, shape = returned
        stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))  # contiguous, as on one device
        return DTensor.from_local(local, self.device_mesh, list(spec), run_check=False, shape=torch.Size(shape),
                                  stride=stride)


def _distribute(tensor: torch.Tensor, device_mesh, spec, as_dtensor: bool = True) -> torch.Tensor:
    """``tensor`` (rank 0's values) as a DTensor of placements ``spec``, or (``as_dtensor``
    false; ``spec`` replicated) as this device's plain copy; under simulated ranks its local
    shards are LocalTensors. The global shape is given: shards split unevenly (``torch.chunk``
    pieces) differ in size and would not tell it."""
    dt = distribute_tensor(tensor.detach().to(device_mesh.device_type), device_mesh, list(spec))
    if not as_dtensor:
        return per_rank(dt.to_local())
    return DTensor.from_local(per_rank(dt.to_local()), device_mesh, list(spec), run_check=False,
                              shape=dt.shape, stride=dt.stride())


def _shard_plain_tensors(module: ParallelModule, state_dict, prefix, *args) -> None:
    """``load_state_dict`` pre-hook: a plain tensor given for a DTensor parameter or buffer (a
    single-device checkpoint, pretrained weights) becomes a DTensor of the same placements, or,
    where the module holds plain tensors, rank 0's values (as for DTensors); a DTensor given for
    a plain tensor is loaded whole."""
    own = dict(module.named_parameters(remove_duplicate=False))
    own.update(module.named_buffers(remove_duplicate=False))
    for key, value in list(state_dict.items()):
        mine = own.get(key[len(prefix):]) if key.startswith(prefix) else None
        if mine is None or not isinstance(value, torch.Tensor):
            continue
        if isinstance(value, DTensor) and not isinstance(mine, DTensor):
            state_dict[key] = value.full_tensor()
        # a plain tensor of another shape is left to load_state_dict, which reports the mismatch
        elif not isinstance(value, DTensor) and tuple(value.shape) == tuple(mine.shape):
            dtensor = isinstance(mine, DTensor)
            spec = mine.placements if dtensor else (Replicate(),) * module.device_mesh.ndim
            state_dict[key] = _distribute(value.to(mine.dtype), module.device_mesh, spec, as_dtensor=dtensor)
