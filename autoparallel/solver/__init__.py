"""Cost model, redistribution and the sharding ILP. The planner that ties them to a
graph is :mod:`autoparallel.solver.planner`: pricing (:mod:`.pricing`), the ILP
(:mod:`.problem`), the memory search (:mod:`.memory_search`) and decoding (:mod:`.decode`)."""

from .costs import PRESETS, CostModel, DevicePreset
from .ilp import ILPEdge, ILPProblem, ILPSolution, solve
from .layout import Redistributor, Move

__all__ = ["PRESETS", "CostModel", "DevicePreset", "ILPEdge", "ILPProblem", "ILPSolution", "solve",
           "Redistributor", "Move"]
