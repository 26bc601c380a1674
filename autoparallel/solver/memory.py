"""Per-device peak memory of one training step: a liveness model over forward and backward.

The step is a timeline of ``2N`` steps for a graph of ``N`` nodes: forward step ``i`` runs
node ``i``; backward step ``2N - 1 - i`` runs its backward (reverse order). Every tensor
the step holds is an *item* with a live interval ``[start, end]`` and a size that depends
on the strategy of exactly one node (its *owner*), so that the memory at any step is
linear in the plan's one-hot strategy variables (what the ILP needs):

* parameters and buffers, whole step, under the parameter's spec (none of an offloaded
  parameter's bytes, gradient and optimizer states are on the device: its device copy counts
  as the ``gathered`` kind below);
* gradients of parameters, from the backward of the parameter's last use (set_to_none
  zeroing: the previous step's are gone) to the end;
* optimizer states, whole step: ``OPTIMIZER_STATES[optimizer]`` tensors the size of each
  trainable parameter (Adam/AdamW: two; SGD with momentum: one; SGD: none), or of its shard
  where the states are sharded (ZeRO stage 1, :mod:`autoparallel.strategies.zero`: the shard
  the optimizer steps and its gradient are held beside the whole parameter and gradient; under
  stage 2 the shard's gradient alone); under the foreach implementation, at the last step,
  the step's temporaries (kind ``temporaries``: :data:`FOREACH_TEMPORARIES` states' worth);
* forward values (temporaries), from their node's forward step to their last forward use;
* activations saved for backward, from the forward of their first saver to the backward
  of that saver (savers run backward in reverse order, so the first is the last to
  free them), under the spec in which the saver sees them (a redistributed input, e.g. an
  all-gathered activation, is saved as redistributed);
* tensors an op saves that are not graph values (LayerNorm's mean and rstd, SDPA's
  logsumexp, dropout masks, cross-entropy's log-softmax), with the saver, once per storage
  (an op whose parts save one tensor twice holds it once), split like the input or output
  they are derived from (same shape, reduced dims, or leading dims); a differentiable one
  (computed from inputs that need a gradient) also has a gradient of its size at the saver's
  backward step (cross-entropy's backward holds the gradients of the log-probabilities and of
  the logits at once; SDPA's float copy of a boolean mask has none);
* activation gradients, from the backward of the value's last consumer to the backward
  of its producer, under the value's spec; and, at the backward of a consumer that reads the
  value in another spec, the gradient in the largest spec the redistribution's backward
  passes through (each of its moves writes a new tensor while its input is held);
* parameters a saver takes in a layout they are not held in (kind ``gathered``: FSDP's
  all-gathered weight, kept by autograd until the saver's backward, and its gradient in that
  layout at that step; :class:`Item` with ``param``);
* the gradient-bucket buffers of parameters replicated along a mesh axis (kind ``buffers``: the
  flat copy and the all-reduce's result, at the backward of the parameter's first use);
* the batch the caller passes (kind ``inputs``), through the whole step (the caller holds
  it): the global batch on every device under ``inputs="global"`` (the module reads its piece
  as a view of it), this device's piece under ``"local"``;
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
alone on FakeTensors is assumed to save every input that needs a gradient. Where an emit-time
rewrite changes what an op keeps (SDPA's key and value unrepeated, a causal mask's copy gone),
the size is the rewritten graph's: :func:`autoparallel.rewrites.saved_size`, from the registry
the lowering runs. The model ignores allocator fragmentation and the workspace of kernels;
collectives' buffers count as the redistributed tensors they produce, except the gradient
buckets above.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import Shard

from .. import rewrites, units
from ..placement import R, Spec, local_shape
from ..plan import returned_spec
from ..results import MemoryBreakdown, MemoryPeak
from ..graph import alias_source, output_leaves, tensor_inputs
from ..strategies.engine import Strategy
from ..strategies.zero import state_spec_of
from ..strategies.generator import local_input_spec
from ..strategies.records import record_of
from ..tracer.annotate import node_info

log = logging.getLogger(__name__)

OPTIMIZER_STATES = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}
"""State tensors kept per trainable parameter by each optimizer (``torch.optim`` defaults)."""

DEFAULT_OPTIMIZER = "adamw"

FOREACH_TEMPORARIES = {"sgd": 0, "sgd_momentum": 0, "adam": 1, "adamw": 1}
"""State-sized tensors per trainable parameter that the foreach implementation of each optimizer
allocates at once for its whole parameter group in a step (``torch.optim`` defaults, torch
2.13): Adam's and AdamW's denominators, ``torch._foreach_sqrt`` of every ``exp_avg_sq``
(``torch/optim/adam.py``, ``_multi_tensor_adam``, l. 788; divided and offset in place after); SGD's
updates are in place. The per-tensor loop's are one parameter's at a time, not counted."""

KINDS = tuple(k for k, _ in MemoryBreakdown().items())

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


RESERVE_FRACTION = 0.1
"""Share of a device's memory the default budget leaves out: the caching allocator's
fragmentation, communication buffers (NCCL's), kernel workspaces and whatever the model does
not capture, none of which the memory model counts."""


def host_memory() -> int:
    """Physical memory of this machine in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def preset_capacity(device) -> int:
    """Bytes of memory of one device of a cost model's preset (``DevicePreset.memory``; for
    the ``cpu`` preset, this host's physical memory)."""
    return host_memory() if device.name == "cpu" else int(device.memory)


def device_capacity(device_type: str, ranks_on_host: int = 1) -> int:
    """Bytes of memory a training step may use on the device this process runs on: on a GPU,
    the free memory (``torch.cuda.mem_get_info``: what the CUDA context and other processes
    leave); on a CPU, this host's physical memory divided by ``ranks_on_host``, the ranks
    sharing it (the choice made for CPU meshes: ranks on one host share its memory evenly)."""
    if device_type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info()[0])
    return host_memory() // max(1, ranks_on_host)


