"""autoparallel: automatic parallelization of PyTorch training over a device mesh.

``autoparallelize(model, meta_inputs, device_mesh=mesh)`` returns a module that trains on
every device of the mesh and computes what the single-device model computes;
``plan(model, meta_inputs, mesh_shape=...)`` runs the same search with no devices;
``profile_mesh(device_mesh)`` measures the costs of a real mesh.
"""

from ._torchvision_compat import install as _install_torchvision_compat  # isort: skip

_install_torchvision_compat()  # first: lets a CUDA torchvision wheel import on CPU torch (see the module)

from .api import autoparallelize, compare, coverage, plan
from .codegen import ParallelModule
from .config import Config, ConfigError
from .constraints import ConstraintError
from .errors import (AutoParallelError, CaptureError, InfeasiblePlanError, InputMismatchError,
                     MeshMismatchError, PlanMismatchError, ShardingRuleError)
from .mesh import MeshSpec
from .options import PlanOptions
from .plan import Plan
from .profile import calibrate_device, profile_mesh
from .solver import CostModel, DevicePreset
from .solver.costs import CollectiveTable, CommProfile
from .validate import validate_plan

__all__ = ["autoparallelize", "plan", "coverage", "compare", "Plan", "PlanOptions", "Config", "ConfigError", "MeshSpec", "CostModel", "DevicePreset", "ParallelModule",
           "profile_mesh", "calibrate_device", "CommProfile", "CollectiveTable",
           "AutoParallelError", "CaptureError", "InfeasiblePlanError", "InputMismatchError",
           "MeshMismatchError", "PlanMismatchError", "ShardingRuleError", "validate_plan", "ConstraintError"]
