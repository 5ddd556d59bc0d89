"""Tests for xla_utils.env: detection on faked machine trees, next-step advice,
setup()/prepare_spawn() environment edits, and the `python -m xla_utils.env` CLI."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from xla_utils import env as xenv
from xla_utils.env import detection

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable


# --------------------------------------------------------------------------
# Fake machine trees
# --------------------------------------------------------------------------
def _pci(root: Path, slot: str, vendor: str, device: str, cls: str) -> None:
    d = root / "sys/bus/pci/devices" / slot
    d.mkdir(parents=True)
    (d / "vendor").write_text(vendor + "\n")
    (d / "device").write_text(device + "\n")
    (d / "class").write_text(cls + "\n")


def _touch(root: Path, rel: str, text: str = "") -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def _host(root: Path, cpus: int, mem_kb: int) -> None:
    _touch(root, "proc/cpuinfo", "".join(f"processor\t: {i}\nmodel name\t: x\n\n" for i in range(cpus)))
    _touch(root, "proc/meminfo", f"MemTotal:       {mem_kb} kB\nMemFree:        1000 kB\n")


def _common_pci(root: Path) -> None:
    _pci(root, "0000:00:00.0", "0x8086", "0x1237", "0x060000")  # host bridge
    _pci(root, "0000:00:03.0", "0x1ae0", "0x0042", "0x020000")  # Google gVNIC: not a TPU


KAGGLE_ENV = {
    "KAGGLE_KERNEL_RUN_TYPE": "Interactive",
    "KAGGLE_URL_BASE": "https://www.kaggle.com",
    "ISTPUVM": "1",
    "TPU_PROCESS_ADDRESSES": "local",
    "CLOUD_TPU_TASK_ID": "0",
    "COLAB_RELEASE_TAG": "release-colab_20250101-060000_RC00",  # inherited from Colab's image
}


def make_machine(tmp_path: Path, kind: str) -> tuple[str, dict, dict]:
    """Build a faked root for one machine; return (root, environ, modules)."""
    root = tmp_path / kind
    n = 1
    while root.exists():  # several machines in one test
        n += 1
        root = tmp_path / f"{kind}-{n}"
    root.mkdir()
    _common_pci(root)
    environ: dict[str, str] = {"PATH": "/usr/bin"}
    modules: dict[str, object] = {}
    if kind == "kaggle-v5e-8":
        for i in range(8):
            _pci(root, f"0000:00:{5 + i:02x}.0", "0x1ae0", "0x0063", "0x120000")
            _touch(root, f"dev/vfio/{i}")
        _touch(root, "dev/vfio/vfio")
        (root / "kaggle/input").mkdir(parents=True)
        environ.update(KAGGLE_ENV)
        _host(root, 224, 394_000_000)
    elif kind == "kaggle-v3-8":
        for i in range(4):
            _pci(root, f"0000:00:{5 + i:02x}.0", "0x1ae0", "0x0027", "0x120000")
            _touch(root, f"dev/accel{i}")
        (root / "kaggle/input").mkdir(parents=True)
        environ.update(KAGGLE_ENV)
        _host(root, 96, 346_000_000)
    elif kind == "colab-v5e-1":
        _pci(root, "0000:00:05.0", "0x1ae0", "0x0063", "0x120000")
        _touch(root, "dev/vfio/0")
        _touch(root, "dev/vfio/vfio")
        environ.update({"COLAB_RELEASE_TAG": "release-colab_20250101", "TPU_ACCELERATOR_TYPE": "v5litepod-1"})
        modules["google.colab"] = object()
        _host(root, 44, 49_000_000)
    elif kind == "tpu-vm-v4-8":
        for i in range(4):
            _pci(root, f"0000:00:{5 + i:02x}.0", "0x1ae0", "0x005e", "0x120000")
            _touch(root, f"dev/accel{i}")
        environ["TPU_ACCELERATOR_TYPE"] = "v4-8"
        _host(root, 240, 400_000_000)
    elif kind == "gpu-box":
        _pci(root, "0000:00:04.0", "0x10de", "0x2330", "0x030200")  # H100
        _pci(root, "0000:00:04.1", "0x10de", "0x22a3", "0x040300")  # its audio function: not a GPU
        _touch(root, "dev/nvidia0")
        _touch(root, "dev/nvidiactl")
        _touch(root, "proc/driver/nvidia/gpus/0000:00:04.0/information", "Model: \t\t NVIDIA H100 80GB HBM3\nIRQ: 1\n")
        _host(root, 26, 230_000_000)
    elif kind == "laptop":
        environ["COLAB_RELEASE_TAG"] = "release-colab_20250101"  # alone: not Colab
        _host(root, 8, 16_000_000)
    else:  # pragma: no cover
        raise ValueError(kind)
    return str(root), environ, modules


PAIRED_28 = {"torch": "2.8.0+cpu", "torchvision": "0.23.0+cpu", "torch_xla": "2.8.0", "libtpu": "0.0.17"}


def versions(**kv):
    table = {k.replace("__", "-"): v for k, v in kv.items()}
    return lambda name: table.get(name)


def detect_on(tmp_path, kind, vers=None, python="3.12.3", extra_env=None, **kw):
    root, environ, modules = make_machine(tmp_path, kind)
    environ.update(extra_env or {})
    info = xenv.detect(
        root, environ, modules, version_of=versions(**(vers if vers is not None else PAIRED_28)),
        python=python, system="Linux", machine="x86_64", cwd=str(tmp_path), **kw,
    )
    return info, environ, modules, root


# --------------------------------------------------------------------------
# The six machines
# --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind, platform, accel, gen, chips, devices, tpu_type",
    [
        ("kaggle-v5e-8", "kaggle", "tpu", "v5e", 8, 8, "v5e-8"),
        ("kaggle-v3-8", "kaggle", "tpu", "v3", 4, 8, "v3-8"),
        ("colab-v5e-1", "colab", "tpu", "v5e", 1, 1, "v5e-1"),
        ("tpu-vm-v4-8", "tpu-vm", "tpu", "v4", 4, 4, "v4-8"),
        ("gpu-box", "local", "gpu", None, 0, 1, None),
        ("laptop", "local", "cpu", None, 0, 1, None),
    ],
)
def test_six_machines(tmp_path, kind, platform, accel, gen, chips, devices, tpu_type):
    info, *_ = detect_on(tmp_path, kind)
    assert (info.platform, info.accelerator, info.tpu_generation) == (platform, accel, gen)
    assert info.tpu_chips == chips
    assert info.num_devices == devices
    assert info.tpu_type == tpu_type
    assert info.paired is True
    assert info.python == "3.12.3"
    json.loads(info.to_json())  # serialisable


def test_host_resources_from_tree(tmp_path):
    info, *_ = detect_on(tmp_path, "kaggle-v5e-8")
    assert info.cpus == 224
    assert info.ram_gb == pytest.approx(394_000_000 / 2**20, abs=0.1)
    assert info.disk_free_gb is not None and info.disk_free_gb > 0
    assert info.cwd == str(tmp_path)


def test_cgroup_limits_cap_cpus_and_ram(tmp_path):
    root, environ, modules = make_machine(tmp_path, "gpu-box")
    _touch(Path(root), "sys/fs/cgroup/cpu.max", "400000 100000\n")
    _touch(Path(root), "sys/fs/cgroup/memory.max", str(30 * 2**30) + "\n")
    info = xenv.detect(root, environ, modules, version_of=versions(**PAIRED_28))
    assert info.cpus == 4
    assert info.ram_gb == 30.0
    assert any("vCPUs" in w for w in info.warnings)  # 4 vCPUs feeding a GPU: starved


def test_gpu_details(tmp_path):
    info, *_ = detect_on(tmp_path, "gpu-box")
    assert info.gpu_count == 1  # audio function and nvidiactl are not GPUs
    assert info.gpu_name == "NVIDIA H100 80GB HBM3"


def test_gvnic_alone_is_not_a_tpu(tmp_path):
    info, *_ = detect_on(tmp_path, "laptop")
    assert info.accelerator == "cpu" and info.tpu_chips == 0


def test_colab_release_tag_alone_is_not_colab(tmp_path):
    info, environ, *_ = detect_on(tmp_path, "laptop")
    assert environ["COLAB_RELEASE_TAG"] and info.platform == "local"


def test_kaggle_wins_over_colab_markers(tmp_path):
    root, environ, modules = make_machine(tmp_path, "kaggle-v5e-8")
    modules["google.colab"] = object()
    info = xenv.detect(root, environ, modules, version_of=versions(**PAIRED_28))
    assert info.platform == "kaggle"


def test_kaggle_by_input_dir_only(tmp_path):
    root, environ, modules = make_machine(tmp_path, "kaggle-v5e-8")
    for k in ("KAGGLE_KERNEL_RUN_TYPE", "KAGGLE_URL_BASE"):
        environ.pop(k)
    assert xenv.detect(root, environ, modules, version_of=versions(**PAIRED_28)).platform == "kaggle"


def test_colab_subprocess_detected_by_runtime_env(tmp_path):
    # `!python -m xla_utils.env` in Colab: google.colab is not imported in the child.
    root, environ, _ = make_machine(tmp_path, "colab-v5e-1")
    environ["COLAB_JUPYTER_IP"] = "172.28.0.12"
    assert xenv.detect(root, environ, {}, version_of=versions(**PAIRED_28)).platform == "colab"


def test_v2_vs_v3_from_accelerator_type(tmp_path):
    root = tmp_path / "vm"
    for i in range(4):
        _pci(root, f"0000:00:{5 + i:02x}.0", "0x1ae0", "0x0027", "0x120000")
    ver = versions(**PAIRED_28)
    info = xenv.detect(str(root), {"TPU_ACCELERATOR_TYPE": "v2-8"}, {}, version_of=ver)
    assert (info.platform, info.tpu_generation, info.tpu_chips, info.num_devices) == ("tpu-vm", "v2", 4, 8)
    info = xenv.detect(str(root), {"TPU_ACCELERATOR_TYPE": "v3-8"}, {}, version_of=ver)
    assert info.tpu_generation == "v3"
    # no way to tell: say so rather than guess
    assert xenv.detect(str(root), {}, {}, version_of=ver).tpu_generation == "v2/v3"


def test_dev_accel_without_pci_uses_accelerator_type(tmp_path):
    root = tmp_path / "container"
    for i in range(4):
        _touch(root, f"dev/accel{i}")
    _touch(root, "dev/accel/accel0")  # DRM accel-class dir of some other NPU: ignored
    info = xenv.detect(str(root), {"TPU_ACCELERATOR_TYPE": "v5p-8"}, {}, version_of=versions(**PAIRED_28))
    assert (info.accelerator, info.tpu_generation, info.tpu_chips, info.num_devices) == ("tpu", "v5p", 4, 4)
    assert info.tpu_type == "v5p-8"


def test_vfio_needs_a_tpu_hint(tmp_path):
    root = tmp_path / "box"
    for i in range(4):
        _touch(root, f"dev/vfio/{i}")
    ver = versions(**PAIRED_28)
    assert xenv.detect(str(root), {}, {}, version_of=ver).accelerator == "cpu"
    info = xenv.detect(str(root), {"TPU_ACCELERATOR_TYPE": "v6e-4"}, {}, version_of=ver)
    assert (info.accelerator, info.tpu_generation, info.num_devices) == ("tpu", "v6e", 4)


def test_unknown_google_accelerator_class_counts_as_tpu(tmp_path):
    root = tmp_path / "future"
    for i in range(2):
        _pci(root, f"0000:00:{5 + i:02x}.0", "0x1ae0", "0x0099", "0x120000")
    info = xenv.detect(str(root), {}, {}, version_of=versions(**PAIRED_28))
    assert (info.accelerator, info.tpu_generation, info.tpu_chips) == ("tpu", "unknown", 2)


def test_accelerator_type_alone_is_not_a_tpu(tmp_path):
    info, *_ = detect_on(tmp_path, "laptop", extra_env={"TPU_ACCELERATOR_TYPE": "v3-8"})
    assert info.accelerator == "cpu"
    assert any("TPU_ACCELERATOR_TYPE=v3-8" in w for w in info.warnings)


@pytest.mark.parametrize(
    "raw, parsed",
    [("v3-8", ("v3", 8)), ("v5litepod-8", ("v5e", 8)), ("v5e-1", ("v5e", 1)), ("v6e-8", ("v6e", 8)),
     ("v5p-16", ("v5p", 16)), ("bogus", None), ("", None)],
)
def test_parse_accelerator_type(raw, parsed):
    assert detection._parse_accelerator_type(raw) == parsed


# --------------------------------------------------------------------------
# Next step
# --------------------------------------------------------------------------
def test_no_torch_gives_pinned_pair_for_this_python(tmp_path):
    info, *_ = detect_on(tmp_path, "colab-v5e-1", vers={}, python="3.13.1")
    assert not info.ready
    assert info.next_command == 'pip install torch==2.9.0 torchvision==0.24.0 "torch_xla[tpu]==2.9.0"'
    info, *_ = detect_on(tmp_path, "laptop", vers={}, python="3.10.12")
    assert info.next_command == "pip install torch==2.9.0 torchvision==0.24.0 torch_xla==2.9.0"


def test_no_torch_on_unsupported_python(tmp_path):
    info, *_ = detect_on(tmp_path, "laptop", vers={}, python="3.14.0")
    assert xenv.advise(info).kind == "python-unsupported"
    assert "3.14" in info.next_step
    assert info.next_command.startswith("python3.12 -m venv ~/xla-venv && ~/xla-venv/bin/pip install torch==2.9.0")


def test_torch_without_xla_on_tpu(tmp_path):
    info, *_ = detect_on(tmp_path, "kaggle-v5e-8", vers={"torch": "2.8.0+cpu"})
    assert xenv.advise(info).kind == "install-torch-xla"
    assert info.next_command == 'pip install "torch_xla[tpu]==2.8.*"'
    assert "torch==" not in info.next_command  # never touches torch


def test_torch_without_xla_on_cpu(tmp_path):
    info, *_ = detect_on(tmp_path, "laptop", vers={"torch": "2.9.0"})
    assert info.next_command == 'pip install "torch_xla==2.9.*"'
    assert "simulated" in info.next_step


def test_torch_without_xla_wheels_for_this_python(tmp_path):
    # torch_xla 2.7 has no wheels for Python 3.12
    info, *_ = detect_on(tmp_path, "tpu-vm-v4-8", vers={"torch": "2.7.1"}, python="3.12.1")
    assert xenv.advise(info).kind == "python-unsupported"
    assert "python3.12 -m venv" in info.next_command and "torch==2.9.0" in info.next_command


def test_torch_newer_than_last_xla(tmp_path):
    info, *_ = detect_on(tmp_path, "kaggle-v5e-8", vers={"torch": "2.15.0"})
    adv = xenv.advise(info)
    assert adv.kind == "torch-too-new" and adv.pip_args is None
    assert "no matching release" in info.next_step
    assert info.next_command == (
        'python3.12 -m venv ~/xla-venv && ~/xla-venv/bin/pip install torch==2.9.0 torchvision==0.24.0 '
        '"torch_xla[tpu]==2.9.0"'
    )


def test_torch_too_old(tmp_path):
    info, *_ = detect_on(tmp_path, "laptop", vers={"torch": "2.3.1", "torch_xla": "2.3.0"}, python="3.10.4")
    assert xenv.advise(info).kind == "torch-too-old"
    assert info.next_command.startswith("python3.10 -m venv")


def test_mismatched_pair(tmp_path):
    info, *_ = detect_on(tmp_path, "kaggle-v5e-8", vers={"torch": "2.9.0", "torch_xla": "2.8.0", "libtpu": "0.0.17"})
    assert info.paired is False
    assert xenv.advise(info).kind == "mismatch"
    assert info.next_command == 'pip install "torch_xla[tpu]==2.9.*"'
    assert "undefined symbol" in info.next_step


def test_tpu_without_libtpu(tmp_path):
    info, *_ = detect_on(tmp_path, "tpu-vm-v4-8", vers={"torch": "2.9.0", "torch_xla": "2.9.0"})
    assert xenv.advise(info).kind == "install-libtpu"
    assert info.next_command == 'pip install "torch_xla[tpu]==2.9.*"'


def test_ready_on_tpu_notes_pjrt(tmp_path):
    info, *_ = detect_on(tmp_path, "kaggle-v5e-8")
    assert info.ready and info.next_step.startswith("ready")
    assert "PJRT_DEVICE will be set to TPU" in info.next_step
    info, *_ = detect_on(tmp_path, "tpu-vm-v4-8",
                         extra_env={"PJRT_DEVICE": "TPU"})
    assert info.ready and "PJRT_DEVICE" not in info.next_step


def test_pjrt_tpu_without_chip_is_flagged(tmp_path):
    info, *_ = detect_on(tmp_path, "laptop", vers={"torch": "2.9.0", "torch_xla": "2.9.0"},
                         extra_env={"PJRT_DEVICE": "TPU"})
    assert not info.ready
    assert xenv.advise(info).kind == "pjrt-without-tpu"
    assert info.next_command == "export PJRT_DEVICE=CPU"
    assert any("hang" in w for w in info.warnings)
    assert "hang" in xenv.report(info)


def test_blocking_problem_outranks_pjrt_warning(tmp_path):
    info, *_ = detect_on(tmp_path, "laptop", vers={}, extra_env={"PJRT_DEVICE": "TPU"})
    assert xenv.advise(info).kind == "install-torch"
    assert any("PJRT_DEVICE=TPU" in w for w in info.warnings)


def test_torchvision_mismatch_warns(tmp_path):
    info, *_ = detect_on(tmp_path, "laptop", vers={"torch": "2.9.0", "torch_xla": "2.9.0", "torchvision": "0.23.0"})
    assert any("expected 0.24.x" in w for w in info.warnings)


def test_no_xla_wheels_on_macos(tmp_path):
    root, environ, modules = make_machine(tmp_path, "laptop")
    info = xenv.detect(root, environ, modules, version_of=versions(torch="2.15.0"),
                       python="3.13.0", system="Darwin", machine="arm64")
    assert info.ready and "no wheels for Darwin arm64" in info.next_step


def test_libtpu_nightly_counts(tmp_path):
    info, *_ = detect_on(tmp_path, "tpu-vm-v4-8", vers={"torch": "2.5.1", "torch_xla": "2.5.1",
                                                        "libtpu__nightly": "0.1.dev20240916"}, python="3.11.9")
    assert info.libtpu == "0.1.dev20240916" and info.ready


# --------------------------------------------------------------------------
# xla_fix_message
# --------------------------------------------------------------------------
def test_fix_message_mismatch(tmp_path):
    info, *_ = detect_on(tmp_path, "colab-v5e-1", vers={"torch": "2.9.0+cpu", "torch_xla": "2.8.0"})
    msg = xenv.xla_fix_message(info)
    assert len(msg.splitlines()) <= 2
    assert "torch 2.9.0+cpu" in msg and "torch_xla 2.8.0" in msg
    assert msg.splitlines()[-1] == 'Fix: pip install "torch_xla[tpu]==2.9.*"'


def test_fix_message_missing_and_paired(tmp_path):
    info, *_ = detect_on(tmp_path, "laptop", vers={"torch": "2.8.0"})
    assert xenv.xla_fix_message(info).endswith('Fix: pip install "torch_xla==2.8.*"')
    info, *_ = detect_on(tmp_path, "laptop",
                         vers={"torch": "2.9.0", "torch_xla": "2.9.0"})
    msg = xenv.xla_fix_message(info)
    assert "paired" in msg and "--force-reinstall --no-deps torch_xla==2.9.0" in msg


def test_fix_message_default_detects_this_machine():
    msg = xenv.xla_fix_message()
    assert isinstance(msg, str) and 0 < len(msg.splitlines()) <= 2


# --------------------------------------------------------------------------
# prepare_spawn / setup
# --------------------------------------------------------------------------
def test_prepare_spawn_on_kaggle_tpu(tmp_path):
    info, environ, *_ = detect_on(tmp_path, "kaggle-v5e-8")
    xenv.prepare_spawn(info, environ)
    assert "TPU_PROCESS_ADDRESSES" not in environ and "CLOUD_TPU_TASK_ID" not in environ
    assert environ["PJRT_DEVICE"] == "TPU"
    assert environ["ISTPUVM"] == "1"  # untouched


def test_prepare_spawn_edits_os_environ_by_default(tmp_path, monkeypatch):
    info, *_ = detect_on(tmp_path, "kaggle-v3-8")
    monkeypatch.setenv("TPU_PROCESS_ADDRESSES", "local")
    monkeypatch.setenv("CLOUD_TPU_TASK_ID", "0")
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    xenv.prepare_spawn(info)
    assert "TPU_PROCESS_ADDRESSES" not in os.environ and "CLOUD_TPU_TASK_ID" not in os.environ
    assert os.environ["PJRT_DEVICE"] == "TPU"


def test_prepare_spawn_elsewhere(tmp_path):
    info, environ, *_ = detect_on(tmp_path, "tpu-vm-v4-8", extra_env={"TPU_PROCESS_ADDRESSES": "x"})
    xenv.prepare_spawn(info, environ)
    assert environ["TPU_PROCESS_ADDRESSES"] == "x" and environ["PJRT_DEVICE"] == "TPU"
    info, environ, *_ = detect_on(tmp_path, "laptop")
    before = dict(environ)
    xenv.prepare_spawn(info, environ)
    assert environ == before


class Recorder:
    def __init__(self, rc=0, on_run=None):
        self.calls, self.rc, self.on_run = [], rc, on_run

    def __call__(self, cmd):
        self.calls.append(list(cmd))
        if self.on_run:
            self.on_run()
        return subprocess.CompletedProcess(cmd, self.rc)


def test_setup_install_pins_torch_major_minor(tmp_path):
    root, environ, modules = make_machine(tmp_path, "kaggle-v5e-8")
    table = {"torch": "2.8.0+cpu", "libtpu": "0.0.17"}
    modules["torch"] = object()  # torch already imported in the notebook
    rec = Recorder(on_run=lambda: table.update(torch_xla="2.8.1"))
    lines: list[str] = []
    info = xenv.setup(install=True, runner=rec, root=root, environ=environ, modules=modules,
                      version_of=table.get, out=lines.append)
    assert rec.calls == [[sys.executable, "-m", "pip", "install", "torch_xla[tpu]==2.8.*"]]
    text = "\n".join(lines)
    assert "restart the kernel" in text
    assert info.paired and info.torch_xla == "2.8.1"
    # Kaggle TPU environment prepared for xmp.spawn
    assert environ["PJRT_DEVICE"] == "TPU" and info.pjrt_device == "TPU"
    assert "TPU_PROCESS_ADDRESSES" not in environ and "CLOUD_TPU_TASK_ID" not in environ


def test_setup_install_cpu_no_restart_when_torch_not_imported(tmp_path):
    root, environ, modules = make_machine(tmp_path, "laptop")
    table = {"torch": "2.9.0"}
    rec = Recorder(on_run=lambda: table.update(torch_xla="2.9.0"))
    lines: list[str] = []
    info = xenv.setup(install=True, runner=rec, root=root, environ=environ, modules=modules,
                      version_of=table.get, out=lines.append)
    assert rec.calls == [[sys.executable, "-m", "pip", "install", "torch_xla==2.9.*"]]
    assert "restart" not in "\n".join(lines)
    assert info.ready and environ["PJRT_DEVICE"] == "CPU"


@pytest.mark.parametrize("table", [{}, {"torch": "2.15.0"}])
def test_setup_install_refuses_without_usable_torch(tmp_path, table):
    root, environ, modules = make_machine(tmp_path, "colab-v5e-1")
    rec = Recorder()
    lines: list[str] = []
    xenv.setup(install=True, runner=rec, root=root, environ=environ, modules=modules,
               version_of=table.get, out=lines.append)
    assert rec.calls == []
    text = "\n".join(lines)
    assert "will not install or change torch" in text and "Run yourself: " in text


def test_setup_install_reports_pip_failure(tmp_path):
    root, environ, modules = make_machine(tmp_path, "tpu-vm-v4-8")
    rec = Recorder(rc=1)
    lines: list[str] = []
    info = xenv.setup(install=True, runner=rec, root=root, environ=environ, modules=modules,
                      version_of={"torch": "2.9.0", "torch_xla": "2.8.0"}.get, out=lines.append)
    assert rec.calls == [[sys.executable, "-m", "pip", "install", "torch_xla[tpu]==2.9.*"]]
    assert any("pip failed (exit code 1)" in ln for ln in lines)
    assert not info.paired


def test_setup_nothing_to_install(tmp_path):
    root, environ, modules = make_machine(tmp_path, "tpu-vm-v4-8")
    rec = Recorder()
    lines: list[str] = []
    xenv.setup(install=True, runner=rec, root=root, environ=environ, modules=modules,
               version_of=versions(**PAIRED_28), out=lines.append)
    assert rec.calls == [] and "nothing to install" in "\n".join(lines)
    assert lines[0].startswith("xla_utils environment")


def test_setup_without_tpu_sets_cpu_and_warns_if_xla_imported(tmp_path):
    root, environ, modules = make_machine(tmp_path, "gpu-box")
    modules["torch_xla"] = object()
    lines: list[str] = []
    xenv.setup(root=root, environ=environ, modules=modules, version_of=versions(**PAIRED_28), out=lines.append)
    assert environ["PJRT_DEVICE"] == "CPU"
    assert any("torch_xla was imported before setup()" in ln for ln in lines)
    # an explicit choice is kept
    environ["PJRT_DEVICE"] = "CUDA"
    xenv.setup(root=root, environ=environ, modules={}, version_of=versions(**PAIRED_28), out=lines.append)
    assert environ["PJRT_DEVICE"] == "CUDA"


# --------------------------------------------------------------------------
# CLI in a subprocess
# --------------------------------------------------------------------------
def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KAGGLE_", "COLAB_", "TPU_")) and k not in ("PJRT_DEVICE", "ISTPUVM")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _cli(*args, env):
    # up to IMPORT_PROBE_TIMEOUT for the `import torch_xla` check on a loaded machine
    proc = subprocess.run([PY, "-m", "xla_utils.env", *args], capture_output=True, text=True,
                          env=env, cwd=str(REPO), timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.slow
def test_cli_json_on_this_machine():
    data = json.loads(_cli("--json", env=_clean_env()))
    for key in ("platform", "accelerator", "tpu_generation", "num_devices", "torch", "torch_xla",
                "paired", "python", "cpus", "ram_gb"):
        assert key in data
    assert data["platform"] == "local" and data["accelerator"] == "cpu"
    # whatever stack runs the tests (2.9 here, Kaggle's 2.8 in CI's second run), as long as it pairs
    assert data["torch_xla"] == metadata.version("torch_xla") and data["paired"] is True
    assert data["import_error"] is None  # the import was really checked, and works
    assert data["python"] == ".".join(map(str, sys.version_info[:3]))
    assert data["cpus"] >= 1 and data["ram_gb"] > 0
    assert data["ready"] is True


def test_cli_json_on_faked_kaggle(tmp_path):
    root, environ, _ = make_machine(tmp_path, "kaggle-v5e-8")
    env = _clean_env(**{k: v for k, v in environ.items() if k != "PATH"})
    data = json.loads(_cli("--json", "--root", root, "--no-import-check", env=env))
    assert (data["platform"], data["accelerator"], data["tpu_generation"], data["num_devices"]) == \
        ("kaggle", "tpu", "v5e", 8)
    assert data["tpu_chips"] == 8 and data["cpus"] == 224


def test_cli_human_report(tmp_path):
    root, environ, _ = make_machine(tmp_path, "tpu-vm-v4-8")
    out = _cli("--root", root, "--no-import-check", env=_clean_env(TPU_ACCELERATOR_TYPE="v4-8"))
    assert "TPU v4-8: 4 chip(s), 4 XLA device(s)" in out
    assert out.strip().splitlines()[-1].startswith("next step: ")


def _fake_dists(site: Path, **dists: str) -> Path:
    """Package metadata only (``name-version.dist-info``): what ``importlib.metadata`` reads first
    when ``site`` leads ``PYTHONPATH``."""
    for name, version in dists.items():
        d = site / f"{name}-{version}.dist-info"
        d.mkdir(parents=True)
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return site


def test_cli_warns_about_libtpu_not_known_to_work_with_torch_xla_28(tmp_path):
    """Kaggle's torch_xla 2.8 with a libtpu other than 0.0.17: the report names the pair and the fix."""
    root, environ, _ = make_machine(tmp_path, "kaggle-v5e-8")
    site = _fake_dists(tmp_path / "site", torch="2.8.0", torchvision="0.23.0", torch_xla="2.8.0",
                       libtpu="0.0.21")
    env = _clean_env(**{k: v for k, v in environ.items() if k != "PATH"})
    env["PYTHONPATH"] = f"{site}{os.pathsep}{env['PYTHONPATH']}"
    out = _cli("--root", root, "--no-import-check", env=env)
    warning = [ln for ln in out.splitlines() if ln.startswith("  warning: libtpu 0.0.21 ")]
    assert len(warning) == 1, out
    assert "with torch_xla 2.8.0, which is known to work with libtpu 0.0.17" in warning[0]
    assert warning[0].endswith(": pip install libtpu==0.0.17")
    # the known pair: no such warning
    _fake_dists(tmp_path / "site2", torch="2.8.0", torchvision="0.23.0", torch_xla="2.8.0", libtpu="0.0.17")
    env["PYTHONPATH"] = env["PYTHONPATH"].replace(str(site), str(tmp_path / "site2"))
    assert "libtpu 0.0.17 is installed" not in _cli("--root", root, "--no-import-check", env=env)


