"""The module stage: a plan lowered into the :class:`ParallelModule` the model runs, and the
captures of the modes and input signatures it meets later (:class:`Recapture`)."""

from __future__ import annotations

import copy
import logging
import time

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
from torch.distributed.tensor import DTensor

from ..errors import AutoParallelError, MeshMismatchError
from ..fqn import get_attr
from ..mesh import MeshSpec
from ..options import PlanOptions
from ..passes.grad_buckets import DEFAULT_BUCKET_CAP_BYTES
from ..passes.lower import lower, lower_stages
from ..passes.stages import loss_dtype
from ..placement import replicated
from ..plan import Plan
from ..solver.pipeline import plan_on_rank0
from ..tracer import capture
from ..tracer.batch import global_batch, local_input_meta
from .batch_check import checked_every
from .code import readable
from .module import ParallelModule, Variant, module_state, parallelize_in_place
from .pipeline import PipelineRuntime, drop_other_stages, local_targets, stage_meshes, stand_in

log = logging.getLogger("autoparallel")


def emit(model: nn.Module, traced, plan: Plan, device_mesh, check_batch_every: int = 100,
         bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES) -> ParallelModule:
    """Make ``model`` parallel in place by ``plan`` for ``traced`` (its capture): its
    parameters in the plan's placements, its forward the per-device graph
    (:class:`ParallelModule`); also runs hand-picked plans. Gradients are reduced in
    buckets of at most ``bucket_cap_bytes`` bytes. Returns ``model``. Under a plan for local
    inputs (``plan.inputs == "local"``) the ranks' batches differ by design: they are not
    compared (``check_batch_every`` is checked, then unused).

    Raises:
        MeshMismatchError: a plan for local inputs on a mesh whose devices, numbered as its
            collectives join pieces, are not in rank order (:func:`check_rank_order`).
        ValueError: ``check_batch_every`` not an int >= 0.
    """
    every = checked_every(check_batch_every)
    if plan.inputs == "local":
        check_rank_order(device_mesh)
        every = 0
    pmodel = parallelize_in_place(model, plan, device_mesh, param_names=traced.params, buffer_names=traced.buffers,
                                  check_batch_every=every, bucket_cap_bytes=bucket_cap_bytes)
    add_variant(pmodel, traced, plan, device_mesh)
    return pmodel


def emit_pipeline(model: nn.Module, traced, plan: Plan, device_mesh, untied: dict[str, str], restage: Restage,
                  bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES) -> ParallelModule:
    """Make ``model`` run the pipelined ``plan`` (for ``traced``, one microbatch's capture,
    whose tied parameters ``untied`` names, :func:`~autoparallel.tracer.untie.untie_pieces`)
    in place: it keeps the parameters of this device's stages only, in the plan's placements
    over the stage submesh, and trains through :meth:`ParallelModule.step`
    (:mod:`autoparallel.codegen.pipeline`); ``restage`` builds the runtime of another mode
    (``train()``/``eval()``) or other module attributes when first asked for. Returns ``model``.

    Raises:
        MeshMismatchError: a mesh of another shape than the plan's, or without axis names.
    """
    submesh, pp_rank = stage_meshes(device_mesh, plan.pipeline)
    keep = local_targets(traced, plan.pipeline, pp_rank)
    drop_other_stages(model, traced, keep)
    pmodel = parallelize_in_place(model, plan, submesh, param_names=[t for t in traced.params if t in keep],
                                  buffer_names=[t for t in traced.buffers if t in keep], check_batch_every=0,
                                  bucket_cap_bytes=bucket_cap_bytes)
    runtime, graphs = pipeline_runtime(pmodel, traced, plan, device_mesh, untied)
    pmodel.add_variant(graphs[plan.pipeline.stages_of_rank(pp_rank)[0]], plan, in_spec=traced.in_spec,
                       out_spec=traced.out_spec, input_meta=traced.input_meta)
    pmodel._ap.pipeline = runtime
    pmodel._ap.restage = restage
    restage.runtimes[Restage.key(pmodel)] = runtime
    return pmodel


def pipeline_runtime(pmodel: ParallelModule, traced, plan: Plan, device_mesh, untied: dict[str, str]):
    """The :class:`~autoparallel.codegen.pipeline.PipelineRuntime` that runs ``plan`` for
    ``traced`` over ``pmodel``'s parameters, and every stage's per-device graph."""
    submesh, pp_rank = stage_meshes(device_mesh, plan.pipeline)
    root, fake = pmodel.graph_root(traced.constants), FakeTensorMode(allow_non_fake_inputs=True)
    for target in list(traced.params) + list(traced.buffers):  # other stages' state: run on fake tensors only
        if target not in root:
            root[target] = stand_in(get_attr(traced.gm, target), plan.param_placements.get(target), submesh,
                                    plan.holds_dtensors, fake)
    graphs = [readable(g) for g in lower_stages(traced, plan, submesh, root, pmodel._ap.bucket_cap_bytes)]
    runtime = PipelineRuntime(pmodel, plan.pipeline, graphs, device_mesh, pp_rank, pmodel._ap.coord,
                              traced.input_meta, traced.in_spec, untied, traced, loss_dtype(traced.gm), fake)
    return runtime, graphs


