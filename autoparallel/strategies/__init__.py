"""Strategy generation: which shardings each op of the graph admits."""

from .engine import DimMap, Strategy, enumerate_strategies
from .generator import StrategyGenerator
from .rules import RULES

__all__ = ["DimMap", "Strategy", "enumerate_strategies", "StrategyGenerator", "RULES"]
