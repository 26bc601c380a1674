"""ParallelModule: the class a model parallelized in place takes on; its ``forward`` runs the
per-device graph of the plan for each call."""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from ..errors import AutoParallelError, CaptureError, InputMismatchError
from ..fqn import get_attr, set_attr
from ..pickling import NotPicklable
from ..plan import Plan
from ..runtime_kernels import gathered_batch, input_with_full_grad, per_rank
from ..runtime_kernels.grad_reduction import gradient_sync
from .batch_check import BatchCheck
from .eager import EagerRunner, retire
from .split_output import mark
from .zero import ZeroState, zero_param


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


class _Entry:
    """A signature entry as a pytree leaf (so that it is not flattened again)."""

    def __init__(self, entry):
        self.entry = entry


def _key(training: bool, args, kwargs, attributes: tuple, entry) -> tuple:
    kw = {k: kwargs[k] for k in sorted(kwargs)}  # keyword order does not make another call
    leaves, spec = pytree.tree_flatten((tuple(args), kw), is_leaf=lambda x: isinstance(x, _Entry))
    return training, spec, tuple(entry(x) for x in leaves), attributes


def call_key(training: bool, args, kwargs, attributes: tuple) -> tuple:
    """What picks the per-device graph of a call: the mode, the input structure (keywords in
    any order), the :data:`Signature` and the submodules' plain attributes
    (:func:`module_state`)."""
    return _key(training, args, kwargs, attributes, lambda x: leaf_signature([x])[0])


def variant_key(variant: Variant, attributes: tuple) -> tuple:
    """The :func:`call_key` of the calls ``variant`` was made for."""
    args, kwargs = pytree.tree_unflatten([_Entry(e) for e in input_signature(variant.input_meta)], variant.in_spec)
    return _key(variant.training, args, kwargs, attributes, lambda x: x.entry)


def graph_inputs(variant: Variant, args, kwargs) -> list:
    """The flat inputs of ``variant``'s graph for a call: keywords in the order it was captured with."""
    order = variant.in_spec.child(1).context if variant.in_spec.num_children > 1 else []
    return pytree.tree_leaves((tuple(args), {k: kwargs[k] for k in order}))


def mismatch(variant: Variant, args, kwargs) -> str:
    """What differs between a call and the one ``variant`` was made for: its keywords, its
    structure, or the first argument whose shape, dtype or value differs."""
    planned = variant.in_spec.child(1).context if variant.in_spec.num_children > 1 else []
    if set(kwargs) != set(planned or []):
        return f"keyword arguments {sorted(kwargs)} differ from the planned ones {sorted(planned or [])}"
    with_paths, spec = pytree.tree_flatten_with_path((tuple(args), {k: kwargs[k] for k in planned}))
    if spec != variant.in_spec:
        return f"input structure {spec} differs from the planned {variant.in_spec}"
    for (path, x), want in zip(with_paths, input_signature(variant.input_meta)):
        got = leaf_signature([x])[0]
        if got != want:
            return f"argument {_argument_name(path)} has {_describe(got)}, but the plan was made for {_describe(want)}"
    return "the inputs match, but the submodules' attributes or the mode differ"


def _argument_name(path) -> str:
    """``labels`` for a keyword argument, ``positional argument 0`` for a positional one."""
    if path and getattr(path[0], "idx", None) == 1:
        return pytree.keystr(path[1:]).strip("[]'\"")
    return f"positional argument {pytree.keystr(path[1:])}"


_PLAIN = (bool, int, float, str, type(None))