@pytest.mark.parametrize("vers, fix", [
    ({"torch_xla": "2.9.0", "libtpu": "0.0.17"}, "pip install libtpu==0.0.21.1"),
    ({"torch_xla": "2.8.0", "libtpu__nightly": "0.1.dev20250101"},
     "pip uninstall -y libtpu-nightly && pip install libtpu==0.0.17"),
    ({"torch_xla": "2.9.0", "libtpu": "0.0.21.1"}, None),
    ({"torch_xla": "2.9.0", "libtpu": "0.0.21"}, None),
    ({"torch_xla": "2.8.0"}, None),  # no libtpu: the install-libtpu advice, not this warning
])
def test_libtpu_pairing_warning(tmp_path, vers, fix):
    minor = vers["torch_xla"].split(".")[1]
    info, *_ = detect_on(tmp_path, "colab-v5e-1",
                         vers={"torch": vers["torch_xla"], "torchvision": f"0.{int(minor) + 15}.0", **vers})
    pairing = [w for w in info.warnings if "is known to work with libtpu" in w]
    assert len(pairing) == (0 if fix is None else 1), info.warnings
    if fix:
        assert pairing[0].endswith(fix) and f"warning: {pairing[0]}" in xenv.report(info)


def test_pjrt_cpu_on_tpu_warns(tmp_path):
    info, *_ = detect_on(tmp_path, "tpu-vm-v4-8", extra_env={"PJRT_DEVICE": "CPU"})
    assert any("host CPU, not the TPU" in w for w in info.warnings)


