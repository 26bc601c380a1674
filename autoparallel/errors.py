"""Errors raised by autoparallel. Each names the node, op and module path involved."""


class AutoParallelError(Exception):
    """Base class of every error autoparallel raises on purpose."""


class CaptureError(AutoParallelError):
    """torch.export could not capture the model; carries export's reason and the user's line."""


class ShardingRuleError(AutoParallelError):
    """An op has no sharding rule (under ``strict=True``) or a rule failed on a node."""


class InfeasiblePlanError(AutoParallelError):
    """The sharding ILP has no solution; the message says which constraint made it so."""


class InputMismatchError(AutoParallelError):
    """Runtime inputs differ in structure, shape or dtype from the ones the plan was made for."""


class MeshMismatchError(AutoParallelError):
    """The device mesh does not match the process group or the plan."""


class PlanMismatchError(AutoParallelError):
    """A plan does not fit the graph it is applied to: made for another model, other input
    shapes or another mesh, or edited. The message names the first mismatch (node, field,
    what the graph needs and what the plan holds) and how to get a plan that fits."""
