"""Make the PyPI torchvision wheel importable next to a CPU-only torch.

The torchvision 0.28.0 wheel on PyPI (the only version that matches torch 2.13.0) is a CUDA
build: its ``_C`` extension links ``libtorch_cuda.so``, ``libc10_cuda.so`` and
``libcudart.so``, which a CPU torch lacks. torchvision swallows the failure to load the
extension, but ``torchvision/_meta_registrations.py`` then calls
``torch.library.register_fake("torchvision::nms")`` unguarded, and ``import torchvision``
raises::

    RuntimeError: operator torchvision::nms does not exist

So does ``import timm``, and so do transformers' model classes once torchvision is installed
(``transformers.image_utils`` imports it when present), e.g.
``from transformers import GPT2LMHeadModel`` fails with ``ModuleNotFoundError: Could not
import module 'GPT2LMHeadModel'. Are this object's requirements defined correctly?``

:func:`install` defines the two schemas ``torchvision::nms`` and ``torchvision::qnms`` so
that these registrations succeed. torchvision's C++ ops (nms, roi_align, deform_conv2d,
image decoding) stay unavailable and say so when called; classification models do not
need them. It is called when ``autoparallel`` is imported, before anything imports
transformers or torchvision.
"""

import importlib.machinery
import importlib.util
import os
import sys

import torch

_lib = None  # the Library holding the schemas: the definitions live as long as it does


def _extension_loads(package_dir: str) -> bool:
    """Whether torchvision's ``_C`` extension loads, tried the way torchvision itself loads
    it (``torchvision/extension.py``). A failed attempt costs a failed ``dlopen``; a
    successful one registers the real ops, as importing torchvision would."""
    finder = importlib.machinery.FileFinder(
        package_dir, (importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES))
    spec = finder.find_spec("_C")
    if spec is None or not spec.origin:
        return False
    try:
        torch.ops.load_library(spec.origin)
    except (ImportError, OSError):
        return False
    return True


def _has_nms() -> bool:
    try:
        return hasattr(torch.ops.torchvision, "nms")
    except Exception:  # noqa: BLE001 - any failure to look the op up means it is not there
        return False


def install() -> bool:
    """Define ``torchvision::nms`` and ``torchvision::qnms`` if and only if torchvision is
    installed, not yet imported, torch has no CUDA, the schemas are not defined yet and
    torchvision's extension cannot load (a working extension defines them itself, and
    defining them twice raises). Idempotent. Returns whether the schemas are now defined by
    this module."""
    global _lib
    if _lib is not None:
        return True
    if torch.version.cuda is not None or "torchvision" in sys.modules:
        return False
    try:
        spec = importlib.util.find_spec("torchvision")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    if _has_nms():
        return False
    package_dir = os.fspath(next(iter(spec.submodule_search_locations)))
    if _extension_loads(package_dir):
        return False
    lib = torch.library.Library("torchvision", "FRAGMENT")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _lib = lib
    return True
