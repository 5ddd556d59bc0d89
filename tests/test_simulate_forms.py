"""xla_utils.simulate on the other torch_xla program forms (issue 21): list
reduce_scatter with outputs, replica groups, torch.distributed's ``xla``
backend and DDP, SPMD on N real XLA:CPU devices. Scripts in tests/fixtures/forms/."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from xla_utils import runtime as rt
from xla_utils import simulate

FORMS = Path(__file__).resolve().parent / "fixtures" / "forms"


@pytest.mark.multicore
@pytest.mark.timeout(300)
def test_list_reduce_scatter_groups_and_subset_rendezvous_8_cores(capfd):
    assert simulate.run_script(FORMS / "mp_collectives.py", cores=8) == 0
    assert capfd.readouterr().out.count("mp_collectives ok") == 8


def _rank_dependent_groups():
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    groups = [[0, 1], [2, 3]] if xr.global_ordinal() != 3 else [[0, 2], [1, 3]]
    return xm.all_reduce(xm.REDUCE_SUM, torch.ones(2, device=torch_xla.device()),
                         groups=groups).tolist()


@pytest.mark.multicore
@pytest.mark.timeout(120)
def test_rank_dependent_groups_are_a_named_mismatch():
    with pytest.raises(rt.ReplicaError) as info:
        rt.launch(_rank_dependent_groups, simulate=4)
    msg = info.value.remote_traceback
    assert info.value.exc_type == "CollectiveError"
    assert "groups=[[0, 1], [2, 3]]" in msg and "groups=[[0, 2], [1, 3]]" in msg
    assert "rank 3: xm.all_reduce" in msg and "test_simulate_forms.py" in msg


@pytest.mark.multicore
@pytest.mark.timeout(300)
@pytest.mark.parametrize("init", ["xla", "env"])
def test_torch_distributed_xla_backend_collectives_8_cores(init, capfd):
    args = ["--env"] if init == "env" else []
    assert simulate.run_script(FORMS / "dist_collectives.py", cores=8, args=args) == 0
    assert capfd.readouterr().out.count("dist_collectives ok") == 8


def _dist_rank_dependent():
    import torch.distributed as dist
    import torch_xla
    import torch_xla.distributed.xla_backend  # noqa: F401

    dist.init_process_group("xla", init_method="xla://")
    x = torch.ones(2, device=torch_xla.device())
    if dist.get_rank() == 0:
        dist.all_reduce(x)
    else:
        dist.all_gather([torch.zeros_like(x) for _ in range(2)], x)
    return x.cpu().tolist()


@pytest.mark.multicore
@pytest.mark.timeout(120)
def test_dist_rank_dependent_collective_is_named_not_a_hang():
    t0 = time.monotonic()
    with pytest.raises(rt.ReplicaError) as info:
        rt.launch(_dist_rank_dependent, simulate=2)
    assert time.monotonic() - t0 < 60
    msg = info.value.remote_traceback
    assert info.value.exc_type == "CollectiveError"
    assert "rank 0: dist.all_reduce" in msg and "rank 1: dist.all_gather" in msg
    assert "test_simulate_forms.py" in msg
