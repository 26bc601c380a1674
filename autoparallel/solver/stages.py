"""Pipeline stages: which mesh axis carries them, where the layers are cut, how many
microbatches and which schedule (:class:`~autoparallel.pipeline_plan.PipelinePlan`), each
stage planned on its submesh by :func:`~autoparallel.solver.pipeline.plan_traced`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from ..errors import AutoParallelError
from ..mesh import MeshSpec
from ..options import PlanOptions
from ..pipeline_plan import MULTI_STAGE, PipelinePlan, submesh
from ..plan import Plan
from .pipeline import plan_traced

PP_AXIS = "pp"
"""The mesh axis name that always carries pipeline stages."""


def pipeline_axis(mesh: MeshSpec, options: PlanOptions) -> int | None:
    """The mesh axis that carries stages when it is pinned: the one named :data:`PP_AXIS`;
    ``None`` when none is (the search decides under ``pipeline="auto"``)."""
    return mesh.axis_names.index(PP_AXIS) if PP_AXIS in mesh.axis_names else None


def plan_stages(capture_at: Callable[[int], object], mesh: MeshSpec, options: PlanOptions, *, layers: str,
                num_layers: int, batch: int) -> Plan:
    """The pipelined plan of a model whose repeated layers are the ``num_layers`` layers of the
    ``ModuleList`` at ``layers``, over the mesh axis named ``"pp"``.

    Args:
        capture_at: microbatches ``m`` → the model captured for one microbatch (the global
            batch's dim 0 divided by ``m``).
        batch: the global batch's dim 0.

    Raises:
        AutoParallelError: no axis named ``"pp"``, more stages than layers, or a batch the
            microbatches do not divide.
    """
    axis = pipeline_axis(mesh, options)
    if axis is None:
        raise AutoParallelError("pipeline stages need a mesh axis named 'pp'")
    pp = mesh.shape[axis]
    schedule = options.schedule or "1F1B"
    stages = pp * (2 if schedule in MULTI_STAGE else 1)
    if stages > num_layers:
        raise AutoParallelError(f"{stages} pipeline stages need as many layers, but {layers} has {num_layers}")
    micro = options.microbatches or pp
    if batch % micro:
        raise AutoParallelError(f"the batch of {batch} does not split into {micro} microbatches")
    boundaries = tuple(round(s * num_layers / stages) for s in range(stages + 1))
    inner = plan_traced(capture_at(micro), submesh(mesh, axis), replace(options, pipeline="off"))
    inner.pipeline = PipelinePlan(mesh, axis, layers, boundaries, micro, schedule)
    return inner
