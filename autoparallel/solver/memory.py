"""Per-device peak memory of one training step: a liveness model over forward and backward.

The step is a timeline of ``2N`` steps for a graph of ``N`` nodes: forward step ``i`` runs
node ``i``; backward step ``2N - 1 - i`` runs its backward (reverse order). Every tensor
the step holds is an *item* with a live interval ``[start, end]`` and a size that depends
on the strategy of exactly one node (its *owner*), so that the memory at any step is
linear in the plan's one-hot strategy variables (what the ILP needs):

* parameters and buffers, whole step, under the parameter's spec;
* gradients of parameters, from the backward of the parameter's last use (set_to_none
  zeroing: the previous step's are gone) to the end;
* optimizer states, whole step: ``OPTIMIZER_STATES[optimizer]`` tensors the size of each
  trainable parameter (Adam/AdamW: two; SGD with momentum: one; SGD: none);
* forward values (temporaries), from their node's forward step to their last forward use;
* activations saved for backward, from the forward of their first saver to the backward
  of that saver (savers run backward in reverse order, so the first is the last to
  free them), under the spec in which the saver sees them (a redistributed input, e.g. an
  all-gathered activation, is saved as redistributed);
* tensors an op saves that are not graph values (LayerNorm's mean and rstd, SDPA's
  logsumexp, dropout masks), with the saver, scaled like its first output;
* activation gradients, from the backward of the value's last consumer to the backward
  of its producer, under the value's spec;
* the values the module returns (kind ``outputs``), through the whole backward (the caller
  holds them while it runs), at their returned size: under the placements
  :func:`~autoparallel.plan.returned_spec` gives their producer's spec (whole logits
  under ``outputs="replicated"``, a shard of them under ``"sharded"``).

Which tensors autograd saves is measured, not guessed: each distinct op signature of the
captured graph runs once, alone, on FakeTensors of the run device under
``torch.autograd.graph.saved_tensors_hooks``, so the backend choices (e.g. SDPA's flash
kernel saving logsumexp instead of the probabilities) are those of the real run. Saved
tensors are matched to the op's inputs and outputs by storage, then to the graph values
owning those storages (through views, in-place ops and getitems). An op that cannot run
alone on FakeTensors is assumed to save every input that needs a gradient. The model
ignores allocator fragmentation and the workspace of kernels; collectives' buffers count
as the redistributed tensors they produce.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from ..placement import Spec, local_shape
from ..plan import returned_spec
from ..graph import alias_source, output_leaves, tensor_inputs
from ..strategies.engine import Strategy
from ..tracer.annotate import node_info

log = logging.getLogger(__name__)

OPTIMIZER_STATES = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}
"""State tensors kept per trainable parameter by each optimizer (``torch.optim`` defaults)."""

DEFAULT_OPTIMIZER = "adamw"

KINDS = ("parameters", "gradients", "optimizer", "activations", "temporaries", "outputs")

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(budget: int | float | str) -> int:
    """Bytes from an int or a string like ``"12GiB"``, ``"500 MB"`` (binary and decimal units).

    Raises:
        ValueError: for an unreadable string or a non-positive budget.
    """
    if isinstance(budget, str):
        s = budget.strip().lower().replace(" ", "")
        num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = s[len(num):]
        if unit not in _UNITS or not num:
            raise ValueError(f"cannot read memory budget {budget!r}; write e.g. '12GiB', '800MB' or bytes")
        value = float(num) * _UNITS[unit]
    else:
        value = float(budget)
    if value <= 0:
        raise ValueError(f"memory budget must be positive, got {budget!r}")
    return int(value)


def _local_bytes(shape, dtype: torch.dtype, spec: Spec, mesh_shape) -> int:
    return math.prod(local_shape(shape, spec, mesh_shape)) * dtype.itemsize


@dataclass
class Item:
    """One tensor of the step: live on steps ``start..end`` (inclusive), of kind ``kind``,
    sized by ``size(strategy of owner)`` in bytes per device."""

    kind: str
    owner: fx.Node
    start: int
    end: int
    size: Callable[[Strategy], int]
    forward_value: bool = False  # a forward output living until its last forward use
    value: fx.Node | None = None  # for a saved activation, the node whose output it is


@dataclass
class MemoryEstimate:
    """Peak bytes per device, the step it occurs at, and what is live then, by kind."""

    peak_bytes: int
    peak_step: int
    steps: int
    breakdown: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "peak_step": self.peak_step, "steps": self.steps,
                "phase": "forward" if self.peak_step < self.steps // 2 else "backward",
                "breakdown": dict(self.breakdown)}


@dataclass
class Saved:
    """A tensor ``saver`` keeps for its backward: the graph value ``value`` (the
    ``(node, output)`` that owns its storage) seen as the saver's input ``input_pos``
    (``None``: not through an input), or, when ``value`` is None, an op-internal tensor
    of ``nbytes`` global bytes."""

    saver: fx.Node
    value: tuple[fx.Node, int] | None
    input_pos: int | None
    nbytes: int


def storage_owner(node: fx.Node, aliases) -> tuple[fx.Node, int]:
    """The ``(node, tensor output index)`` whose storage ``node``'s (first) output uses:
    itself, or, through views, in-place ops and getitems, the value they alias."""
    while True:
        if node in aliases:
            src, idx = aliases[node]
            if alias_source(src) is None:
                return src, idx
            node = src
        src = alias_source(node)
        if src is None:
            return node, 0
        node = src


def _saved_by_op(node: fx.Node, device: str, traced_on: str, memo: dict) -> list[tuple[str, int, int]]:
    """What ``node``'s op saves for backward, from running it alone on FakeTensors of
    ``device``: ``("input", j, 0)``, ``("output", i, 0)`` or ``("internal", -1, bytes)``.
    Memoized per (op, input shapes, dtypes and grad flags, other arguments)."""
    ins = tensor_inputs(node)
    grads = [node_info(x).requires_grad and x.meta["val"].dtype.is_floating_point for _, x in ins]
    if not any(grads):
        return []
    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    key = (node.target, tuple((tuple(x.meta["val"].shape), x.meta["val"].dtype, g) for (_, x), g in zip(ins, grads)),
           repr([leaf for i, leaf in enumerate(leaves) if not isinstance(leaf, fx.Node)]))
    if key in memo:
        return memo[key]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fakes = {}
        for (li, x), g in zip(ins, grads):
            v = x.meta["val"]
            t = torch.empty(tuple(v.shape), dtype=v.dtype, device=device)
            fakes[li] = t.requires_grad_().clone() if g else t  # not a leaf: in-place ops may write it
    new = []
    for i, leaf in enumerate(leaves):
        if i in fakes:
            new.append(fakes[i])
        elif isinstance(leaf, torch.device) and leaf.type == traced_on:
            new.append(torch.device(device))
        else:
            new.append(leaf)
    args, kwargs = pytree.tree_unflatten(new, spec)
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    try:
        with mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = node.target(*args, **kwargs)
    except Exception as e:  # an op that cannot run alone on FakeTensors: assume it saves its inputs
        log.debug("memory model: %s does not run on FakeTensors (%s); counting its inputs as saved",
                  node.target, e)
        memo[key] = [("input", j, 0) for j, g in enumerate(grads) if g]
        return memo[key]
    in_st = [fakes[li].untyped_storage()._cdata for li, _ in ins]
    out_st = [t.untyped_storage()._cdata for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    result = []
    for t in saved:
        st = t.untyped_storage()._cdata
        if st in in_st:
            result.append(("input", in_st.index(st), 0))
        elif st in out_st:
            result.append(("output", out_st.index(st), 0))
        else:
            result.append(("internal", -1, t.numel() * t.element_size()))
    memo[key] = result
    return result


def saved_tensors(gm: fx.GraphModule, aliases, device: str = "cpu", traced_on: str = "meta") -> list[Saved]:
    """What every node saves for backward (global sizes), in graph order.

    Each distinct op signature runs once, alone, on FakeTensors of ``device`` under
    ``torch.autograd.graph.saved_tensors_hooks`` (nothing is allocated; repeated layers
    cost nothing more). Saved inputs and outputs are mapped to the graph value that owns
    their storage (:func:`storage_owner`). Nodes without tensor outputs (``aten.item``: a
    Python number) save nothing: autograd does not differentiate through them.
    """
    memo: dict = {}
    records = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node in aliases or not node_info(node).outputs:
            continue  # a node without tensor outputs (.item()) has no backward: it saves nothing
        ins = tensor_inputs(node)
        for kind, j, nbytes in _saved_by_op(node, device, traced_on, memo):
            if kind == "input":
                records.append(Saved(node, storage_owner(ins[j][1], aliases), j, 0))
            elif kind == "output":
                owner = storage_owner(node, aliases) if j == 0 else (node, j)
                records.append(Saved(node, owner, None, 0))
            else:
                records.append(Saved(node, None, None, nbytes))
    return records


class MemoryModel:
    """The items of one training step of a captured graph (see the module docstring).

    Args:
        gm: the annotated captured graph.
        aliases: getitem node → (producer, output index) (from the strategy generator).
        mesh_shape: devices per mesh axis.
        optimizer: a key of :data:`OPTIMIZER_STATES` (default AdamW).
        device: the device type the module will run on (selects kernels, e.g. SDPA's).
        traced_on: the device type the graph was captured on.
        outputs / whole_outputs: how the module returns the graph's outputs, as
            :class:`~autoparallel.solver.planner.Planner` takes them.

    Raises:
        ValueError: for an unknown optimizer.
    """

    def __init__(self, gm: fx.GraphModule, aliases, mesh_shape, *, optimizer: str = DEFAULT_OPTIMIZER,
                 device: str = "cpu", traced_on: str = "meta", outputs: str = "replicated",
                 whole_outputs: frozenset[int] = frozenset()):
        if optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {sorted(OPTIMIZER_STATES)}")
        self.mesh_shape = tuple(mesh_shape)
        nodes = [n for n in gm.graph.nodes if n.op != "output"]
        self.nodes = nodes  # forward step i runs nodes[i]
        step = {n: i for i, n in enumerate(nodes)}
        n_steps = 2 * len(nodes)
        self.steps = n_steps
        back = n_steps - 1
        saved = saved_tensors(gm, aliases, device, traced_on)

        def out_size(u, i):
            shape, dtype = node_info(u).outputs[i]
            return lambda s: _local_bytes(shape, dtype, s.outputs[i], self.mesh_shape)

        last_use: dict[tuple, int] = {}
        for n in nodes:
            if not node_info(n).outputs:
                continue
            key = storage_owner(n, aliases)
            users = [step[c] for c in n.users if c in step]
            last_use[key] = max([last_use.get(key, step[n])] + users)
        items: list[Item] = []
        for (u, i), end in last_use.items():
            info = node_info(u)
            if u.op == "get_attr":
                size = out_size(u, i)
                kind = "parameters"
                items.append(Item(kind, u, 0, back, size))
                if info.requires_grad:
                    items.append(Item("gradients", u, back - end, back, size))
                    k = OPTIMIZER_STATES[optimizer]
                    if k:
                        items.append(Item("optimizer", u, 0, back, lambda s, f=size, k=k: k * f(s)))
                continue
            items.append(Item("temporaries", u, step[u], end, out_size(u, i), forward_value=True))
            if info.requires_grad and info.outputs[i][1].is_floating_point:
                items.append(Item("temporaries", u, back - end, back - step[u], out_size(u, i)))
        first_saver: dict = {}
        for rec in saved:
            key = rec.value if rec.value is not None else id(rec)
            if key not in first_saver or step[rec.saver] < step[first_saver[key].saver]:
                first_saver[key] = rec
        for rec in first_saver.values():
            n = rec.saver
            start, end = step[n], back - step[n]
            if rec.value is None:
                items.append(Item("activations", n, start, end, self._internal_size(n, rec.nbytes)))
                continue
            u, i = rec.value
            if u.op == "get_attr":  # counted as a parameter
                continue
            if rec.input_pos is not None:
                x = tensor_inputs(n)[rec.input_pos][1]
                shape, dtype = node_info(x).outputs[0]
                j = rec.input_pos
                items.append(Item("activations", n, start, end,
                                  lambda s, sh=shape, dt=dtype, j=j: _local_bytes(sh, dt, s.inputs[j], self.mesh_shape),
                                  value=u))
            else:
                items.append(Item("activations", u, start, end, out_size(u, i), value=u))
        items += self._returned_items(gm, aliases, outputs, whole_outputs)
        self.items = items

    def _returned_items(self, gm: fx.GraphModule, aliases, outputs: str, whole: frozenset[int]) -> list[Item]:
        """The returned values, from the first backward step to the end, at returned size."""
        out = next(n for n in gm.graph.nodes if n.op == "output")
        items = []
        for j, x in enumerate(output_leaves(out)):
            u, i = aliases.get(x, (x, 0))
            shape, dtype = node_info(u).outputs[i]

            def size(s, shape=shape, dtype=dtype, i=i, j=j):
                return _local_bytes(shape, dtype, returned_spec(s.outputs[i], outputs, j in whole), self.mesh_shape)

            items.append(Item("outputs", u, len(self.nodes), self.steps - 1, size))
        return items

    def _internal_size(self, node: fx.Node, nbytes: int) -> Callable[[Strategy], int]:
        outs = node_info(node).outputs
        if not outs:
            return lambda s: nbytes
        shape, dtype = outs[0]
        whole = max(1, math.prod(shape))
        return lambda s: nbytes * math.prod(local_shape(shape, s.outputs[0], self.mesh_shape)) // whole

    def timeline(self, choice: dict[fx.Node, Strategy]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Bytes live at every step under ``choice`` (node → strategy), in total and by kind."""
        by_kind = {k: np.zeros(self.steps + 1, dtype=np.int64) for k in KINDS}
        for it in self.items:
            b = it.size(choice[it.owner])
            arr = by_kind[it.kind]
            arr[it.start] += b
            arr[it.end + 1] -= b
        by_kind = {k: np.cumsum(v)[:-1] for k, v in by_kind.items()}
        return sum(by_kind.values()), by_kind

    def estimate(self, choice: dict[fx.Node, Strategy]) -> MemoryEstimate:
        """The peak bytes per device under ``choice`` and its breakdown by kind."""
        total, by_kind = self.timeline(choice)
        t = int(np.argmax(total))
        return MemoryEstimate(int(total[t]), t, self.steps, {k: int(v[t]) for k, v in by_kind.items()})

    def row(self, t: int) -> list[tuple[fx.Node, Callable[[Strategy], int]]]:
        """The items live at step ``t``: ``(owner, size function)``: memory at ``t`` is
        their sum, linear in the owners' strategy choice."""
        return [(it.owner, it.size) for it in self.items if it.start <= t <= it.end]