def resolve_budget(memory_budget: int | float | str | None, capacity: Callable[[], int]) -> int | None:
    """The budget in bytes per device that planning enforces, or ``None`` for none.

    Args:
        memory_budget: bytes (an int, or a string such as ``"12GiB"``: :func:`parse_bytes`);
            ``"unlimited"`` for no budget; ``None`` for the default: ``capacity()`` less
            :data:`RESERVE_FRACTION`.
        capacity: the device's memory in bytes (:func:`preset_capacity`, :func:`device_capacity`).

    Raises:
        ValueError: an unreadable string or a non-positive budget.
    """
    if memory_budget is None:
        return int(capacity() * (1 - RESERVE_FRACTION))
    if isinstance(memory_budget, str) and memory_budget.strip().lower() == "unlimited":
        return None
    return parse_bytes(memory_budget)


def _local_bytes(shape, dtype: torch.dtype, spec: Spec, mesh_shape) -> int:
    return math.prod(local_shape(shape, spec, mesh_shape)) * dtype.itemsize


def _on_device(size: Callable[[Strategy], int]) -> Callable[[Strategy], int]:
    """``size`` on the device: 0 under a strategy that offloads the parameter to host memory
    (:mod:`autoparallel.strategies.offload`)."""
    return lambda s: 0 if s.offload else size(s)


