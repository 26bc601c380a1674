from autoparallel._torchvision_compat import install as _install_torchvision_compat

_install_torchvision_compat()  # before any test imports torchvision, timm or transformers models

import os
import warnings

import pytest
import torch.distributed as dist

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True, scope="session")
def _plan_cache_in_tmp(tmp_path_factory):
    """Plans cached by the tests go to a fresh folder, not the user's ~/.cache."""
    os.environ["AUTOPARALLEL_CACHE_DIR"] = str(tmp_path_factory.mktemp("plan_cache"))
warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture
def sim_mesh():
    """Factory: a DeviceMesh of the given shape on the fake process group, every rank
    simulated in this process by LocalTensorMode (DESIGN §4, tier 2)."""
    from torch.distributed.tensor import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def make(shape):
        if dist.is_initialized():
            dist.destroy_process_group()
        world = 1
        for s in shape:
            world *= s
        dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
        return init_device_mesh("cpu", tuple(shape))

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()
