"""Why the parallel module is not pickled, and what to save instead.

A :class:`~autoparallel.codegen.module.ParallelModule` runs per-device graphs whose
collectives name this run's process groups (c10d group names, bound when the mesh was made),
so neither the module nor its graph modules can be written by ``torch.save`` / ``pickle`` and
read in another process: process groups are not picklable by design. What is worth keeping
is picklable: the weights (``pmodel.state_dict()``: DTensors, or plain tensors) and the plan
(``pmodel.plan.to_json()``), from which ``autoparallelize(..., plan=...)`` builds the module
again on a new mesh without planning. ``copy.deepcopy`` stays possible: the copy lives in the
same process and shares its process groups.
"""

from __future__ import annotations

import copy

import torch.fx as fx


def save_instead(what: str) -> str:
    """The message of the ``TypeError`` pickling ``what`` raises: why, and what to save."""
    return (f"{what} cannot be pickled (torch.save, pickle.dumps): its per-device graphs call collectives on "
            "this process's process groups, which do not survive pickling. Save the weights instead: "
            "torch.save(pmodel.state_dict(), path), loaded back with pmodel.load_state_dict(torch.load(path)), "
            "or torch.distributed.checkpoint.save(pmodel.state_dict(), checkpoint_id=folder) for a sharded "
            "checkpoint; and the plan, pmodel.plan.to_json(), which autoparallelize(model, meta_inputs, "
            "device_mesh=mesh, plan=text) runs again without planning. copy.deepcopy(pmodel) works in this process.")


class NotPicklable:
    """Mixin: pickling the object raises ``TypeError`` (:func:`save_instead`); ``copy.deepcopy``
    copies it as Python's default would (a new instance, its ``__dict__`` deep-copied, then
    ``__setstate__``), unless a class before this one in the MRO defines ``__deepcopy__``.
    ``unpicklable_what`` names the object in the message."""

    unpicklable_what = "autoparallel's ParallelModule"

    def __reduce_ex__(self, protocol):
        raise TypeError(save_instead(self.unpicklable_what))

    def __deepcopy__(self, memo):
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        state = copy.deepcopy(self.__dict__, memo)
        if hasattr(new, "__setstate__"):
            new.__setstate__(state)
        else:
            new.__dict__.update(state)
        return new


class ParallelGraph(fx.GraphModule, NotPicklable):
    """The per-device graph module of a parallel module: an ``fx.GraphModule`` that refuses
    pickling (:class:`NotPicklable`; fx would pickle its generated code, whose collectives
    name this process's groups) and deep-copies as a graph module."""

    unpicklable_what = "a graph module of autoparallel's ParallelModule"
