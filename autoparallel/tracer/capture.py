"""ColoTracer: capture a model with ``torch.export.export(strict=False)`` on meta tensors.

The captured graph is ATen training IR. Parameters and buffers become ``get_attr`` nodes
named by their fully qualified names in the original model; tensor constants lifted by
export become ``get_attr`` nodes on ``_constant_<i>``; user inputs stay placeholders in
the order of the flattened ``(args, kwargs)``. ``no_grad`` regions that export wraps in
``wrap_with_set_grad_enabled`` are inlined, their outputs detached, which keeps their
meaning. Nothing is allocated: inputs are meta tensors for a meta-device model and
FakeTensors on the model's device otherwise, so tensors the forward creates (``arange``
without ``device=``) land on the same device as the weights, as they do when it runs.
Routed-experts modules run as one op while export traces (:mod:`.experts`).
"""

from __future__ import annotations

import contextlib
import linecache
import logging
import os
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx._lazy_graph_module import _LazyGraphModule, _use_lazy_graph_module

from ..errors import CaptureError
from ..fqn import set_attr
from .annotate import annotate_graph
from .batchnorm import decompose_batch_norm
from .autocast import Autocast, ambient_autocast, materialize_autocast
from .casts import half_inputs, half_skeleton, restore_master
from .decompose import decompose_composites
from .experts import experts_as_one_op
from .gelu import fuse_gelu
from .rotary import roll_rotate_half
from .fused import split_fused_projections
from .mutations import functionalize_state
from .stamp import find_layer_list, stamp, truncated

log = logging.getLogger("autoparallel")

_HOP_GRAD = torch.ops.higher_order.wrap_with_set_grad_enabled
_HOP_AUTOCAST = torch.ops.higher_order.wrap_with_autocast
_DROP = {torch.ops.aten._assert_tensor_metadata.default}


@dataclass
class TracedModel:
    """What the tracer hands to the later stages.

    Attributes:
        gm: the fx GraphModule (ATen IR) whose root holds meta parameters/buffers.
        in_spec / out_spec: pytree specs of ``(args, kwargs)`` and of the model output.
        params: graph ``get_attr`` target → every name of that parameter in the model
            (several when tied), the first being the target itself.
        buffers: graph target → buffer names.
        constants: graph target → the constant's real value (lifted by export).
        input_meta: per flattened user input (pytree leaves of ``(args, kwargs)``), the
            ``(shape, dtype)`` of a tensor or ``(None, value)`` of a non-tensor (a bool, int,
            string or None that the graph was specialized for).
        device: device type the model was captured on (``device=`` arguments in the graph
            name it; codegen moves them to the run device).
        buffer_mutations: flat output index → buffer target, for the outputs capture
            appends after the user's: the value of a buffer the forward updates in place
            (BatchNorm's running statistics), to be written back after each forward
            (:mod:`autoparallel.tracer.mutations`).
        stamped_layers: layers whose nodes were copied from a traced layer instead of
            being captured (:mod:`autoparallel.tracer.stamp`); 0 for a full capture.
    """

    gm: fx.GraphModule
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    params: dict[str, list[str]]
    buffers: dict[str, list[str]]
    constants: dict[str, torch.Tensor]
    input_meta: list[tuple] = field(default_factory=list)
    requires_grad: dict[str, bool] = field(default_factory=dict)
    device: str = "meta"
    buffer_mutations: dict[int, str] = field(default_factory=dict)
    stamped_layers: int = 0


def _model_device(model: torch.nn.Module) -> torch.device:
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


def _fake_mode_of(model: torch.nn.Module) -> FakeTensorMode | None:
    t = next(iter([*model.parameters(), *model.buffers()]), None)
    return t.fake_mode if isinstance(t, FakeTensor) else None


def _example_inputs(meta_inputs, device: torch.device, fake_mode: FakeTensorMode | None = None):
    """``(args, kwargs)`` of tensors with the inputs' shapes and dtypes, on the model's device,
    allocating nothing: meta tensors for a meta model, FakeTensors otherwise (export then
    fakifies the real weights in the same mode, without copying them), in ``fake_mode`` when
    the weights are fake already (:func:`~autoparallel.codegen.emit.meta_skeleton` with a fake mode)."""
    args, kwargs = (tuple(), dict(meta_inputs)) if isinstance(meta_inputs, dict) else (tuple(meta_inputs), {})
    if device.type == "meta":
        def make(x):
            return torch.empty(tuple(x.shape), dtype=x.dtype, device="meta")
    else:
        mode = fake_mode or FakeTensorMode(allow_non_fake_inputs=True)

        def make(x):
            with mode:
                return torch.empty(tuple(x.shape), dtype=x.dtype, device=device)
    return pytree.tree_map_only(torch.Tensor, make, (args, kwargs))