def module_state(model: nn.Module) -> tuple[tuple, list[str]]:
    """The plain attributes of every module below ``model`` (``dropout.p``, a flag; the
    captured graph depends on them, so a change is captured again), and the names of the
    submodules with forward hooks (which a per-device graph cannot run) other than Hugging
    Face's output-capturing ones (:func:`_captured_hook`)."""
    attributes, hooked = [], []
    for name, m in model.named_modules():
        attributes += [(name, k, v) for k, v in m.__dict__.items() if isinstance(v, _PLAIN) and k != "training"]
        hooks = [*m._forward_hooks.values(), *m._forward_pre_hooks.values()]
        if name and not all(_captured_hook(h) for h in hooks):
            hooked.append(name)
    return tuple(attributes), hooked


def _captured_hook(hook) -> bool:
    """Hugging Face's output-capturing hook (``transformers.utils.output_capturing``), which a
    model installs on its first call: it appends a submodule's output to a collector that is
    set only inside the model's own forward, which capture traces, so the captured graph holds
    what it collects (Mixtral's router logits and their auxiliary loss)."""
    return getattr(hook, "__module__", None) == "transformers.utils.output_capturing"


@dataclass
class _State:
    """What a model parallelized in place keeps beside its own attributes (in its ``__dict__``
    under ``_autoparallel``): the mesh, this device's coordinate, the per-device graphs by call
    key, the capture of new modes and signatures, and the cross-rank batch check."""

    device_mesh: object
    coord: torch.Tensor
    batch_check: BatchCheck
    bucket_cap_bytes: int
    holds_dtensors: bool
    variants: dict = field(default_factory=dict)
    recapture: object = None
    eager: EagerRunner = field(default_factory=EagerRunner)
    no_sync: bool = False
    pipeline: object = None  # the pipeline runtime of the mode the module was built in
    restage: object = None  # (mode, module attributes) -> their pipeline runtime (codegen.emit.Restage)
    stepped: bool = False  # step() ran a backward since a trainer last looked (autoparallel.lightning)
    zero: ZeroState | None = None  # the whole copies of parameters whose optimizer states are sharded


