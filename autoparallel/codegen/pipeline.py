"""A pipelined plan run by torch's own pipelining runtime.

Each device runs the stages of its place along the pipeline axis
(:meth:`~autoparallel.pipeline_plan.PipelinePlan.stages_of_rank`), each stage a per-device
graph of :func:`~autoparallel.passes.lower.lower_stages` wrapped in
``torch.distributed.pipelining.PipelineStage`` over the pipeline axis' process group, driven
by the plan's schedule (``get_schedule_class``). Within a stage the graph runs on the stage's
submesh (the mesh less the pipeline axis) as an unpipelined plan's does; activations cross
stages in the placements the plan gives them, sent between the devices of the same submesh
coordinate.

The model stays the user's: on each device it holds the parameters of its own stages, under
their names (the others are set to ``None``, as torchtitan's pipelines delete the layers of
other stages), so ``torch.optim`` over ``model.parameters()`` steps exactly those. A parameter
tied across stages (GPT-2's token embedding and head) is held by each stage that reads it
under its own name (:mod:`autoparallel.tracer.untie`); after every backward their gradients
are summed, and their values are made equal when the module is built, so that the optimizer
keeps them equal.

Gradients of parameters replicated within a stage are reduced once per step: the
microbatches' backwards accumulate them unreduced but the one the schedule marks as the
stage's last (:func:`gradient_sync`), as DDP's ``no_sync`` does for gradient accumulation;
the last in the order the backwards run, which is not the forwards' order in every schedule
(``ScheduleLoopedBFS`` runs a stage's backwards in reverse). Under a zero-bubble schedule
(:data:`~autoparallel.pipeline_plan.ZERO_BUBBLE`), whose weight backwards take the parameters'
gradients from ``torch.autograd.grad``, they are handed to autograd unreduced and all-reduced
once the schedule's step is over (:func:`~autoparallel.runtime_kernels.grad_reduction.reduce_after_step`).
The schedule divides the gradients by the number of microbatches, the loss being each
microbatch's mean.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..errors import AutoParallelError, InputMismatchError, MeshMismatchError
from ..fqn import get_attr
from ..passes.stages import traced_stages
from ..pipeline_plan import ZERO_BUBBLE, PipelinePlan
from ..runtime_kernels.grad_reduction import AFTER_STEP, gradient_sync, reduce_after_step


def stage_meshes(device_mesh: DeviceMesh, pipeline: PipelinePlan) -> tuple[DeviceMesh, int]:
    """The submesh this device's stages run on (``device_mesh`` less the pipeline axis; a
    one-device mesh when that is its only axis) and this device's rank along the pipeline axis.

    Raises:
        MeshMismatchError: a mesh of another shape than the plan's, or without axis names
            (the submesh is sliced by name)."""
    shape = tuple(device_mesh.mesh.shape)
    if shape != pipeline.mesh.shape:
        raise MeshMismatchError(f"the pipelined plan is for a mesh of shape {pipeline.mesh.shape}, the device mesh "
                                f"has shape {shape}")
    names = device_mesh.mesh_dim_names
    if names is None:
        raise MeshMismatchError("a pipelined plan slices the device mesh by axis name: build it with "
                                "init_device_mesh(device, shape, mesh_dim_names=(...)), e.g. ('pp', 'dp')")
    pp_rank = device_mesh.get_local_rank(pipeline.axis)
    rest = [n for a, n in enumerate(names) if a != pipeline.axis]
    if rest:
        return device_mesh[tuple(rest)] if len(rest) > 1 else device_mesh[rest[0]], pp_rank
    flat = DeviceMesh(device_mesh.device_type, device_mesh.mesh.reshape(-1, 1), mesh_dim_names=(names[0], "stage"))
    return flat["stage"], pp_rank


def local_targets(traced, pipeline: PipelinePlan, pp_rank: int) -> set[str]:
    """The parameters and buffers (``get_attr`` targets of the capture) the stages of pipeline
    rank ``pp_rank`` read."""
    stage_of = traced_stages(traced.gm, pipeline)
    mine = set(pipeline.stages_of_rank(pp_rank))
    return {n.target for n in traced.gm.graph.nodes if n.op == "get_attr" and stage_of[n.name] in mine}


def drop_other_stages(model: nn.Module, traced, keep: set[str]) -> None:
    """Set to ``None`` every name of each parameter and buffer of the capture that no stage of
    this device reads (a tied tensor this device keeps under another name loses the other
    stage's name), so that the model holds its own stages' state only, under its names.

    Raises:
        AutoParallelError: one tensor held under two names of which this device needs both
            apart (a tie the stages of one device would break)."""
    kept: dict[int, str] = {}
    for target in [t for t in list(traced.params) + list(traced.buffers) if t in keep]:
        t = get_attr(model, target)
        if id(t) in kept:
            raise AutoParallelError(f"{target} and {kept[id(t)]} are one tied tensor read by two stages of this "
                                    "device; choose boundaries that keep their readers on one device")
        kept[id(t)] = target
    for targets in (traced.params, traced.buffers):
        for target, names in targets.items():
            for name in names if target not in keep else ():
                prefix, _, leaf = name.rpartition(".")
                owner = model.get_submodule(prefix)
                (owner._parameters if leaf in owner._parameters else owner._buffers)[leaf] = None


class StageModule(nn.Module):
    """One stage's per-device graph as the module ``PipelineStage`` runs: it passes the mesh
    coordinate, puts back the non-tensor inputs the graph was specialized for (stage 0),
    reduces gradients only in the last microbatch's backward, and returns floating values
    that need no gradient (positions, masks) as leaves that take one, which the pipelining
    runtime expects of every floating activation it sends; the last stage returns the loss as
    a one-element tensor. With ``own_outputs`` (a zero-bubble schedule, whose input backward
    detaches the stage's outputs in place), activations that are views are copies of their own."""

    def __init__(self, graph_module, coord: torch.Tensor, constants: list | None, own_outputs: bool = False):
        super().__init__()
        self.graph_module = graph_module
        self.coord, self.constants, self.own_outputs = coord, constants, own_outputs

    def forward(self, *args):
        if self.constants is not None:  # stage 0: the flat user inputs, tensors given, the rest as captured
            it = iter(args)
            args = [next(it) if c is _TENSOR else c for c in self.constants]
        with gradient_sync(None):  # reduced or not: decided in the backward, by _Stage
            out = self.graph_module(self.coord, *args)
        if isinstance(out, tuple):
            return tuple(_sendable(o, self.own_outputs) for o in out)
        return out.reshape(1)  # the loss: the schedule concatenates the microbatches' outputs


_TENSOR = object()


class _Stage(PipelineStage):
    """torch's ``PipelineStage`` whose backward reduces the gradients of parameters replicated
    within the stage only when the schedule marks it as the stage's last (``last_backward``),
    or, with ``after_step``, leaves them to :func:`reduce_after_step`."""

    def __init__(self, *args, after_step: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.after_step = after_step

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        with gradient_sync(AFTER_STEP if self.after_step else last_backward):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)


def _sendable(t: torch.Tensor, own: bool = False) -> torch.Tensor:
    """A stage output as point-to-point sends read it: dense (a view's own elements, not its
    base's storage), and, when floating, requiring grad; with ``own``, not a view."""
    if t.is_floating_point() and not t.requires_grad:
        t = t.detach().requires_grad_()
    t = t.contiguous()
    return t.clone() if own and t._is_view() else t


class PipelineRuntime:
    """The pipeline of one device: its :class:`StageModule` objects wrapped in ``PipelineStage`` objects, the
    schedule, and the tied parameters to keep equal.

    Args:
        graphs: every stage's per-device graph (this device runs those of its pipeline rank).
        input_meta: the capture's flat inputs (one microbatch): ``(shape, dtype)`` or ``(None, value)``.
        in_spec: the pytree spec of the capture's ``(args, kwargs)``.
        tied: pairs of parameter names held by two stages, the second untied from the first.
    """

    def __init__(self, model: nn.Module, pipeline: PipelinePlan, graphs: list, device_mesh: DeviceMesh,
                 pp_rank: int, coord: torch.Tensor, input_meta: list, in_spec,
                 tied: dict[str, str], traced, loss_dtype: torch.dtype, fake: FakeTensorMode):
        self.pipeline, self.pp_rank, self.in_spec = pipeline, pp_rank, in_spec
        self.input_meta = input_meta
        self.group = device_mesh.get_group(pipeline.axis)
        device = torch.device(device_mesh.device_type, torch.accelerator.current_device_index()) \
            if device_mesh.device_type != "cpu" else torch.device("cpu")
        constants = [_TENSOR if shape is not None else value for shape, value in input_meta]
        mine = pipeline.stages_of_rank(pp_rank)
        zero_bubble = pipeline.schedule in ZERO_BUBBLE
        self.modules = [StageModule(graphs[s], coord, constants if s == 0 else None, own_outputs=zero_bubble)
                        for s in mine]
        io = stage_io(graphs, coord, input_meta, loss_dtype, fake)
        stages = [_Stage(m, s, pipeline.stages, device, input_args=io[s][0], output_args=io[s][1],
                         group=self.group, after_step=zero_bubble)
                  for m, s in zip(self.modules, mine)]
        cls = get_schedule_class(pipeline.schedule)
        self.schedule = cls(stages if len(stages) > 1 else stages[0], n_microbatches=pipeline.microbatches,
                            loss_fn=_loss_of_output, scale_grads=True)
        self.tied = _TiedParameters(model, device_mesh, pipeline, pp_rank, tied, traced)

    def step(self, args, kwargs) -> torch.Tensor:
        """Forward and backward of the global batch ``(args, kwargs)`` over the microbatches
        (the forward only, torch's ``schedule.eval``, with gradients off); returns its loss
        (the microbatches' mean), the same on every device.

        Raises:
            InputMismatchError: inputs of another structure or shape than planned."""
        order = self.in_spec.child(1).context if self.in_spec.num_children > 1 else []
        flat, spec = pytree.tree_flatten((tuple(args), {k: kwargs.get(k) for k in order}))
        m = self.pipeline.microbatches  # the planned inputs are one microbatch's
        expected = [((m * shape[0], *shape[1:]), v) if shape is not None else (None, v) for shape, v in self.input_meta]
        got = [(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else (None, x) for x in flat]
        if spec != self.in_spec or set(kwargs) != set(order) or got != expected:
            raise InputMismatchError(f"a pipelined module runs the inputs it was planned for: (shape, dtype) "
                                     f"{expected}, keywords {list(order)}; got {got}")
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        losses: list[torch.Tensor] = []
        target = torch.arange(m)
        train = torch.is_grad_enabled()
        run = self.schedule.step if train else self.schedule.eval
        if 0 in self.pipeline.stages_of_rank(self.pp_rank):
            run(*tensors, target=target, losses=losses)
        else:
            run(target=target, losses=losses)
        if train:
            reduce_after_step()
            self.tied.sum_grads()
        return self._loss(losses)

    def total_norm(self, params: list[torch.Tensor], norm_type: float, error_if_nonfinite: bool,
                   foreach) -> torch.Tensor:
        """The ``norm_type``-norm of the gradients of every stage's parameters (each tied
        parameter once), the same on every device: this device's norm combined over the
        pipeline axis (the sum of p-th powers, or the maximum for the infinity norm), as
        torchtitan's ``clip_grad_norm_`` combines it over its pipeline mesh."""
        grads = [p.grad for p in params if p.grad is not None and id(p) not in self.tied.copies]
        norm = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        if math.isinf(norm_type):
            dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=self.group)
            return norm
        norm = norm ** norm_type
        dist.all_reduce(norm, group=self.group)
        return norm ** (1.0 / norm_type)

    def _loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The microbatches' mean loss, from the last stage's device to every device of the line."""
        last = (self.pipeline.stages - 1) % self.pipeline.pp
        loss = torch.stack([x.detach() for x in losses]).mean() if self.pp_rank == last else torch.zeros(())
        loss = loss.to(torch.float32).contiguous()
        dist.broadcast(loss, group_src=last, group=self.group)
        return loss


def stage_io(graphs: list, coord: torch.Tensor, input_meta: list, loss_dtype: torch.dtype,
             fake: FakeTensorMode) -> list[tuple]:
    """Per stage, example inputs and outputs of this device's pieces (empty tensors of their
    shapes and dtypes, floating ones requiring grad): what ``PipelineStage`` takes to size its
    receive buffers without running a stage on uninitialized inputs to find out (its dynamic
    inference would feed integer activations, e.g. labels, with garbage indices). Found by
    running stages 0 to the last but one on tensors of ``fake``, in order (other stages'
    parameters are :func:`stand_in` tensors of it); the last returns the loss."""
    def example(t) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype).requires_grad_(t.dtype.is_floating_point)

    with fake, torch.no_grad():
        args = [torch.empty(shape, dtype=dtype) if shape is not None else dtype for shape, dtype in input_meta]
        ins = [a for a in args if isinstance(a, torch.Tensor)]
        shapes = []
        for g in graphs[:-1]:
            outs = g(coord, *args)
            shapes.append(([(x.shape, x.dtype) for x in ins], [(x.shape, x.dtype) for x in outs]))
            args = ins = list(outs)
        shapes.append(([(x.shape, x.dtype) for x in ins], []))
    return [(tuple(example(_Meta(*x)) for x in i), tuple(example(_Meta(*x)) for x in o) or
             (torch.empty(1, dtype=loss_dtype, requires_grad=True),)) for i, o in shapes]


class _Meta:
    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), dtype


def _loss_of_output(output, target):
    """The schedule's loss function: the last stage returns the microbatch's loss already (as
    a one-element tensor, :class:`StageModule`), as a tensor of its own, not a view (a
    zero-bubble schedule's input backward detaches it in place)."""
    return output[0].clone()


class _TiedParameters:
    """Parameters tied across stages (new name → original, :func:`~autoparallel.tracer.untie.
    untie_pieces`): their values made equal at construction (the original's stage's), their
    gradients summed after each backward, over a process group of the two stages' devices at
    each submesh coordinate (made on every rank, as ``new_subgroups_by_enumeration`` must be)."""

    def __init__(self, model: nn.Module, device_mesh: DeviceMesh, pipeline: PipelinePlan, pp_rank: int,
                 tied: dict[str, str], traced):
        self.model, self.pairs = model, []
        self.copies: set[int] = set()  # ids of the parameters that are another stage's tied copy
        stage_of = traced_stages(traced.gm, pipeline)
        reader = {n.target: stage_of[n.name] for n in traced.gm.graph.nodes if n.op == "get_attr"}
        lines = device_mesh.mesh.movedim(pipeline.axis, 0).reshape(pipeline.pp, -1)
        column = int((lines == dist.get_rank()).nonzero()[0, 1])
        for name, original in sorted(tied.items()):
            a, b = reader[original] % pipeline.pp, reader[name] % pipeline.pp
            group, _ = dist.new_subgroups_by_enumeration([[int(lines[a, c]), int(lines[b, c])]
                                                          for c in range(lines.shape[1])])
            if pp_rank in (a, b):
                held = original if pp_rank == a else name
                self.pairs.append((held, group))
                if held == name:
                    self.copies.add(id(get_attr(model, name)))
                with torch.no_grad():
                    p = get_attr(model, held)
                    full = _full(p)
                    dist.broadcast(full, src=int(lines[a, column]), group=group)
                    _set_local(p, full)

    def sum_grads(self) -> None:
        """Each tied parameter's gradient: the sum of its stages'."""
        for name, group in self.pairs:
            p = get_attr(self.model, name)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            full = _full(p.grad)
            dist.all_reduce(full, group=group)
            _set_local(p.grad, full)


def _full(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole on this device (gathered over its submesh when a DTensor), a new tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def _set_local(t: torch.Tensor, full: torch.Tensor) -> None:
    """Write ``full``'s piece of this device into ``t`` (a DTensor's local shard, or ``t`` whole)."""
    if isinstance(t, DTensor):
        local = DTensor.from_local(full, t.device_mesh, [Replicate()] * t.device_mesh.ndim, run_check=False)
        t.to_local().copy_(local.redistribute(t.device_mesh, t.placements).to_local())
    else:
        t.copy_(full)


def stand_in(value: torch.Tensor, spec, submesh: DeviceMesh, as_dtensor: bool, fake: FakeTensorMode) -> torch.Tensor:
    """A fake tensor (of ``fake``, no memory) in place of another stage's parameter or buffer
    ``value`` (global shape), shaped as this device would hold it in placements ``spec``
    (replicated when ``None``): what :func:`stage_io` runs that stage's graph on."""
    spec = list(spec) if spec is not None else [Replicate()] * submesh.ndim
    local_shape, _ = compute_local_shape_and_global_offset(value.shape, submesh, spec)
    with fake:
        if not as_dtensor:
            return torch.empty(value.shape, dtype=value.dtype, device=submesh.device_type)
        local = torch.empty(local_shape, dtype=value.dtype, device=submesh.device_type)
        return DTensor.from_local(local, submesh, spec, run_check=False, shape=value.shape,
                                  stride=torch.empty(value.shape, device="meta").stride())
