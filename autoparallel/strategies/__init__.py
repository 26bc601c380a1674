"""Strategy generation: which shardings each op of the graph admits.

Every op's knowledge lives in its record (:mod:`.records`); the modules imported here
register them: :mod:`.rules` (pointwise, shape, reduction, matmul and NN ops),
:mod:`.losses`, :mod:`.einsum`, :mod:`.recurrent`, :mod:`.moe` (mixture-of-experts routing).
"""

from . import einsum, losses, moe, recurrent, rules  # noqa: F401  (they register the records)
from .engine import DimMap, Strategy, enumerate_strategies
from .generator import StrategyGenerator
from .records import RECORDS, LocalCall, OpRecord, record, record_of

__all__ = ["DimMap", "Strategy", "enumerate_strategies", "StrategyGenerator", "RECORDS", "LocalCall",
           "OpRecord", "record", "record_of"]
