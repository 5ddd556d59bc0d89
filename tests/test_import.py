"""`import xla_utils` and environment detection must not import torch or torch_xla
(importing torch_xla in a notebook before xmp.spawn is what breaks spawning)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBE = r"""
import json, sys
import xla_utils
after_import = sorted(m for m in ("torch", "torch_xla") if m in sys.modules)
info = xla_utils.detect()                # lazy re-export from xla_utils.env
import xla_utils.env
xla_utils.env.detect()
xla_utils.env.xla_fix_message()
assert xla_utils.EnvInfo is xla_utils.env.EnvInfo
assert xla_utils.setup is xla_utils.env.setup
after_detect = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "torch_xla", "torchvision", "libtpu"))
print(json.dumps({"after_import": after_import, "after_detect": after_detect,
                  "platform": info.platform, "torch_xla": info.torch_xla}))
"""


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_import_and_detect_do_not_import_torch():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          env=_env(), cwd=str(REPO), timeout=60)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert data["after_import"] == []
    assert data["after_detect"] == []
    # detect() did run and saw the installed torch_xla (whichever stack runs the tests) through metadata only
    assert data["torch_xla"] == metadata.version("torch_xla")


def test_cli_does_not_import_torch():
    # -X importtime lists every module the interpreter imports (on stderr); the CLI's
    # `import torch_xla` check runs in a child process, whose imports are not listed.
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "xla_utils.env", "--json"],
                          capture_output=True, text=True, env=_env(), cwd=str(REPO), timeout=300)
    assert proc.returncode == 0, proc.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "xla_utils" in imported and "importlib.metadata" in imported  # the probe works
    assert not [m for m in imported if re.match(r"(torch|torch_xla|torchvision)(\.|$)", m)]
    json.loads(proc.stdout)
