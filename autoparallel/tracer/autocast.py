"""``torch.autocast`` made explicit: the casts autocast would insert become graph nodes.

``torch.export`` captures above autocast: a forward run under an enabled ``torch.autocast``
gives a graph of the model's ops without the casts autocast performs (their outputs carry
the half-precision dtypes, their inputs do not), and a ``with torch.autocast(...)`` block
inside the forward becomes a ``wrap_with_autocast`` region (:func:`inline_regions` in
:mod:`.capture` inlines it and tags its nodes). Such a graph cannot be priced or run on
local shards as autocast runs it.

:func:`materialize_autocast` walks the graph in order with FakeTensors and, for every op
under autocast (the ambient state at capture, or its region's), runs it once under
``torch.autocast`` and once without, recording the ``aten._to_copy`` calls each run makes on
the op's inputs (a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees them: it
runs below the autocast dispatch key); the casts only the autocast run makes are autocast's.
Each becomes an ``aten._to_copy`` node before the op (one per input and dtype within a
region, as autocast's cast cache does for leaves), and every node's ``meta["val"]`` is
recomputed from its inputs. The op lists are torch's own (``torch/csrc/autograd/autocast_mode``:
matmuls and convolutions to the lower precision, reductions such as ``softmax`` kept in
fp32 where autocast says so), not a copy of them here.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .casts import dtype_tag

aten = torch.ops.aten
_CASTS = (aten._to_copy.default,)

Autocast = tuple[str, torch.dtype]
"""``(device_type, dtype)`` of an enabled autocast."""


def ambient_autocast(device_type: str) -> Autocast | None:
    """The autocast enabled now for ``device_type`` (``"cpu"``, ``"cuda"``), or ``None``."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return device_type, torch.get_autocast_dtype(device_type)


class _CastLog(TorchDispatchMode):
    """Records ``(input position, dtype)`` of every ``_to_copy`` of a watched tensor."""

    def __init__(self, watched: dict[int, int]):
        super().__init__()
        self.watched = watched
        self.casts: list[tuple[int, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _CASTS and args and id(args[0]) in self.watched and kwargs.get("dtype") is not None:
            self.casts.append((self.watched[id(args[0])], kwargs["dtype"]))
        return func(*args, **kwargs)


def _casts_of(target, args, kwargs, leaves: list, mode, autocast: Autocast) -> dict[int, torch.dtype]:
    """Leaf position → dtype of the inputs autocast casts when it runs ``target``."""
    watched = {id(v): i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor) and v.is_floating_point()}
    logs = []
    for enabled in (True, False):
        log = _CastLog(watched)
        with mode, torch.autocast(autocast[0], dtype=autocast[1], enabled=enabled), log:
            target(*args, **kwargs)
        logs.append(log.casts)
    own = set(logs[1])
    return {i: dt for i, dt in logs[0] if (i, dt) not in own and leaves[i].dtype != dt}


def materialize_autocast(graph: fx.Graph, ambient: Autocast | None) -> int:
    """Insert the casts autocast performs (module docstring), in place.

    Args:
        graph: the captured graph; a node's ``meta["autocast"]`` (set when a region was
            inlined) is its autocast, ``None`` for a region that disables it; other nodes
            run under ``ambient``.
        ambient: the autocast enabled around the forward at capture, or ``None``.

    Returns:
        the number of casts inserted (0: the graph is unchanged).
    """
    if ambient is None and not any(n.meta.get("autocast") for n in graph.nodes):
        return 0
    vals = [n.meta["val"] for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    mode = next(v.fake_mode for v in vals if hasattr(v, "fake_mode"))
    cache: dict[tuple, fx.Node] = {}  # (input node, dtype, region) -> its cast
    inserted = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        autocast = node.meta.get("autocast", ambient)
        leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
        vals = [x.meta.get("val") if isinstance(x, fx.Node) else x for x in leaves]
        args, kwargs = pytree.tree_unflatten(vals, spec)
        if autocast is not None and node.target not in _CASTS:
            for i, dtype in _casts_of(node.target, args, kwargs, vals, mode, autocast).items():
                key = (leaves[i], dtype, autocast)
                if key not in cache:
                    with graph.inserting_before(node):
                        cast = graph.create_node("call_function", aten._to_copy.default, (leaves[i],),
                                                 {"dtype": dtype}, name=f"{leaves[i].name}_{dtype_tag(dtype)}")
                    with mode:
                        cast.meta = {"val": vals[i].to(dtype)}
                    if "nn_module_stack" in node.meta:
                        cast.meta["nn_module_stack"] = dict(node.meta["nn_module_stack"])
                    cache[key] = cast
                    inserted += 1
                leaves[i], vals[i] = cache[key], cache[key].meta["val"]
            node.args, node.kwargs = pytree.tree_unflatten(leaves, spec)
            args, kwargs = pytree.tree_unflatten(vals, spec)
        with mode:  # the dtypes of everything downstream follow from the casts
            node.meta["val"] = node.target(*args, **kwargs)
    return inserted
