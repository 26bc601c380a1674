"""On-disk plan cache: a solved Plan stored as JSON, keyed by what determines it.

The key hashes the captured graph (its code, every node's output shapes and dtypes, and the
parameter names), the mesh (shape, alpha, beta), the cost model (class and device preset),
the planning options, and the versions of autoparallel and torch. The second
``autoparallelize``/``plan`` of the same model on the same mesh loads the plan instead of
solving.

Location: the ``cache_dir=`` argument, else the ``AUTOPARALLEL_CACHE_DIR`` environment
variable, else ``~/.cache/autoparallel``; ``cache_dir=False`` turns caching off. A cost
model is identified by :meth:`CostModel.key` (class and device preset): a subclass with
parameters of its own should add them there; clear the cache (delete the folder) after
changing a cost model's code.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from .plan import Plan

log = logging.getLogger(__name__)
VERSION = "0.2.0"


def cache_path(cache_dir) -> Path | None:
    """The folder to use, or ``None`` when caching is off."""
    if cache_dir is False:
        return None
    if cache_dir is None:
        cache_dir = os.environ.get("AUTOPARALLEL_CACHE_DIR") or Path.home() / ".cache" / "autoparallel"
    return Path(cache_dir)


def plan_key(traced, mesh, cost_model, options: dict) -> str:
    """Hex digest identifying a planning problem (see module docstring)."""
    h = hashlib.sha256()
    h.update(traced.gm.code.encode())
    for node in traced.gm.graph.nodes:
        info = node.meta.get("autoparallel")
        h.update(repr((node.name, info.outputs if info else None)).encode())
    h.update(json.dumps({"params": traced.params, "buffers": traced.buffers}, sort_keys=True).encode())
    h.update(json.dumps(mesh.to_json(), sort_keys=True).encode())
    h.update(cost_model.key().encode())
    h.update(json.dumps(options, sort_keys=True, default=str).encode())
    h.update(f"{VERSION}:{torch.__version__}".encode())
    return h.hexdigest()


def load(folder: Path | None, key: str) -> Plan | None:
    """The cached plan for ``key``, or ``None``."""
    if folder is None:
        return None
    path = folder / f"{key}.json"
    if not path.exists():
        return None
    try:
        plan = Plan.from_json(path.read_text())
    except (ValueError, KeyError, TypeError) as e:  # a corrupt or older file: solve again
        log.warning("ignoring unreadable cached plan %s (%s)", path, e)
        return None
    log.info("loaded the plan from the cache: %s", path)
    return plan


def store(folder: Path | None, key: str, plan: Plan) -> None:
    """Write ``plan`` for ``key`` (atomically: a temporary file renamed into place)."""
    if folder is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{key}.{os.getpid()}.tmp"
    tmp.write_text(plan.to_json())
    os.replace(tmp, folder / f"{key}.json")