class Restage:
    """The pipeline runtime of each mode (``train()``/``eval()``) and set of plain module
    attributes (``dropout.p``; :func:`~autoparallel.codegen.module.module_state`) a pipelined
    module runs in: those it was built in, and any other on first use, captured from a fake
    skeleton of the model (:func:`meta_skeleton` with fake tensors, made before the module
    dropped other stages' parameters) and planned with the same pipeline and every parameter
    where the module holds it (:func:`~autoparallel.solver.stages.replan_stages`; the two
    modes' graphs may differ by more than dropout's ``train`` flag: an attention kernel
    without dropout returns another layout). That plan recomputes nothing and is not held to
    the memory budget: made for evaluation, it keeps no activations.

    Args:
        skeleton: :func:`meta_skeleton` of the model, or the error that copying it raised.
        capture_and_plan: module → ``(traced, untied, plan)``: one microbatch's capture with its
            tied parameters untied between stages (as the plan's was), and its plan.
    """

    def __init__(self, skeleton: nn.Module | AutoParallelError, capture_and_plan, device_mesh):
        self.skeleton, self.capture_and_plan, self.device_mesh = skeleton, capture_and_plan, device_mesh
        self.grad_enabled = torch.is_grad_enabled()  # capture in the grad mode the first capture saw
        self.runtimes: dict[tuple, PipelineRuntime] = {}

    @staticmethod
    def key(pmodel: ParallelModule) -> tuple:
        return pmodel.training, module_state(pmodel)[0]

    def __call__(self, pmodel: ParallelModule) -> PipelineRuntime:
        """The runtime of ``pmodel``'s mode and attributes, built on first use.

        Raises:
            AutoParallelError: the model could not be copied to capture it, or its capture
                reads a parameter the plan does not place; as
                :func:`~autoparallel.solver.stages.replan_stages`."""
        key = self.key(pmodel)
        if key in self.runtimes:
            return self.runtimes[key]
        mode = "training" if pmodel.training else "eval"
        if isinstance(self.skeleton, AutoParallelError):
            raise AutoParallelError(f"this pipelined module has no graphs for {mode} mode and its module attributes "
                                    f"now, and capturing them failed: {self.skeleton}")
        t0 = time.perf_counter()
        with maybe_disable_local_tensor_mode(), torch.inference_mode(False), torch.set_grad_enabled(self.grad_enabled):
            self.skeleton.train(pmodel.training)
            _copy_attributes(pmodel, self.skeleton)
            traced, untied, plan = self.capture_and_plan(self.skeleton)
            runtime, _ = pipeline_runtime(pmodel, traced, plan, self.device_mesh, untied)
        self.runtimes[key] = runtime
        log.info("planned the pipeline's stages in %s mode (%.2f s)", mode, time.perf_counter() - t0)
        return runtime


def add_variant(pmodel: ParallelModule, traced, plan: Plan, device_mesh) -> Variant:
    """Lower ``plan`` for ``traced`` and register the graph on ``pmodel`` (reading its
    parameters and the capture's constants)."""
    gm = readable(lower(traced, plan, device_mesh, pmodel.graph_root(traced.constants), pmodel._ap.bucket_cap_bytes))
    # the module checks each call against what a rank passes: its own batch under local inputs
    meta = local_input_meta(traced.input_meta, device_mesh.size()) if plan.inputs == "local" else traced.input_meta
    return pmodel.add_variant(gm, plan, in_spec=traced.in_spec, out_spec=traced.out_spec,
                              input_meta=meta, buffer_mutations=traced.buffer_mutations)


def check_rank_order(device_mesh) -> None:
    """Under local inputs each device's own batch is the piece of the global batch its mesh
    coordinate selects (dim 0 split along every axis, axis 0 outermost), the coordinate along
    an axis being the device's rank in that axis' process group (ascending ranks:
    :func:`~autoparallel.codegen.module._mesh_coord`). The global batch is the ranks' batches
    in rank order only when that piece index is the rank itself, as on any mesh
    ``torch.arange(world).reshape(shape)`` (or a 1-D mesh in any order).

    Raises:
        MeshMismatchError: naming a rank whose piece is another rank's, so that the module never
            trains on a permuted batch (a mean loss would not notice; per-sample outputs would).
    """
    with maybe_disable_local_tensor_mode():
        mesh = device_mesh.mesh.cpu()
        piece = torch.zeros_like(mesh)
        for a, n in enumerate(mesh.shape):
            in_group = mesh.argsort(dim=a).argsort(dim=a)  # each device's rank among its line along axis a
            piece = piece * n + in_group
        bad = (piece != mesh).nonzero()
        if len(bad):
            pos = tuple(bad[0].tolist())
            raise MeshMismatchError(
                f"inputs='local' on DeviceMesh {mesh.tolist()}: rank {int(mesh[pos])} would hold rows of piece "
                f"{int(piece[pos])} of the global batch, so the global batch would not be the ranks' batches "
                "in rank order; build the mesh as torch.arange(world).reshape(shape) (init_device_mesh does), "
                "or pass the global batch on every rank (inputs='global')")


