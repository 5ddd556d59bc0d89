"""xla_utils.runtime.placement: where a run happens, resolved once from ``cores=`` /
``simulate=`` and the host (this CI host: no TPU, no GPU, torch built without CUDA)."""
from __future__ import annotations

import dataclasses

import pytest

from xla_utils import runtime
from xla_utils.runtime.placement import Placement, resolve


@pytest.fixture
def no_cpu_replicas(monkeypatch):
    monkeypatch.delenv(runtime.CPU_REPLICAS_ENV, raising=False)


def test_simulated_devices_are_the_world(no_cpu_replicas):
    p = resolve(simulate=8)
    assert p == Placement("xla", "xla_cpu", 8, one_core=False, simulated=8, host_devices=8)
    assert p.is_simulated and p.world_known
    one = resolve(cores=1, simulate=8)
    assert (one.replicas, one.one_core, one.simulated, one.host_devices) == (1, True, 8, 8)
    assert one == p.one()


def test_without_simulation_the_torch_backend_counts_its_replicas(monkeypatch):
    monkeypatch.delenv(runtime.CPU_REPLICAS_ENV, raising=False)
    assert resolve() == Placement("torch", "cpu", 1, one_core=False, simulated=None, host_devices=1)
    monkeypatch.setenv(runtime.CPU_REPLICAS_ENV, "3")
    p = resolve("ALL ")  # string options are read in any case
    assert (p.backend, p.kind, p.replicas, p.host_devices, p.is_simulated) == ("torch", "cpu", 3, 3, False)
    one = resolve(cores=1)
    assert (one.replicas, one.one_core, one.host_devices) == (1, True, 3)
    assert resolve(simulate=2).replicas == 2  # simulated devices win over the torch replicas


def test_the_world_of_a_tpu_launch_is_known_on_one_core_only():
    tpu = Placement("xla", "tpu", 8, host_devices=8)
    assert not tpu.world_known  # a pod slice's replicas span hosts
    assert tpu.one().world_known and tpu.one().replicas == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        tpu.replicas = 4  # one value, passed down: nobody rewrites it


@pytest.mark.parametrize("kwargs, message", [
    (dict(cores=2), r"cores must be 'all' or 1, got 2 \(TPUs and GPUs run 1 or all devices\)"),
    (dict(cores="al"), r"cores must be one of 'all' or 1 \(any case\), got 'al' \(did you mean 'all'\?\)"),
    (dict(simulate=0), r"simulate must be a positive int \(number of XLA:CPU devices\), got 0"),
    (dict(simulate="8"), r"simulate must be a positive int \(number of XLA:CPU devices\), got '8'"),
])
def test_bad_values_are_refused_naming_the_setting(kwargs, message, no_cpu_replicas):
    with pytest.raises(ValueError, match=message):
        resolve(**kwargs)


def test_a_bad_replica_count_in_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv(runtime.CPU_REPLICAS_ENV, "two")
    with pytest.raises(ValueError, match="XLA_UTILS_CPU_REPLICAS='two': set it to a positive integer"):
        resolve()
    assert resolve(simulate=4).replicas == 4  # a simulated run does not read it


def test_the_public_launch_refuses_what_resolve_refuses(no_cpu_replicas):
    with pytest.raises(ValueError, match="cores must be 'all' or 1, got 3"):
        runtime.launch(print, cores=3)
    with pytest.raises(ValueError, match="simulate must be a positive int"):
        runtime.launch(print, simulate=-1)