@dataclass
class Item:
    """One tensor of the step: live on steps ``start..end`` (inclusive), of kind ``kind``,
    sized by ``size(strategy of owner)`` in bytes per device.

    With ``source`` set, the node whose output ``owner`` takes as its input ``input_pos``, a
    copy of which ``owner`` keeps: a parameter or a view of one (an all-gathered weight autograd
    keeps, or its gradient), or a value another op saves too, read here in another layout (a
    redistributed activation): it exists only when the owner's input spec is not the
    source's (:func:`is_copy`) or ``offloaded`` is set and its strategy keeps it
    in host memory (the device copy of that parameter, which the source is or is a view of;
    never set where host memory is the device's, on a CPU). With ``producer`` set (``(node, output
    index)``), the gradient of that value on its way back from the layout ``owner`` takes it in
    as input ``input_pos`` to the producer's: it exists only when the two layouts differ, sized
    by ``passing(held, seen)`` (``size``: the bytes in the owner's layout). Either way its exact
    size depends on two strategies (:meth:`bytes`). The ILP rows take a lower bound
    (:meth:`linear`): for a source ``size(owner) - bytes of the source``, exact for FSDP's
    gather up to the shard itself, and 0 or less when the owner reads it as held; for a gradient
    on its way back, 0 (its difference bound is negative under most strategy pairs, and summed
    over a row it weakens the floor that ends a hopeless memory search at once: DeepSeek-V3 on
    64 × 8 planned in 95 s instead of 15 s)."""

    kind: str
    owner: fx.Node
    start: int
    end: int
    size: Callable[[Strategy], int]
    forward_value: bool = False  # a forward output living until its last forward use
    value: fx.Node | None = None  # for a saved activation, the node whose output it is
    source: tuple[fx.Node, int] | None = None
    producer: tuple[fx.Node, int] | None = None
    passing: Callable[[Spec, Spec], int] | None = None
    input_pos: int = 0
    offloaded: fx.Node | None = None

    @property
    def held_by(self) -> fx.Node | None:
        """The other node whose strategy the size depends on (``source`` or ``producer``'s)."""
        return self.source[0] if self.source is not None else self.producer[0] if self.producer else None

    def bytes(self, choice: dict[fx.Node, Strategy]) -> int:
        """Bytes per device under ``choice`` (node → strategy)."""
        s = choice[self.owner]
        seen = s.inputs[self.input_pos] if self.held_by is not None else None
        if self.source is not None:
            held = choice[self.source[0]]
            param = choice.get(self.offloaded) if self.offloaded is not None else None
            if not (param is not None and param.offload) and not is_copy(held.outputs[self.source[1]], seen):
                return 0
        elif self.producer is not None:
            held = choice[self.producer[0]].outputs[self.producer[1]]
            return 0 if held == seen else self.passing(held, seen)
        return self.size(s)

    def linear(self, held_bytes) -> list[tuple[fx.Node, Callable[[Strategy], int]]]:
        """``(node, size function)`` terms whose sum is a lower bound of the item's size for
        the ILP, each linear in one node's strategy (``held_bytes``: a source node → the size
        function of what it holds)."""
        if self.producer is not None:
            return []
        if self.source is None:
            return [(self.owner, self.size)]
        held = held_bytes(self.source)
        return [(self.owner, self.size), (self.source[0], lambda s: -held(s))]


def is_copy(held: Spec, seen: Spec) -> bool:
    """Whether a tensor held in ``held`` reaches a consumer taking it in ``seen`` as a new
    tensor: whenever the two differ. A collective's result is one, and so is a slice of a
    replicated tensor: the runtime cuts a device's piece with ``index_select``
    (:func:`~autoparallel.runtime_kernels.local_piece`, the coordinate a tensor), a copy. Counted
    as a view, the query, key and value slices of GPT-2's fused ``c_attn`` weight (held
    replicated, read split over the heads) that its matmuls keep for the backward were missing
    from a 2-device plan's peak: 6 of its 252.9 MiB."""
    return held != seen


@dataclass
class MemoryEstimate:
    """Peak bytes per device, the step it occurs at, and what is live then, by kind."""

    peak_bytes: int
    peak_step: int
    steps: int
    breakdown: dict[str, int] = field(default_factory=dict)

    def as_peak(self) -> MemoryPeak:
        """The record a plan's estimate keeps (:class:`~autoparallel.results.MemoryPeak`)."""
        return MemoryPeak(self.peak_bytes, self.peak_step, self.steps, MemoryBreakdown(**self.breakdown))


@dataclass
class Saved:
    """A tensor ``saver`` keeps for its backward: the graph value ``value`` (the
    ``(node, output)`` that owns its storage) seen as the saver's input ``input_pos``
    (``None``: not through an input), or, when ``value`` is None, an op-internal tensor
    of ``nbytes`` global bytes and global shape ``shape`` (``differentiable``: floating and
    computed from inputs that need a gradient, so the saver's backward makes its gradient)."""

    saver: fx.Node
    value: tuple[fx.Node, int] | None
    input_pos: int | None
    nbytes: int
    shape: tuple[int, ...] = ()
    differentiable: bool = False


def _aligned_operand(shape: tuple[int, ...], operands: list[tuple]) -> tuple[int, list[tuple[int, ...]]] | None:
    """The first operand (index into ``operands``, global shapes) that a saved tensor of
    ``shape`` is derived from, and for each dim of the tensor the operand dims it is made of
    (``()``: its own, kept whole). Tried in order: an operand of the same shape; one of the
    same rank whose dims ``shape`` keeps or reduces to 1; one whose leading dims are ``shape``;
    one of the same rank and the same dim 0 (attention probabilities ``[B, H, S, S]`` of a query
    ``[B, H, S, D]``); one whose first two dims ``shape`` merges into its dim 0 (``[B·H, S, S]``,
    a math kernel's batched matmuls). A dim follows the operand's where their sizes agree.
    ``None`` for a 0-d tensor or when none fits."""
    if not shape:
        return None

    def same_place(op, offset=0):
        return [(i + offset,) if i + offset < len(op) and op[i + offset] == n else () for i, n in enumerate(shape)]

    rules = (
        lambda op: tuple(op) == shape and same_place(op),
        lambda op: len(op) == len(shape) and all(a in (b, 1) for a, b in zip(shape, op)) and same_place(op),
        lambda op: len(op) > len(shape) and tuple(op[:len(shape)]) == shape and same_place(op),
        lambda op: len(op) == len(shape) and op[0] == shape[0] and same_place(op),
        lambda op: len(op) == len(shape) + 1 and shape[0] == op[0] * op[1] and
        [(0, 1)] + same_place(op, 1)[1:],
    )
    for rule in rules:
        for k, op in enumerate(operands):
            follow = rule(op)
            if follow:
                return k, follow
    return None


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