class ParallelModule(NotPicklable, nn.Module):
    """The class a model parallelized by :func:`autoparallel.autoparallelize` takes on: a
    subclass of this mixin and of the model's own class (``AutoParallelGPT2LMHeadModel``),
    so ``isinstance(model, GPT2LMHeadModel)`` holds and the model keeps its submodules,
    attributes and methods (``config``, ``generate``, ``save_pretrained``), as FSDP2's
    ``fully_shard`` does. Only ``forward`` changes: it runs the per-device graph of the plan.

    Parameters are the model's, under the same names, replaced by ``nn.Parameter``s holding
    DTensors on ``device_mesh`` (plain tensors, as under DDP, where the plan replicates every
    parameter and buffer: ``holds_dtensors`` is then false), so ``torch.optim`` built over
    ``model.parameters()`` after the call, ``clip_grad_norm_`` and ``state_dict()`` work
    unchanged; an optimizer built before the call holds the replaced parameters and raises
    AutoParallelError at its ``step()``. ``load_state_dict`` also takes full tensors (a
    single-device checkpoint) and shards them (rank 0's values). Inputs are the global batch,
    the same on every rank (checked, see ``check_batch_every``), or under a plan for local
    inputs each rank's own batch (not compared). Outputs come in the model's output
    structure: whole tensors where the plan returns them replicated (a loss), DTensors where
    it returns them sharded (``.full_tensor()`` gives the whole value). The gradient reaching
    an input that requires grad is the single-device one. Buffers the forward updates
    (BatchNorm's statistics) are written back after every forward.

    Calls: one per-device graph per mode (``train()``/``eval()``), input structure and
    signature (shapes, dtypes, non-tensor values) and the plain attributes of the submodules
    (``dropout.p``). A call none of them was made for is captured and planned on first use
    with every parameter kept where it is (seconds, once), or, under ``torch.no_grad()`` with a
    call never planned in any mode (``generate``'s steps), run eagerly by the model's own forward on
    whole parameters (gathered once and reused until they change), which also fires forward
    hooks registered on submodules. A call whose capture fails (``use_cache=True`` returns a
    cache object export cannot) runs eagerly too, with a warning, differentiably when grad
    is enabled. While a submodule has a forward hook every call runs eagerly, so that it
    fires (with a warning under grad: every rank gathers every parameter). Under
    ``inputs="local"`` an eager call with grad runs on the global batch (the ranks' gathered),
    as the graphs do; under ``torch.no_grad()`` on this rank's own (``generate`` per rank).

    Attributes:
        plan / graph_module: the first plan and its per-device ``fx.GraphModule``
            (``print(model.graph_module.code)`` shows its collectives).
        plans / graph_modules: call key → plan / graph module, every mode and re-plan included.
        holds_dtensors: whether parameters and buffers are DTensors.
        device_mesh: the mesh the model runs on.

    Raises (on call):
        InputMismatchError: a new signature with grad enabled when built with
            ``replan=False``, or ranks that pass different batches.
        AutoParallelError (a subclass): when capturing or planning a new call fails.
    """

    unpicklable_what = "a model parallelized by autoparallel"

    @property
    def _ap(self) -> _State:
        return self.__dict__["_autoparallel"]

    @property
    def plan(self) -> Plan:
        return self._first.plan

    @property
    def graph_module(self) -> fx.GraphModule:
        return self._first.graph_module

    @property
    def _first(self) -> Variant:
        return next(iter(self._ap.variants.values()))

    @property
    def holds_dtensors(self) -> bool:
        return self._ap.holds_dtensors

    @property
    def device_mesh(self):
        return self._ap.device_mesh

    @property
    def plans(self) -> dict[tuple[bool, Signature], Plan]:
        """``(training, input signature)`` → the plan that runs it: the planned call first,
        then every mode and call planned since."""
        return {v.key: v.plan for v in self._ap.variants.values()}

    @property
    def graph_modules(self) -> dict[tuple[bool, Signature], fx.GraphModule]:
        """``(training, input signature)`` → the per-device graph module that runs it."""
        return {v.key: v.graph_module for v in self._ap.variants.values()}

    def graph_root(self, constants: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What ``get_attr`` nodes of a per-device graph read: the model's parameters and
        buffers (the same objects, by every name) and that graph's own lifted ``constants``
        (moved to the device). Pass it as the root of ``fx.GraphModule``."""
        device = self.device_mesh.device_type
        root = dict(self.named_parameters(remove_duplicate=False))
        root.update(self.named_buffers(remove_duplicate=False))
        if self._ap.zero is not None:  # read whole; the optimizer steps their shards
            root.update(self._ap.zero.wholes())
        root.update({k: v.to(device) for k, v in constants.items()})
        return root

    def add_variant(self, graph_module: fx.GraphModule, plan: Plan, *, in_spec, out_spec, input_meta,
                    buffer_mutations: dict[int, str] | None = None) -> Variant:
        """Register ``graph_module`` (made for ``plan``) to run calls of ``input_meta``'s
        structure and signature in the model's mode now. The first variant added is
        :attr:`plan` / :attr:`graph_module`; later ones are other modes and calls, over the
        same parameter objects.

        Raises:
            ValueError: a buffer the forward updates is not planned replicated, or the plan
                places a parameter otherwise than the model holds it.
        """
        mutations = dict(buffer_mutations or {})
        for target in mutations.values():
            if any(p != Replicate() for p in plan.param_placements.get(target, ())):
                raise ValueError(f"buffer {target} is updated by the forward and must be planned replicated, "
                                 f"not {plan.param_placements[target]}")
        if self._ap.variants:
            moved = [n for n, s in plan.param_placements.items()
                     if tuple(s) != tuple(self.plan.param_placements.get(n, s))]
            if moved:
                raise ValueError(f"a re-planned graph must keep every parameter where the model holds it; "
                                 f"{moved[0]} is placed {plan.param_placements[moved[0]]}, not "
                                 f"{self.plan.param_placements[moved[0]]}")
        out = next(n for n in reversed(graph_module.graph.nodes) if n.op == "output")
        variant = Variant(graph_module, plan, in_spec, out_spec, list(input_meta), mutations,
                          self.training, out.meta.get("returned", []))
        self._ap.variants[variant_key(variant, module_state(self)[0])] = variant
        return variant

    def step(self, *args, **kwargs) -> torch.Tensor:
        """One training step's forward and backward on the global batch ``(args, kwargs)``
        (under ``inputs="local"`` this rank's batch), for any plan: a pipelined one runs its
        schedule over the microbatches (:mod:`autoparallel.codegen.pipeline`), any other calls
        the module and backpropagates its loss. Then call ``optimizer.step()``. Under
        ``torch.no_grad()`` or ``torch.inference_mode()`` it evaluates: the forward only (a
        validation loop's step), in the module's mode (a pipelined module in a mode or with
        module attributes it was not built in captures and plans them on first use, with the
        same stages and every parameter where it is: :class:`~autoparallel.codegen.emit.Restage`).

        Returns:
            the loss, detached, the same on every rank: the first 0-d floating value the model
            returns (a Hugging Face model's ``loss``); a pipelined plan's is the mean of its
            microbatches' losses, which is the batch's when each microbatch's loss is a mean
            over the same number of elements.

        Raises:
            AutoParallelError: the model returns no 0-d floating value; a pipelined module in a
                new mode or with new attributes whose capture or plan fails (``Restage``).
            InputMismatchError: a pipelined module called with inputs it was not planned for.
        """
        if self._ap.pipeline is not None:
            loss = self._ap.restage(self).step(args, kwargs)
            self._ap.stepped = torch.is_grad_enabled()
            return loss
        out = self(*args, **kwargs)
        loss = next((x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor) and x.dim() == 0
                     and x.is_floating_point()), None)
        if loss is None:
            raise AutoParallelError(f"step() returns the loss the model returns, but {type(self).__name__} "
                                    "returned no 0-d floating tensor (pass labels, or call the module and "
                                    "backpropagate your own loss)")
        if torch.is_grad_enabled():
            loss.backward()
            self._ap.stepped = True
        return loss.detach()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over this model's parameters, the norm taken over
        the whole model: under a pipelined plan every device holds its own stages' parameters,
        so their norms are combined over the pipeline axis (each parameter tied across stages
        counted once); otherwise it is torch's own. Returns the total norm, whole, the same on
        every device.

        Raises:
            RuntimeError: ``error_if_nonfinite`` and a norm that is not finite (torch's)."""
        params = [p for p in self.parameters() if p.grad is not None]
        if self._ap.pipeline is None:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
            return norm.full_tensor() if isinstance(norm, DTensor) else norm
        norm = self._ap.pipeline.total_norm(params, float(norm_type), error_if_nonfinite, foreach)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach)
        return norm

    def forward(self, *args, **kwargs):
        if self._ap.pipeline is not None:
            raise AutoParallelError(f"{type(self).__name__} runs pipeline stages: each device holds only its own "
                                    "stages, so it cannot be called; train with loss = model.step(**batch), then "
                                    "optimizer.step()")
        attributes, hooked = module_state(self)
        key = call_key(self.training, args, kwargs, attributes)
        variant = self._ap.variants.get(key)
        eager = bool(hooked) or key in self._ap.eager.refused or \
            variant is None and not torch.is_grad_enabled() and not self._planned_in_a_mode(key)
        if hooked and torch.is_grad_enabled():
            warnings.warn(f"submodule {hooked[0]!r} has a forward hook, which the per-device graph cannot run (it "
                          "calls no submodule), so this call runs the model's own forward on whole parameters (every "
                          "rank gathers every parameter); register the hook on the model itself to run the plan",
                          stacklevel=2)
        if variant is None and not eager:
            variant = self._replan(key, args, kwargs)  # None where the capture fails
        if eager or variant is None:
            return self._eager(args, kwargs)
        flat = graph_inputs(variant, args, kwargs)
        self._ap.batch_check(flat)
        if self._ap.zero is not None:  # the shards an optimizer step changed, gathered
            self._ap.zero.refresh()
        if variant.plan.inputs == "global":  # each rank's own batch (local) is a shard: its gradient is exact
            flat = [input_with_full_grad(x) if isinstance(x, torch.Tensor) and x.requires_grad else x for x in flat]
        with gradient_sync(not self._ap.no_sync):
            outs = variant.graph_module(self._ap.coord, *flat)
        return self._outputs(variant, outs)

    def _eager(self, args, kwargs):
        """The model's own forward on whole parameters (:class:`EagerRunner`). With grad
        enabled under ``inputs="local"``, on the global batch (every rank's gathered,
        :func:`~autoparallel.runtime_kernels.gathered_batch`): the loss and every gradient are
        then the global batch's, as the plan's graphs compute them."""
        if torch.is_grad_enabled() and self.plan.inputs == "local":
            args, kwargs = pytree.tree_map_only(torch.Tensor, gathered_batch, (args, kwargs))
        with self._ap.eager.whole_state(self):
            return super().forward(*args, **kwargs)

    def _planned_in_a_mode(self, key) -> bool:
        """Whether a call like this one (structure, signature, attributes) has a graph in some
        mode: another mode is then captured (memory-safe), never run eagerly."""
        return any(k[1:] == key[1:] for k in self._ap.variants)

    def _replan(self, key, args, kwargs) -> Variant | None:
        """Capture and plan a call no graph was made for (in training mode: a new mode, a new
        signature), keeping every parameter where it is.

        Returns ``None`` where the capture fails (the call then runs eagerly, see the class).

        Raises:
            InputMismatchError: a new signature when the model was built with ``replan=False``.
        """
        recapture = self._ap.recapture
        if recapture is None or not (self._planned_in_a_mode(key) or recapture.replan):
            raise InputMismatchError(f"{mismatch(self._first, args, kwargs)}; call autoparallelize with replan=True "
                                     "(the default) to plan each new call on first use, or with meta_inputs like these")
        try:
            return recapture(self, args, kwargs)
        except CaptureError as e:  # e.g. a cache object returned (use_cache=True): the model's own forward runs it
            warnings.warn(f"this call cannot be captured, so it runs the model's own forward on whole parameters "
                          f"(from now on for calls like it): {e}", stacklevel=4)
            self._ap.eager.refused.add(key)
            return None

    def _outputs(self, variant: Variant, outs):
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
        global shape) over the module's mesh: ``.full_tensor()`` gives it whole; a
        :class:`~autoparallel.codegen.split_output.SplitOutput`, whose errors name the remedies."""
        spec, shape = returned
        stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))  # contiguous, as on one device
        return mark(DTensor.from_local(local, self.device_mesh, list(spec), run_check=False, shape=torch.Size(shape),
                                       stride=stride))

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's ``no_sync``: the gradients of forwards run inside are not all-reduced over
        the mesh axes that replicate their parameters, but accumulated locally; the first
        backward of a forward run outside reduces them with its own, so every gradient is
        then the single-device sum over the accumulated micro-batches. Parameters stored
        split (FSDP-like placements) still reduce-scatter their gradients, which their
        gather needs."""
        self._ap.no_sync = True
        try:
            yield
        finally:
            self._ap.no_sync = False

    def _apply(self, fn, recurse=True):
        """Refuse conversions that change the parameters' dtype or device (``.half()``,
        ``.to(torch.bfloat16)``, ``.cuda()``): the per-device graphs were captured and priced
        for the dtypes and device of the plan.

        Raises:
            AutoParallelError: naming ``mp_policy`` for half precision."""
        probe = torch.empty(0, device=self.device_mesh.device_type)
        moved = fn(probe)
        if moved.dtype != probe.dtype or moved.device != probe.device:
            raise AutoParallelError(
                f"this model is parallelized for {probe.dtype} parameters on {probe.device.type}; converting it "
                f"(to {moved.dtype} on {moved.device.type}) would not match its plan. For half-precision compute "
                "with fp32 master weights pass mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16) to "
                "autoparallelize; for half-precision weights convert the model before autoparallelize")
        return super()._apply(fn, recurse)


def parallel_class(cls: type) -> type:
    """The class a model of class ``cls`` takes when parallelized in place: a subclass of
    :class:`ParallelModule` and ``cls`` (one per ``cls``), named ``AutoParallel<cls>``; it
    has ``save_pretrained`` (full tensors, written by rank 0) where ``cls`` has it.

    Raises:
        AutoParallelError: ``cls`` is already parallel."""
    if issubclass(cls, ParallelModule):
        raise AutoParallelError(f"the model is already parallelized ({cls.__name__}); autoparallelize it once")
    made = _CLASSES.get(cls)
    if made is None:
        body = {"__module__": cls.__module__, "__qualname__": f"AutoParallel{cls.__qualname__}"}
        if hasattr(cls, "save_pretrained"):
            body["save_pretrained"] = save_pretrained
        made = _CLASSES[cls] = type(f"AutoParallel{cls.__name__}", (ParallelModule, cls), body)
    return made


_CLASSES: dict[type, type] = {}


def save_pretrained(self, save_directory, *args, **kwargs):
    """The model's ``save_pretrained`` with whole tensors: every rank gathers the state dict
    (a collective: call it on every rank), rank 0 writes it (``is_main_process``), so that
    ``from_pretrained`` loads a plain model equal to this one."""
    import torch.distributed as dist

    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in self.state_dict().items()}
    kwargs.setdefault("is_main_process", dist.get_rank() == 0)
    kwargs.setdefault("state_dict", full)
    return super(ParallelModule, self).save_pretrained(save_directory, *args, **kwargs)


def parallelize_in_place(model: nn.Module, plan: Plan, device_mesh, *, param_names, buffer_names,
                         check_batch_every: int = 100, bucket_cap_bytes: int) -> ParallelModule:
    """Make ``model`` parallel in place (its class becomes :func:`parallel_class`'s; its
    parameters and buffers, under every name, the plan's); the caller adds its first
    per-device graph with :meth:`ParallelModule.add_variant`. Returns ``model``.

    Raises:
        MeshMismatchError: a mesh no numbering of the devices fits (:func:`_mesh_coord`).
        AutoParallelError: the model is already parallel."""
    cls = parallel_class(type(model))
    coord = _mesh_coord(device_mesh)  # first: it refuses meshes no numbering fits
    zero = _place_state(model, plan, device_mesh, list(param_names) + list(buffer_names), coord)
    model.__class__ = cls
    model.__dict__["_autoparallel"] = _State(device_mesh, coord, BatchCheck(device_mesh, check_batch_every),
                                             bucket_cap_bytes, plan.holds_dtensors, zero=zero)
    model._register_load_state_dict_pre_hook(_shard_plain_tensors, with_module=True)
    if plan.holds_dtensors and _permuted(device_mesh, coord):
        model.register_state_dict_pre_hook(_refuse_permuted)
    return model


def _permuted(device_mesh, coord: torch.Tensor) -> bool:
    """Whether this device's coordinate (its rank in each axis' process group, where its
    shards are) differs from the one DTensor reads off the mesh's listing (``get_coordinate``,
    which DTensor's metadata and ``torch.distributed.checkpoint`` use): a mesh listing its ranks
    out of order, e.g. ``DeviceMesh("cpu", [1, 0])``. Never under simulated ranks."""
    from torch.distributed._local_tensor import local_tensor_mode

    return local_tensor_mode() is None and list(device_mesh.get_coordinate()) != coord.tolist()


def _refuse_permuted(module, prefix, keep_vars) -> None:
    """``state_dict`` pre-hook of a model on a permuted mesh (:func:`_permuted`).

    Raises:
        AutoParallelError: its DTensors' metadata would place each shard at another device's
            offsets, so a checkpoint would load shuffled weights."""
    mesh = module.device_mesh.mesh.tolist()
    raise AutoParallelError(
        f"this model is sharded over DeviceMesh {mesh}, which lists its ranks out of order: each rank holds the "
        "shard of its place in the axis' process group, while DTensor (and torch.distributed.checkpoint) read the "
        "shard's offsets off the mesh's listing, so a checkpoint would load shuffled weights. Build the mesh with "
        "init_device_mesh (or torch.arange(world).reshape(shape)) to save its state dict")


def _place_state(model: nn.Module, plan: Plan, device_mesh, targets: list[str], coord: torch.Tensor) -> ZeroState | None:
    """Replace every parameter and buffer of ``model`` (tied names kept one object) by its
    distributed value in the plan's placements (unused ones replicated; a parameter in the
    plan's ``state_placements`` by the shard the optimizer steps, its whole copy returned in
    the :class:`~autoparallel.codegen.zero.ZeroState`, ``None`` when there is none); the
    replaced parameters are retired (:func:`retire`)."""
    groups: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + \
            list(model.named_buffers(remove_duplicate=False)):
        groups.setdefault(id(t), (t, []))[1].append(name)
    target_of = {id(get_attr(model, target)): target for target in targets}
    transient = {f"{m}.{b}" if m else b for m, mod in model.named_modules(remove_duplicate=False)
                 for b in mod._non_persistent_buffers_set}
    repl = (Replicate(),) * device_mesh.ndim
    zero = []
    for tid, (orig, names) in groups.items():
        target = target_of.get(tid)
        spec = plan.param_placements.get(target, repl) if target else repl  # unused: replicated
        state = plan.state_placements.get(target) if target else None
        dt = _distribute(orig, device_mesh, state or spec, as_dtensor=plan.holds_dtensors,
                         on_host=target in plan.offloaded)
        if isinstance(orig, nn.Parameter):
            value = nn.Parameter(dt, requires_grad=orig.requires_grad)
            retire(orig, names[0])
        else:
            value = dt
        if state is not None:  # the optimizer steps the shard; the graphs read a whole copy
            whole = _distribute(orig, device_mesh, spec).requires_grad_(orig.requires_grad)
            zero.append(zero_param(names, value, whole, device_mesh, coord))
        for name in names:
            set_attr(model, name, value, persistent=name not in transient)
    return ZeroState(zero) if zero else None


def _distribute(tensor: torch.Tensor, device_mesh, spec, as_dtensor: bool = True, on_host: bool = False) -> torch.Tensor:
    """``tensor`` (rank 0's values) as a DTensor of placements ``spec``, or (``as_dtensor``
    false; ``spec`` replicated) as this device's plain copy; under simulated ranks its local
    shards are LocalTensors. The global shape is given: shards split unevenly (``torch.chunk``
    pieces) differ in size and would not tell it. ``on_host``: the local shard is kept in
    (pinned) host memory, as FSDP2's ``CPUOffloadPolicy`` keeps it (a parameter the plan
    offloads; a no-op on a CPU mesh)."""
    dt = distribute_tensor(tensor.detach().to(device_mesh.device_type), device_mesh, list(spec))
    local = per_rank(dt.to_local())
    if on_host and local.device.type != "cpu":
        local = local.cpu().pin_memory()
    if not as_dtensor:
        return local
    return DTensor.from_local(local, device_mesh, list(spec), run_check=False, shape=dt.shape, stride=dt.stride())


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