def meta_skeleton(model: nn.Module, fake_mode: FakeTensorMode | None = None) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors of the same shapes and
    dtypes (parameters stay ``nn.Parameter`` with the same ``requires_grad``; tied tensors
    share one copy): enough to capture it again, and no weight is copied or kept alive. With
    ``fake_mode``, fake tensors of it on the tensors' own devices instead: their capture is the
    model's own, node for node (a meta capture may differ, e.g. by a ``contiguous`` where the
    device's attention kernel returns another layout).

    Raises:
        AutoParallelError: ``copy.deepcopy`` fails on an attribute of the model.
    """
    memo: dict[int, object] = {}
    state = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for _, t in state:
        if id(t) in memo:
            continue
        meta = fake_mode.from_tensor(t.detach()) if fake_mode is not None else torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    try:
        return copy.deepcopy(model, memo)
    except Exception as e:  # an attribute deepcopy cannot copy (a lock, a process group, ...)
        raise AutoParallelError(f"replan=True keeps a meta-device copy of {type(model).__name__} to capture it "
                                f"again, but copy.deepcopy failed: {type(e).__name__}: {e}; make the model's "
                                "attributes copyable, or call autoparallelize again for each input shape") from e


class Recapture:
    """Captures and plans the model again for a mode or an input signature a
    :class:`ParallelModule` has no graph for: a capture of a meta skeleton of the model in the
    module's mode (``train()``/``eval()``), a plan with every parameter and buffer pinned to its
    placement in the module (every parameter and buffer of the model is there, so a capture
    that reads other state than the first, e.g. no ``num_batches_tracked`` in eval mode, is
    planned alike), a new per-device graph over the same parameters. New signatures only under
    ``replan=True``; new modes always. Holds no reference to the model or its weights.

    Attributes:
        replan: whether new input signatures are planned (else they raise InputMismatchError).
        captures: how many captures it made.
    """

    def __init__(self, model: nn.Module, mesh: MeshSpec, device_mesh, options: PlanOptions, *,
                 keywords: bool, replan: bool):
        self.skeleton, self.copy_error = None, None
        try:
            self.skeleton = meta_skeleton(model)
        except AutoParallelError as e:
            if replan:
                raise
            self.copy_error = e  # raised when another mode is asked for
        self.mesh, self.device_mesh, self.options = mesh, device_mesh, options
        self.keywords, self.replan = keywords, replan
        self.grad_enabled = torch.is_grad_enabled()  # capture in the grad mode the first capture saw
        self.captures = 0

    def __call__(self, pmodel: ParallelModule, args, kwargs) -> Variant:
        """Plan and add the graph for inputs ``(args, kwargs)`` (structure already checked) in
        ``pmodel``'s mode."""
        if self.skeleton is None:
            raise AutoParallelError(f"{'training' if pmodel.training else 'eval'} mode has no graph yet, and "
                                    f"capturing one failed: {self.copy_error}")
        t0 = time.perf_counter()
        with maybe_disable_local_tensor_mode(), torch.set_grad_enabled(self.grad_enabled):
            meta = pytree.tree_map_only(torch.Tensor, lambda t: torch.empty(tuple(t.shape), dtype=t.dtype,
                                                                            device="meta"),
                                        dict(kwargs) if self.keywords else tuple(args))
            if self.options.inputs == "local":  # one rank's batch: the plan is for the global one
                meta = global_batch(meta, self.device_mesh.size())
            self.skeleton.train(pmodel.training)
            _copy_attributes(pmodel, self.skeleton)
            traced = capture(self.skeleton, meta, stamp_layers=self.options.stamp_layers,
                             mp_policy=self.options.mp_policy, device=self.device_mesh.device_type)
            self.captures += 1
            held = pmodel.graph_root({})  # as the graphs read them: a ZeRO parameter whole
            pinned = {name: tuple(t.placements) if isinstance(t, DTensor) else replicated(self.device_mesh.ndim)
                      for name, t in held.items()}
            p = plan_on_rank0(traced, self.mesh, self.options, pinned=pinned)
        variant = add_variant(pmodel, traced, p, self.device_mesh)
        log.info("planned %s mode for inputs %s (%.2f s; %d graphs cached)",
                 "training" if variant.training else "eval", [s for s, _ in variant.input_meta],
                 time.perf_counter() - t0, len(pmodel.plans))
        return variant


def _copy_attributes(model: nn.Module, skeleton: nn.Module) -> None:
    """Give ``skeleton``'s modules the plain attributes ``model``'s have now (``dropout.p`` set
    after the call), so that its capture computes what the model does."""
    mine = dict(skeleton.named_modules())
    for name, key, value in module_state(model)[0]:
        if name in mine:
            mine[name].__dict__[key] = value