def _saved_by_op(node: fx.Node, device: str, traced_on: str, memo: dict) -> list[tuple[str, int, int, tuple]]:
    """What ``node``'s op saves for backward, from running it alone on FakeTensors of
    ``device``, one entry per distinct storage: ``("input", j, 0, (), False)``, ``("output", i, 0,
    (), False)`` or ``("internal", -1, storage bytes, shape, differentiable)`` (floating and
    requiring a gradient where saved). Memoized per (op, input shapes, dtypes and grad flags,
    other arguments)."""
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
        memo[key] = [("input", j, 0, (), False) for j, g in enumerate(grads) if g]
        return memo[key]
    in_st = [fakes[li].untyped_storage()._cdata for li, _ in ins]
    out_st = [t.untyped_storage()._cdata for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    result, seen = [], set()
    for t in saved:
        st = t.untyped_storage()._cdata
        if st in seen:  # one storage saved twice (log_softmax's result by log_softmax and nll_loss)
            continue
        seen.add(st)
        if st in in_st:
            result.append(("input", in_st.index(st), 0, (), False))
        elif st in out_st:
            result.append(("output", out_st.index(st), 0, (), False))
        else:
            result.append(("internal", -1, t.untyped_storage().nbytes(), tuple(t.shape),
                           t.dtype.is_floating_point and t.requires_grad))
    memo[key] = result
    return result


def _kernels_device(device: str) -> str:
    """``device``, or ``"cpu"`` when this torch is built without its backend: FakeTensors of a
    device type torch was not built for can be made, but some ops on them (SDPA) abort the
    process in C++ ("not linked with support for cuda devices") instead of raising. Planning
    for GPUs on a CPU-only build then reads CPU kernels' saved tensors, with a warning: SDPA's
    flash kernel saves the logsumexp where CPU's math kernel saves the probabilities."""
    built = {"cuda": torch.backends.cuda.is_built, "mps": torch.backends.mps.is_built}.get(torch.device(device).type)
    if built is None or built():
        return device
    log.warning("memory model: this torch is built without %s; the tensors ops save for the backward are "
                "measured with CPU kernels (attention's as %s's fused kernels save them)", device, device)
    return "cpu"


_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _fused_attention_saved(node: fx.Node) -> list[tuple[str, int, int, tuple, bool]]:
    """What ``scaled_dot_product_attention`` saves for backward on a GPU, in
    :func:`_saved_by_op`'s entries: its tensor inputs (query, key, value, a mask), its output
    and the logsumexp, ``[B, H, S_q]`` in float32 (the flash and memory-efficient kernels' saved
    tensors, their random seed and offset aside: ``aten._scaled_dot_product_flash_attention``'s
    and ``_efficient_attention``'s outputs; Dao et al., FlashAttention, NeurIPS 2022, §3.1).
    Measured with a CPU build's kernels instead, a math kernel (dropout) saves the
    ``[B, H, S_q, S_k]`` probabilities: 16x more at S = 1024."""
    q_shape = node_info(tensor_inputs(node)[0][1]).outputs[0][0]
    lse = tuple(q_shape[:-1])
    return [("input", j, 0, (), False) for j in range(len(tensor_inputs(node)))] + \
        [("output", 0, 0, (), False), ("internal", -1, 4 * math.prod(lse), lse, False)]


def _recorded_saved(node: fx.Node, internal) -> list[tuple[str, int, int, tuple, bool]]:
    """:func:`_saved_by_op`'s entries for an op whose record lists what its per-device form
    saves (``OpRecord.saved``): its floating inputs that need a gradient, and ``internal``
    (``(global shape, dtype)`` pairs)."""
    ins = [("input", j, 0, (), False) for j, (_, x) in enumerate(tensor_inputs(node))
           if node_info(x).requires_grad and x.meta["val"].dtype.is_floating_point]
    return ins + [("internal", -1, math.prod(shape) * dtype.itemsize, shape, dtype.is_floating_point)
                  for shape, dtype in internal]


def saved_tensors(gm: fx.GraphModule, aliases, device: str = "cpu", traced_on: str = "meta") -> list[Saved]:
    """What every node saves for backward (global sizes), in graph order.

    Each distinct op signature runs once, alone, on FakeTensors of ``device`` (CPU's where this
    torch lacks its backend: :func:`_kernels_device`, attention then counted as the GPU's fused
    kernels save it, :func:`_fused_attention_saved`) under
    ``torch.autograd.graph.saved_tensors_hooks`` (nothing is allocated; repeated layers
    cost nothing more). Saved inputs and outputs are mapped to the graph value that owns
    their storage (:func:`storage_owner`). Nodes without tensor outputs (``aten.item``: a
    Python number) save nothing: autograd does not differentiate through them.
    """
    kernels = _kernels_device(device)
    memo: dict = {}
    records = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node in aliases or not node_info(node).outputs:
            continue  # a node without tensor outputs (.item()) has no backward: it saves nothing
        ins = tensor_inputs(node)
        fused = node.target is _SDPA and kernels != device and any(node_info(x).requires_grad for _, x in ins)
        record = record_of(node.target)
        if record is not None and record.saved is not None:
            entries = _recorded_saved(node, record.saved(node))
        elif fused:
            entries = _fused_attention_saved(node)
        else:
            entries = _saved_by_op(node, kernels, traced_on, memo)
        for kind, j, nbytes, shape, differentiable in entries:
            if kind == "input":
                records.append(Saved(node, storage_owner(ins[j][1], aliases), j, 0))
            elif kind == "output":
                owner = storage_owner(node, aliases) if j == 0 else (node, j)
                records.append(Saved(node, owner, None, 0))
            else:
                records.append(Saved(node, None, None, nbytes, shape, differentiable))
    return records


class MemoryModel:
    """The items of one training step of a captured graph (see the module docstring).

    Args:
        gm: the annotated captured graph.
        aliases: getitem node → (producer, output index) (from the strategy generator).
        mesh_shape: devices per mesh axis.
        optimizer: a key of :data:`OPTIMIZER_STATES` (default AdamW).
        optimizer_impl: ``"for-loop"`` or ``"foreach"``: whether the step's temporaries
            (:data:`FOREACH_TEMPORARIES`) are counted.
        device: the device type the module will run on (selects kernels, e.g. SDPA's).
        traced_on: the device type the graph was captured on.
        outputs / whole_outputs: how the module returns the graph's outputs, as
            :class:`~autoparallel.solver.planner.Planner` takes them.
        inputs: how the caller passes the batch (``PlanOptions.inputs``): ``"global"``, the
            whole batch on every device; ``"local"``, each device its piece.
        cost_model: the planner's :class:`~autoparallel.solver.costs.CostModel`: an op's
            ``OpRecord.load`` under it sizes the busiest device's saved tensors (routed experts
            under ``expert_imbalance``); ``None``: every op's work divides evenly.
        layout: the planner's redistribution paths (a
            :class:`~autoparallel.solver.layout.Redistributor` of its bound cost model): the
            gradient of a redistributed activation is sized at every layout its backward passes
            through; ``None``: at the consumer's layout only.

    Raises:
        ValueError: for an unknown optimizer.
    """

    def __init__(self, gm: fx.GraphModule, aliases, mesh_shape, *, optimizer: str = DEFAULT_OPTIMIZER,
                 optimizer_impl: str = "for-loop", device: str = "cpu", traced_on: str = "meta", outputs: str = "replicated",
                 whole_outputs: frozenset[int] = frozenset(), cost_model=None, layout=None, inputs: str = "global"):
        if optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {sorted(OPTIMIZER_STATES)}")
        self.mesh_shape = tuple(mesh_shape)
        self.cost_model, self.layout = cost_model, layout
        self.copies_offloaded = not (cost_model is not None and cost_model.host_is_device)
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
                size = _on_device(out_size(u, i))
                state = self._state_size(u, size)
                held = (lambda s, f=size, g=state: f(s) + (g(s) if s.zero else 0))  # a ZeRO shard beside the whole
                items.append(Item("parameters", u, 0, back, held))
                if info.requires_grad:  # under ZeRO-2 the shard's gradient alone
                    grad = (lambda s, f=held, g=state: g(s) if s.zero_grad else f(s))
                    items.append(Item("gradients", u, back - end, back, grad))
                    first = min((step[c] for c in u.users if c in step), default=None)
                    if first is not None:
                        items.append(Item("buffers", u, back - first, back - first, self._bucket_size(size)))
                    k = OPTIMIZER_STATES[optimizer]
                    if k:
                        items.append(Item("optimizer", u, 0, back, lambda s, f=state, k=k: k * f(s)))
                    t = FOREACH_TEMPORARIES[optimizer] if optimizer_impl == "foreach" else 0
                    if t:  # after the backward: at its last step, with every gradient
                        items.append(Item("temporaries", u, back, back, lambda s, f=state, t=t: t * f(s)))
                continue
            if u.op == "placeholder":  # the caller's batch, held through the step
                shape, dtype = info.outputs[i]
                whole = math.prod(shape) * dtype.itemsize if inputs == "global" else None
                items.append(Item("inputs", u, 0, back, out_size(u, i) if whole is None else lambda s, b=whole: b))
            else:
                items.append(Item("temporaries", u, step[u], end, out_size(u, i), forward_value=True))
            if info.requires_grad and info.outputs[i][1].is_floating_point:
                items.append(Item("temporaries", u, back - end, back - step[u], out_size(u, i)))
        first_saver: dict = {}
        for rec in saved:
            key = rec.value if rec.value is not None else id(rec)
            if key not in first_saver or step[rec.saver] < step[first_saver[key].saver]:
                first_saver[key] = rec
        for rec in saved:
            n = rec.saver
            start, end = step[n], back - step[n]
            if rec.value is None:
                size = rewrites.saved_size(n, None, rec.shape, self._internal_size(n, rec.nbytes, rec.shape))
                items.append(Item("activations", n, start, end, size))
                if rec.differentiable and node_info(n).requires_grad:  # its gradient, inside the op's backward
                    items.append(Item("temporaries", n, end, end, rewrites.gradient_size(n, size)))
                continue
            u, i = rec.value
            x = tensor_inputs(n)[rec.input_pos][1] if rec.input_pos is not None else None
            if u.op == "get_attr":  # the parameter itself; its gathered copy when the saver sees one
                if x is not None:
                    items += self._gathered_items(n, aliases.get(x, (x, 0)), u, rec.input_pos, start, end)
                continue
            if first_saver[rec.value] is not rec:  # saved already; a copy when read in another layout
                if x is not None:
                    items.append(self._copy_item(n, x, aliases.get(x, (x, 0)), rec.input_pos, start, end))
                continue
            if x is not None:
                shape, dtype = node_info(x).outputs[0]
                size = lambda s, sh=shape, dt=dtype, j=rec.input_pos: _local_bytes(sh, dt, s.inputs[j], self.mesh_shape)
                if u.op == "placeholder":  # the caller's batch (an ``inputs`` item) unless redistributed
                    size = self._unless_caller_view(size, rec.input_pos, inputs)
                items.append(Item("activations", n, start, end, rewrites.saved_size(n, x, shape, size), value=u))
            else:
                items.append(Item("activations", u, start, end, out_size(u, i), value=u))
        items += self._consumer_gradient_items(aliases, step, back)
        items += self._returned_items(gm, aliases, outputs, whole_outputs)
        self.items = items

    def _unless_caller_view(self, size: Callable[[Strategy], int], j: int, inputs: str) -> Callable[[Strategy], int]:
        """``size`` of a consumer's input ``j`` that is the caller's batch, or 0 where the spec
        it reads is a view of what the caller passes: under ``inputs="global"`` the whole batch,
        of which any split along dim 0 only is a slice; under ``"local"`` this device's piece,
        read in its own spec."""
        held = local_input_spec(self.mesh_shape) if inputs == "local" else None

        def unless_view(s: Strategy) -> int:
            spec = tuple(s.inputs[j])
            view = spec == tuple(held) if held is not None else all(p == R or p == Shard(0) for p in spec)
            return 0 if view else size(s)

        return unless_view

    def _state_size(self, param: fx.Node, size: Callable[[Strategy], int]) -> Callable[[Strategy], int]:
        """Bytes of one optimizer state of ``param`` (``size``: the parameter's device bytes):
        its ZeRO shard's under a strategy that shards the states (:mod:`autoparallel.strategies.zero`)."""
        shape, dtype = node_info(param).outputs[0]

        def state(s):
            if not s.zero:
                return size(s)
            return _local_bytes(shape, dtype, state_spec_of(param, s, self.mesh_shape), self.mesh_shape)

        return state

    def _bucket_size(self, size: Callable[[Strategy], int]) -> Callable[[Strategy], int]:
        """Bytes the gradient all-reduce of a parameter replicated along a mesh axis allocates
        when its bucket launches (:mod:`autoparallel.runtime_kernels.grad_reduction`): the flat
        buffer its gradients are copied into and the all-reduce's result, each the size of the
        gradient (which the result then holds: the ``gradients`` item)."""
        def bucket(s):
            replicated = any(p == R and n > 1 for p, n in zip(s.outputs[0], self.mesh_shape))
            return 2 * size(s) if replicated else 0

        return bucket

    def _gathered_items(self, saver: fx.Node, source: tuple[fx.Node, int], param: fx.Node, j: int, start: int,
                        end: int) -> list[Item]:
        """Parameter ``param``, or a view of it (``source``, node and output index: a part of a
        fused weight), that ``saver`` takes as input ``j`` in a layout it is not held in (FSDP's
        all-gathered weight), or, offloaded to host memory, in any layout where host memory is
        not the device's: autograd keeps that copy from the saver's forward to its backward
        (kind ``gathered``), and the saver's backward makes its gradient in that layout before
        it is reduced to the parameter's (one step, kind ``gathered``)."""
        shape, dtype = node_info(source[0]).outputs[source[1]]

        def size(s):
            return _local_bytes(shape, dtype, s.inputs[j], self.mesh_shape)

        offloaded = param if self.copies_offloaded else None
        items = [Item("gathered", saver, start, end, size, source=source, input_pos=j, offloaded=offloaded)]
        if node_info(source[0]).requires_grad:
            items.append(Item("gathered", saver, end, end, size, source=source, input_pos=j, offloaded=offloaded))
        return items

    def _copy_item(self, saver: fx.Node, x: fx.Node, source: tuple[fx.Node, int], j: int, start: int,
                   end: int) -> Item:
        """A value another op saves too, that ``saver`` takes as input ``j`` (``x``; ``source``,
        the node and output index holding it: the value or a view of it) in another layout (a
        row-parallel matmul's input all-gathered from the attention's output split by batch):
        autograd keeps that redistributed copy from the saver's forward to its backward; none
        when ``saver`` reads the layout held."""
        shape, dtype = node_info(source[0]).outputs[source[1]]

        def size(s):
            return _local_bytes(shape, dtype, s.inputs[j], self.mesh_shape)

        return Item("activations", saver, start, end, rewrites.saved_size(saver, x, shape, size), source=source,
                    input_pos=j)

    def _consumer_gradient_items(self, aliases, step: dict[fx.Node, int], back: int) -> list[Item]:
        """The gradient of an activation on its way back from the layout a consumer takes it in
        to its producer's, at the consumer's backward step, where the two differ: each move of
        the redistribution between them, run backward (an all-reduce's, a reduce-scatter's, a
        slice's zero padding), writes a new tensor while its input is held, so besides the
        gradient in the producer's layout (the value's ``temporaries`` item) the largest layout
        on the way is live (parameters: :meth:`_gathered_items`). The way is ``layout``'s
        cheapest path, the one the plan emits; without ``layout``, the consumer's layout."""
        items = []
        for n in self.nodes:
            if n.op != "call_function" or n in aliases or not node_info(n).requires_grad:
                continue
            for j, (_, x) in enumerate(tensor_inputs(n)):
                u, i = aliases.get(x, (x, 0))
                shape, dtype = node_info(u).outputs[i]
                if u.op == "get_attr" or not node_info(u).requires_grad or not dtype.is_floating_point:
                    continue

                def size(s, shape=shape, dtype=dtype, j=j):
                    return _local_bytes(shape, dtype, s.inputs[j], self.mesh_shape)

                t = back - step[n]
                items.append(Item("temporaries", n, t, t, size, producer=(u, i), input_pos=j,
                                  passing=self._largest_on_the_way(shape, dtype)))
        return items

    def _largest_on_the_way(self, shape, dtype: torch.dtype) -> Callable[[Spec, Spec], int]:
        """``(held, seen) ->`` the bytes of the largest layout after the first on the cheapest
        redistribution from ``held`` to ``seen`` (:class:`~autoparallel.solver.layout.Redistributor`),
        the tensor being ``shape`` of ``dtype``; the bytes at ``seen`` without a ``layout``."""
        def largest(held: Spec, seen: Spec) -> int:
            if self.layout is None:
                return _local_bytes(shape, dtype, seen, self.mesh_shape)
            _, moves = self.layout.redistribute(shape, dtype.itemsize, True, held, seen, True)
            specs = list(itertools.accumulate(moves, lambda spec, m: m.applied_to(spec), initial=held))[1:] or [seen]
            return max(_local_bytes(shape, dtype, spec, self.mesh_shape) for spec in specs)

        return largest

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

    def _internal_size(self, node: fx.Node, nbytes: int, shape: tuple[int, ...]) -> Callable[[Strategy], int]:
        """Per-device bytes of a tensor of global ``shape`` (``nbytes`` bytes) that ``node``
        saves and that is none of its inputs or outputs: split as the operand it is derived
        from (:func:`_aligned_operand`): LayerNorm's mean and rstd as its input, SDPA's
        logsumexp as the query, cross-entropy's log-softmax as the logits."""
        record = record_of(node.target)
        if record is not None and record.saved is not None:  # divided as the op's work, the busiest device's
            if record.load is None or self.cost_model is None:
                return lambda s: int(nbytes / s.split)
            return lambda s: int(nbytes / s.split * record.load(node, s, self.mesh_shape, self.cost_model))
        operands = [(node_info(x).outputs[0][0], "inputs", j) for j, (_, x) in enumerate(tensor_inputs(node))]
        operands += [(sh, "outputs", i) for i, (sh, _) in enumerate(node_info(node).outputs)]
        found = _aligned_operand(shape, [sh for sh, _, _ in operands])
        if found is None:  # not derived from one operand: a scalar or a workspace, kept whole
            return lambda s: nbytes
        k, follow = found
        op_shape, side, j = operands[k]
        dims = [d for ds in follow for d in ds]
        whole = max(1, math.prod(op_shape[d] for d in dims))

        def size(s):
            local = local_shape(op_shape, getattr(s, side)[j], self.mesh_shape)
            return nbytes * math.prod(local[d] for d in dims) // whole

        return size

    def timeline(self, choice: dict[fx.Node, Strategy]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Bytes live at every step under ``choice`` (node → strategy), in total and by kind."""
        by_kind = {k: np.zeros(self.steps + 1, dtype=np.int64) for k in KINDS}
        for it in self.items:
            b = it.bytes(choice)
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

    def dominant(self, choice: dict[fx.Node, Strategy], top: int = 3) -> str:
        """What dominates the peak under ``choice``, for error messages: the largest kind at the
        peak step and the ``top`` largest tensors live there (node, kind, bytes)."""
        est = self.estimate(choice)
        t = est.peak_step
        kind, kb = max(est.breakdown.items(), key=lambda kv: kv[1])
        live = sorted(((it.bytes(choice), it.owner.name, it.kind) for it in self.items if it.start <= t <= it.end),
                      key=lambda x: -x[0])[:top]
        step = f"forward of {self.nodes[t].name}" if t < len(self.nodes) else f"backward of {self.nodes[self.steps - 1 - t].name}"
        return (f"its peak ({units.nbytes(est.peak_bytes)}, at the {step}) is mostly {kind} ({units.nbytes(kb)}); "
                f"largest tensors: " + ", ".join(f"{name} ({k}, {units.nbytes(b)})" for b, name, k in live))

    def row(self, t: int) -> list[tuple[fx.Node, Callable[[Strategy], int]]]:
        """The memory at step ``t`` as ``(node, size function)`` terms, each linear in one
        node's strategy choice: the items live at ``t`` (:meth:`Item.linear`; a lower bound
        of :meth:`timeline`'s value where a gathered parameter is live)."""
        return [term for it in self.items if it.start <= t <= it.end for term in it.linear(self._held_bytes)]

    def _held_bytes(self, source: tuple[fx.Node, int]) -> Callable[[Strategy], int]:
        """The bytes of ``source`` (node, output index) held under a strategy that
        :meth:`Item.linear` subtracts: on the device (0 offloaded) where an offloaded parameter
        is copied onto it; where it is not (host memory is the device's), its shard, which a
        reader in the parameter's own layout reads in place."""
        node, k = source
        shape, dtype = node_info(node).outputs[k]

        def held(s):
            return _local_bytes(shape, dtype, s.outputs[k], self.mesh_shape)

        return _on_device(held) if self.copies_offloaded else held