# --------------------------------------------------------------------------
# metadata says paired, but the import fails
# --------------------------------------------------------------------------
def _broken_torch_xla(tmp_path: Path) -> tuple[Path, str]:
    """A torch_xla that fails like a mismatched _XLAC.so, with metadata that pairs with torch."""
    version = re.match(r"\d+\.\d+\.\d+", metadata.version("torch")).group(0)
    site = tmp_path / "fake_site"
    (site / "torch_xla").mkdir(parents=True)
    (site / "torch_xla" / "__init__.py").write_text(
        'raise ImportError("/usr/local/lib/python3.12/site-packages/_XLAC.cpython-312-x86_64-linux-gnu.so: '
        'undefined symbol: _ZN5torch4lazy13MetricFnValueB5cxx11Ed")\n')
    dist = site / f"torch_xla-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch_xla\nVersion: {version}\n")
    return site, version


SETUP_PROBE = r"""
import sys
import xla_utils
calls = []
info = xla_utils.setup(install=True, runner=lambda cmd: calls.append(cmd) or 0)
print("RESULT", info.ready, len(calls), sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "torch_xla")))
"""


def test_torch_xla_that_fails_to_import_is_not_ready(tmp_path):
    site, version = _broken_torch_xla(tmp_path)
    env = _clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), env.get("PYTHONPATH", "")])
    out = _cli(env=env)
    assert f"torch_xla {version} paired by version, but `import torch_xla` FAILS" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("next step: not ready: ") and "undefined symbol" in last
    assert last.endswith(f": pip install --force-reinstall --no-deps torch_xla=={version}")
    data = json.loads(_cli("--json", env=env))
    assert data["torch_xla"] == version and data["ready"] is False and "undefined symbol" in data["import_error"]
    assert data["next_command"] == f"pip install --force-reinstall --no-deps torch_xla=={version}"

    proc = subprocess.run([PY, "-c", SETUP_PROBE], capture_output=True, text=True, env=env, cwd=str(tmp_path),
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "nothing to install" not in proc.stdout and "not ready: " in proc.stdout
    assert f"Run yourself: pip install --force-reinstall --no-deps torch_xla=={version}" in proc.stdout
    # not ready, nothing run for the user, and this process imported neither torch nor torch_xla
    assert proc.stdout.strip().splitlines()[-1] == "RESULT False 0 []"


@pytest.mark.parametrize("threads", [None, "3"])
def test_the_import_check_starts_no_inductor_compile_workers(tmp_path, threads):
    """The check's subprocess runs with TORCHINDUCTOR_COMPILE_THREADS=1 (torch_xla imports
    torch._inductor, whose worker pool costs 2.7 s of CPU); a value the user set is kept."""
    site, version = _broken_torch_xla(tmp_path)
    seen = tmp_path / "seen.txt"
    (site / "torch_xla" / "__init__.py").write_text(
        "import os, pathlib\n"
        f"pathlib.Path({str(seen)!r}).write_text(os.environ.get('TORCHINDUCTOR_COMPILE_THREADS', '-'))\n"
        "raise ImportError('recorded')\n")
    env = {k: v for k, v in _clean_env().items() if k != "TORCHINDUCTOR_COMPILE_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), env.get("PYTHONPATH", "")])
    if threads:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = threads
    data = json.loads(_cli("--json", env=env))
    assert data["torch_xla"] == version and data["import_error"] == "ImportError: recorded"
    assert seen.read_text() == (threads or "1")


def test_broken_import_advice_and_fix_message(tmp_path):
    info, *_ = detect_on(tmp_path, "kaggle-v5e-8", vers=PAIRED_28)
    assert info.ready and info.import_error is None  # faked versions: no import check
    broken = dataclasses.replace(info, import_error="ImportError: _XLAC.so: undefined symbol: x")
    adv = xenv.advise(broken)
    assert adv.kind == "broken-import" and adv.blocking and adv.pip_args is None
    assert adv.command == 'pip install --force-reinstall --no-deps "torch_xla[tpu]==2.8.0"'
    assert "undefined symbol" in xenv.xla_fix_message(broken)
    assert "FAILS" in xenv.report(dataclasses.replace(broken, next_step=adv.message))