@contextlib.contextmanager
def _fast_capture():
    """Capture without per-node Python stack traces and with lazily generated graph code.

    Stack traces were a third of export's time on GPT-2 XL and are unused (nodes keep
    ``nn_module_stack``; capture errors carry their own traceback). Export regenerates the
    Python code of the whole graph after each of its passes (a quarter of the rest); lazy
    graph modules generate it only when the module is called or its code is read.
    """
    import torch.fx.config as fx_config

    old = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = True
    try:
        with _use_lazy_graph_module(True):
            yield
    finally:
        fx_config.do_not_emit_stack_traces = old


def _user_frame(exc: BaseException) -> str:
    """The innermost traceback frame outside torch and autoparallel, as 'file:line: code'."""
    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
    best = None
    for fr in traceback.extract_tb(exc.__traceback__):
        if not fr.filename.startswith(skip) and "<" not in fr.filename:
            best = fr
    if best is None:
        return "(no frame outside torch)"
    code = (best.line or linecache.getline(best.filename, best.lineno)).strip()
    return f"{best.filename}:{best.lineno}: {code}"


class ColoTracer:
    """Captures a model into an annotated ATen fx graph with ``torch.export``.

    Example::

        traced = ColoTracer().trace(model, {"input_ids": torch.empty(8, 1024, dtype=torch.long, device="meta")})
        traced.gm.graph.print_tabular()

    ``meta_inputs`` is a dict of keyword arguments or a tuple of positional ones; tensors
    in it may be meta tensors, FakeTensors or real tensors (only shape and dtype are used).
    Each node gets ``node.meta["autoparallel"]``, a :class:`~autoparallel.tracer.NodeInfo`.

    With ``stamp=True`` (default) a deep list of identical layers is captured by tracing
    four of them and copying the rest (:mod:`autoparallel.tracer.stamp`), which keeps
    capture time nearly flat in depth; ``stamp=False`` traces every layer.

    ``mp_policy`` (a ``torch.distributed.fsdp.MixedPrecisionPolicy``) captures the model as it
    computes under that policy, with its master parameters cast before use
    (:mod:`autoparallel.tracer.casts`). ``autocast`` (``(device_type, dtype)``, e.g. from
    :func:`~autoparallel.tracer.autocast.ambient_autocast`) captures the forward as it runs
    under that ``torch.autocast``; ``torch.autocast`` blocks inside the forward are captured
    as they run in any case. Either way the casts autocast performs are graph nodes
    (:mod:`autoparallel.tracer.autocast`).

    Raises:
        CaptureError: export failed; the message carries export's reason and the first
            source line outside torch that the failure went through.
    """

    def __init__(self, stamp: bool = True, mp_policy: MixedPrecisionPolicy | None = None,
                 autocast: Autocast | None = None):
        self.stamp = stamp
        self.mp_policy = mp_policy
        self.autocast = autocast

    def trace(self, model: torch.nn.Module, meta_inputs) -> TracedModel:
        policy = self.mp_policy
        if policy is None:
            traced = self._trace(model, meta_inputs)
        else:  # the model as it computes under the policy, then its master copy (:mod:`.casts`)
            given = [x.dtype if isinstance(x, torch.Tensor) else None for x in pytree.tree_leaves(meta_inputs)]
            if policy.param_dtype is not None:
                model, master = half_skeleton(model, policy.param_dtype)
                meta_inputs = half_inputs(meta_inputs, policy)
            else:
                master = {n: p.dtype for n, p in model.named_parameters(remove_duplicate=False)}
            traced = self._trace(model, meta_inputs)
            restore_master(traced, master, given, policy)
        annotate_graph(traced.gm)
        return traced

    def _trace(self, model: torch.nn.Module, meta_inputs) -> TracedModel:
        """The captured graph, stamped where it can be (not annotated)."""
        layer_list = find_layer_list(model) if self.stamp else None
        traced = None
        if layer_list is not None:
            try:
                with truncated(layer_list):
                    traced = self._capture(model, meta_inputs)
            except CaptureError:
                traced = None  # the cut-down model does not capture: the full capture decides
            if traced is not None:
                traced.stamped_layers = stamp(traced, layer_list)
                if traced.stamped_layers:
                    log.info("captured layers %s of %s; stamped %d copies", ", ".join(map(str, layer_list.keep)),
                             layer_list.path, traced.stamped_layers)
                else:
                    traced = None
        if traced is None:
            traced = self._capture(model, meta_inputs)
        return traced

    def _capture(self, model: torch.nn.Module, meta_inputs) -> TracedModel:
        device = _model_device(model)
        args, kwargs = _example_inputs(meta_inputs, device, _fake_mode_of(model))
        names_by_id: dict[int, list[str]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            names_by_id.setdefault(id(p), []).append(n)
        for n, b in model.named_buffers(remove_duplicate=False):
            names_by_id.setdefault(id(b), []).append(n)
        by_name = {n: id(t) for n, t in list(model.named_parameters(remove_duplicate=False))
                   + list(model.named_buffers(remove_duplicate=False))}
        requires_grad = {n: p.requires_grad for n, p in model.named_parameters(remove_duplicate=False)}
        try:
            with _fast_capture(), experts_as_one_op(model):
                ep = torch.export.export(model, args, kwargs, strict=False)
        except Exception as e:  # export raises many types; all mean "cannot capture"
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CaptureError(
                f"torch.export could not capture {type(model).__name__}: {type(e).__name__}: {first}\n"
                f"  at {_user_frame(e)}\n"
                "  Make the forward traceable (no data-dependent Python control flow, e.g. replace "
                "`if x.sum() > 0:` with torch.where/torch.cond), or pass inputs the model accepts."
            ) from e
        traced = self._from_exported(ep, names_by_id, by_name, requires_grad)
        traced.device = device.type
        return traced

    def _from_exported(self, ep, names_by_id, by_name, requires_grad) -> TracedModel:
        sig = ep.graph_signature
        bad = [f"{s.kind.name} of {s.target!r}" for s in sig.output_specs
               if s.kind not in (OutputKind.USER_OUTPUT, OutputKind.BUFFER_MUTATION)]
        if bad:
            raise CaptureError(f"the captured graph writes into state other than buffers ({', '.join(bad)}); "
                               "autoparallel captures forwards that update only buffers in place. Clone inputs "
                               "before changing them; change parameters outside the forward")
        src = ep.graph_module
        _inline_regions(src)
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        root = torch.nn.Module()
        params, buffers, constants = {}, {}, {}
        in_kinds = {s.arg.name: s for s in sig.input_specs}
        input_meta = []
        seen: dict[int, str] = {}  # id of a parameter/buffer -> its graph target
        state: dict[fx.Node, tuple[str, str]] = {}  # graph input -> (kind, name), for writes into it
        for node in src.graph.nodes:
            if node.op == "placeholder":
                spec = in_kinds[node.name]
                val = node.meta.get("val")
                if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER) and by_name.get(spec.target) in seen:
                    new = graph.get_attr(seen[by_name[spec.target]])  # a tied parameter: one node
                elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
                    if spec.target in by_name:
                        seen[by_name[spec.target]] = spec.target
                    names = names_by_id.get(by_name.get(spec.target), [spec.target])
                    names = [spec.target] + [n for n in names if n != spec.target]
                    meta = torch.empty(tuple(val.shape), dtype=val.dtype, device="meta")
                    if spec.kind == InputKind.PARAMETER:
                        params[spec.target] = names
                        meta = torch.nn.Parameter(meta, requires_grad=requires_grad.get(spec.target, True))
                    else:
                        buffers[spec.target] = names
                    set_attr(root, spec.target, meta)
                    new = graph.get_attr(spec.target)
                elif spec.kind == InputKind.CONSTANT_TENSOR:
                    target = f"_constant_{len(constants)}"
                    constants[target] = ep.constants[spec.target].detach()
                    root.register_buffer(target, torch.empty_like(constants[target], device="meta"))
                    new = graph.get_attr(target)
                elif spec.kind == InputKind.USER_INPUT:
                    new = graph.placeholder(node.name)
                    input_meta.append((tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else (None, val))
                else:
                    raise CaptureError(f"unsupported graph input kind {spec.kind.name} ({node.name})")
                new.meta = dict(node.meta)
                env[node] = new
                kind = {InputKind.PARAMETER: "parameter", InputKind.BUFFER: "buffer",
                        InputKind.CONSTANT_TENSOR: "constant"}.get(spec.kind, "input")
                state[new] = (kind, new.target if new.op == "get_attr" and kind != "constant" else
                              str(spec.target or node.name))
            elif node.op == "call_function" and node.target in _DROP:
                continue
            else:
                new = graph.node_copy(node, lambda n: env[n])
                env[node] = new
        materialize_autocast(graph, self.autocast)
        decompose_composites(graph)
        fuse_gelu(graph)
        roll_rotate_half(graph)
        split_fused_projections(graph)  # before stamping: stamped layers copy the rewritten traced one
        buffer_mutations = _state_updates(graph, sig, state, lambda t: seen.get(by_name.get(t), t))
        graph.eliminate_dead_code()
        used = {n.target for n in graph.nodes if n.op == "get_attr"}
        params = {k: v for k, v in params.items() if k in used}
        buffers = {k: v for k, v in buffers.items() if k in used}
        gm = _LazyGraphModule(root, graph)
        return TracedModel(gm=gm, in_spec=ep.call_spec.in_spec, out_spec=ep.call_spec.out_spec,
                           params=params, buffers=buffers, constants=constants, input_meta=input_meta,
                           requires_grad={k: requires_grad.get(k, True) for k in params},
                           buffer_mutations=buffer_mutations)


def _state_updates(graph: fx.Graph, sig, state, target_of) -> dict[int, str]:
    """Batch norm into primitive ops (:mod:`.batchnorm`), then buffers written in place, or
    declared ``BUFFER_MUTATION`` outputs, as extra graph outputs after the user's
    (:mod:`.mutations`). Returns flat output index → buffer target."""
    decompose_batch_norm(graph)
    written = functionalize_state(graph, state)
    out = graph.output_node()
    leaves = list(out.args[0])
    user = [x for s, x in zip(sig.output_specs, leaves) if s.kind == OutputKind.USER_OUTPUT]
    updates = {target_of(s.target): x for s, x in zip(sig.output_specs, leaves)
               if s.kind == OutputKind.BUFFER_MUTATION}
    updates.update(written)
    out.args = (tuple(user) + tuple(updates.values()),)
    return {len(user) + i: t for i, t in enumerate(updates)}


def _inline_regions(gm: fx.GraphModule) -> None:
    """Inline ``wrap_with_set_grad_enabled`` regions (their outputs detached when grad is off)
    and ``wrap_with_autocast`` regions (their nodes tagged ``meta["autocast"]``: ``(device
    type, dtype)``, or ``None`` where the region disables autocast; nodes of a region inside
    another keep the inner one's; :mod:`.autocast` makes the casts explicit)."""
    graph = gm.graph
    while True:
        hop = next((n for n in graph.nodes if n.op == "call_function" and n.target in (_HOP_GRAD, _HOP_AUTOCAST)),
                   None)
        if hop is None:
            break
        if hop.target is _HOP_AUTOCAST:
            device_type, dtype, on, _cache, sub_node, *inputs = hop.args
            enabled, tag = True, {"autocast": (device_type, dtype) if on else None}
        else:
            enabled, sub_node, *inputs = hop.args
            tag = {"autocast": hop.meta["autocast"]} if "autocast" in hop.meta else {}
        sub = getattr(gm, sub_node.target)
        env = {}
        phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
        env.update(zip(phs, inputs))
        outs = None
        with graph.inserting_before(hop):
            for n in sub.graph.nodes:
                if n.op == "placeholder":
                    continue
                if n.op == "output":
                    outs = list(pytree.tree_leaves(n.args[0]))
                    continue
                if n.op == "get_attr":  # a region nested in this one: its graph moves to the top
                    name = f"{sub_node.target}_{n.target}"
                    setattr(gm, name, getattr(sub, n.target))
                    env[n] = graph.get_attr(name)
                    continue
                env[n] = graph.node_copy(n, lambda x: env[x])
                env[n].meta.update(tag)
            results = []
            for o in outs:
                r = env[o]
                if not enabled and isinstance(r.meta.get("val"), torch.Tensor):
                    d = graph.call_function(torch.ops.aten.detach.default, (r,))
                    d.meta = dict(r.meta)
                    r = d
                results.append(r)
        for user in list(hop.users):
            assert user.target.__name__ == "getitem", user
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(hop)
        graph.erase_node(sub_node)
        delattr(gm, sub_node.target)
    graph.lint()


def capture(model: torch.nn.Module, meta_inputs, *, stamp_layers: bool = True,
            mp_policy: MixedPrecisionPolicy | None = None, device: str = "cpu") -> TracedModel:
    """The capture stage's entry point: ``model`` on ``meta_inputs`` as :class:`ColoTracer`
    captures it (``stamp_layers``: its ``stamp``), under ``mp_policy`` and the
    ``torch.autocast`` enabled now for ``device`` (a device type), logged with its time.

    Raises:
        CaptureError: as :class:`ColoTracer` raises it.
    """
    t0 = time.perf_counter()
    traced = ColoTracer(stamp=stamp_layers, mp_policy=mp_policy,
                        autocast=ambient_autocast(device)).trace(model, meta_inputs)
    log.info("traced %s: %d graph nodes (%.2f s)", type(model).__name__, len(traced.gm.graph.nodes),
             time.perf_counter() - t0)
    return traced
