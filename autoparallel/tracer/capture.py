"""ColoTracer: capture a model with ``torch.export.export(strict=False)`` on meta tensors.

The captured graph is ATen training IR. Parameters and buffers become ``get_attr`` nodes
named by their fully qualified names in the original model; tensor constants lifted by
export become ``get_attr`` nodes on ``_constant_<i>``; user inputs stay placeholders in
the order of the flattened ``(args, kwargs)``. ``no_grad`` regions that export wraps in
``wrap_with_set_grad_enabled`` are inlined, their outputs detached, which keeps their
meaning. Nothing is allocated: inputs are meta tensors for a meta-device model and
FakeTensors on the model's device otherwise, so tensors the forward creates (``arange``
without ``device=``) land on the same device as the weights, as they do when it runs.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import traceback
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx._lazy_graph_module import _LazyGraphModule, _use_lazy_graph_module

from ..errors import CaptureError
from ..fqn import set_attr
from .annotate import annotate_graph

_HOP_GRAD = torch.ops.higher_order.wrap_with_set_grad_enabled
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
        input_meta: ``(shape, dtype)`` of each flattened user input.
        device: device type the model was captured on (``device=`` arguments in the graph
            name it; codegen moves them to the run device).
    """

    gm: fx.GraphModule
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    params: dict[str, list[str]]
    buffers: dict[str, list[str]]
    constants: dict[str, torch.Tensor]
    input_meta: list[tuple[tuple[int, ...], torch.dtype]] = field(default_factory=list)
    requires_grad: dict[str, bool] = field(default_factory=dict)
    device: str = "meta"


def _model_device(model: torch.nn.Module) -> torch.device:
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


def _example_inputs(meta_inputs, device: torch.device):
    """``(args, kwargs)`` of tensors with the inputs' shapes and dtypes, on the model's device,
    allocating nothing: meta tensors for a meta model, FakeTensors otherwise (export then
    fakifies the real weights in the same mode, without copying them)."""
    args, kwargs = (tuple(), dict(meta_inputs)) if isinstance(meta_inputs, dict) else (tuple(meta_inputs), {})
    if device.type == "meta":
        def make(x):
            return torch.empty(tuple(x.shape), dtype=x.dtype, device="meta")
    else:
        mode = FakeTensorMode(allow_non_fake_inputs=True)

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

    Raises:
        CaptureError: export failed; the message carries export's reason and the first
            source line outside torch that the failure went through.
    """

    def trace(self, model: torch.nn.Module, meta_inputs) -> TracedModel:
        device = _model_device(model)
        args, kwargs = _example_inputs(meta_inputs, device)
        names_by_id: dict[int, list[str]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            names_by_id.setdefault(id(p), []).append(n)
        for n, b in model.named_buffers(remove_duplicate=False):
            names_by_id.setdefault(id(b), []).append(n)
        by_name = {n: id(t) for n, t in list(model.named_parameters(remove_duplicate=False))
                   + list(model.named_buffers(remove_duplicate=False))}
        requires_grad = {n: p.requires_grad for n, p in model.named_parameters(remove_duplicate=False)}
        try:
            with _fast_capture():
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
        if any(s.kind != OutputKind.USER_OUTPUT for s in sig.output_specs):
            kinds = sorted({s.kind.name for s in sig.output_specs if s.kind != OutputKind.USER_OUTPUT})
            raise CaptureError(f"the captured graph mutates state ({', '.join(kinds)}), e.g. BatchNorm running "
                               "statistics in training mode; autoparallel does not shard such models yet")
        src = ep.graph_module
        _inline_grad_regions(src)
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        root = torch.nn.Module()
        params, buffers, constants = {}, {}, {}
        in_kinds = {s.arg.name: s for s in sig.input_specs}
        input_meta = []
        seen: dict[int, str] = {}  # id of a parameter/buffer -> its graph target
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
                    input_meta.append((tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else (None, type(val)))
                else:
                    raise CaptureError(f"unsupported graph input kind {spec.kind.name} ({node.name})")
                new.meta = dict(node.meta)
                env[node] = new
            elif node.op == "call_function" and node.target in _DROP:
                continue
            else:
                new = graph.node_copy(node, lambda n: env[n])
                env[node] = new
        graph.eliminate_dead_code()
        used = {n.target for n in graph.nodes if n.op == "get_attr"}
        params = {k: v for k, v in params.items() if k in used}
        buffers = {k: v for k, v in buffers.items() if k in used}
        gm = _LazyGraphModule(root, graph)
        annotate_graph(gm)
        return TracedModel(gm=gm, in_spec=ep.call_spec.in_spec, out_spec=ep.call_spec.out_spec,
                           params=params, buffers=buffers, constants=constants, input_meta=input_meta,
                           requires_grad={k: requires_grad.get(k, True) for k in params})


def _inline_grad_regions(gm: fx.GraphModule) -> None:
    """Inline ``wrap_with_set_grad_enabled`` regions; detach their outputs when grad is off."""
    graph = gm.graph
    while True:
        hop = next((n for n in graph.nodes if n.op == "call_function" and n.target is _HOP_GRAD), None)
        if hop is None:
            break
        enabled, sub_node, *inputs = hop.args
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
                if n.op == "get_attr":
                    raise CaptureError(f"nested graph attribute {n.target} inside a no_grad region")
                env[n] = graph.node_copy(n, lambda x: env[x])
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
