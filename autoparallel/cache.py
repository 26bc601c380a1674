"""On-disk plan cache: a solved Plan stored as JSON, keyed by what determines it.

The key hashes the captured graph (its code, every node's output shapes and dtypes, and the
parameter names), the mesh (shape, alpha, beta), the cost model (class, device preset, and
a measured profile's key and numbers), the planning options, a digest of autoparallel's own
sources (:func:`source_digest`) and torch's version. The second
``autoparallelize``/``plan`` of the same model on the same mesh loads the plan instead of
solving.

A plan read from the cache is validated against the captured graph before it is used
(:func:`autoparallel.validate.validate_plan`); a file that does not fit is ignored with a
warning and replaced. Writing is best effort: a plan that cannot be stored is logged and
used.

Location: the ``cache_dir=`` argument, else the ``AUTOPARALLEL_CACHE_DIR`` environment
variable, else ``~/.cache/autoparallel``; ``cache_dir=False`` turns caching off. Measured mesh
and device profiles (:mod:`autoparallel.profile`) live in its ``profiles/`` subfolder. A cost
model is identified by :meth:`CostModel.key` (class, device preset, profile): a subclass with
parameters of its own should add them there; clear the cache (delete the folder) after
changing the code of a cost model defined outside this package.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from .errors import PlanMismatchError
from .mesh import MeshSpec
from .plan import Plan
from .validate import validate_plan

log = logging.getLogger(__name__)


@functools.cache
def source_digest() -> str:
    """Hex digest of this package's Python sources (every ``.py`` file under it, by relative
    path and content), read once per process: in the plan key, so that a plan cached by other
    planner code (another cost or memory model) is not found and its stale estimate not read
    back. It replaces a version string bumped by hand, which a change could forget (one did:
    a memory-model fix reported the cached plan's old peak)."""
    h = hashlib.sha256()
    root = Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def cache_path(cache_dir) -> Path | None:
    """The folder to use, or ``None`` when caching is off (also when no home folder is known
    for the default location: logged as a warning)."""
    if cache_dir is False:
        return None
    if cache_dir is None:
        cache_dir = os.environ.get("AUTOPARALLEL_CACHE_DIR")
        if not cache_dir:
            try:
                cache_dir = Path.home() / ".cache" / "autoparallel"
            except RuntimeError as e:
                log.warning("plan cache off: no home folder for ~/.cache/autoparallel (%s); set "
                            "AUTOPARALLEL_CACHE_DIR or pass cache_dir=", e)
                return None
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
    h.update(f"{source_digest()}:{torch.__version__}".encode())
    return h.hexdigest()


def load(folder: Path | None, key: str, traced, mesh: MeshSpec) -> Plan | None:
    """The cached plan for ``key``, or ``None``: when there is none, and when the file cannot
    be read, is not a plan, or does not fit ``traced`` on ``mesh``
    (:func:`~autoparallel.validate.validate_plan`, and the same mesh, alpha and beta
    included): such a file is stale, foreign or edited; it is ignored with a warning, and
    the caller's new plan overwrites it."""
    if folder is None:
        return None
    path = folder / f"{key}.json"
    text = read_text(path, "plan")
    if text is None:
        return None
    try:
        plan = Plan.from_json(text)
        if plan.mesh != mesh:
            raise PlanMismatchError(f"the plan is for mesh {plan.mesh}, not {mesh}")
        validate_plan(plan, traced)
    except (ValueError, PlanMismatchError) as e:
        log.warning("ignoring cached plan %s, it does not fit this model and mesh (%s); planning again", path, e)
        return None
    log.info("loaded the plan from the cache: %s", path)
    return plan


def store(folder: Path | None, key: str, plan: Plan) -> None:
    """Write ``plan`` for ``key`` (atomically: a temporary file renamed into place). A failed
    write (read-only or missing folder, a file in the folder's place, a full disk) is logged
    as a warning and leaves the plan uncached."""
    if folder is not None:
        write_text(folder / f"{key}.json", plan.to_json(), "plan")


def write_text(path: Path, text: str, what: str) -> bool:
    """Write ``text`` to ``path`` atomically (a temporary file renamed into place), creating
    the folder. Best effort: a failure (read-only or missing folder, a file in the folder's
    place, a full disk) is logged as a warning naming ``what`` was not cached, and returns False."""
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, path)
        return True
    except OSError as e:
        log.warning("could not write the %s cache in %s (%s); the %s is used but not cached (pass cache_dir= a "
                    "writable folder, or cache_dir=False)", what, path.parent, e, what)
        with contextlib.suppress(OSError):  # where the folder is not one, there is no file to remove
            tmp.unlink(missing_ok=True)
        return False


def read_text(path: Path, what: str) -> str | None:
    """The text of ``path``, or ``None`` when there is none, or when it cannot be read (logged
    as a warning naming ``what``)."""
    try:
        return path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as e:  # not a readable file (a folder, no permission), not text
        log.warning("ignoring unreadable cached %s %s (%s); measuring or planning again", what, path, e)
        return None


def profile_path(folder: Path | None, name: str) -> Path | None:
    """Where the measured profile ``name`` (``mesh-<key>`` or ``device-<key>``, see
    :mod:`autoparallel.profile`) is cached: ``<folder>/profiles/<name>.json``; ``None`` when
    caching is off."""
    return None if folder is None else folder / "profiles" / f"{name}.json"
