"""xla_utils.runtime.forksafe: no forked job inherits an OpenMP team, none is slowed for nothing.

Each test runs in a fresh interpreter (its own zygote, whose environment the
test hook must be in) that first runs parallel torch ops itself, so that the
caller owns an OpenMP team as a notebook usually does. The jobs then run
parallel CPU ops: with an inherited team they would wait forever (the launch
timeout turns that into a failure).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from xla_utils.runtime import forksafe

_JOB = textwrap.dedent("""
    import copy, json, sys, torch
    from xla_utils import runtime as rt

    torch.mm(torch.randn(512, 512), torch.randn(512, 512))  # the caller's own team
    (torch.randn(1 << 20) * 2).sum()

    def job():
        from xla_utils.runtime import forksafe
        torch.mm(torch.randn(512, 512), torch.randn(512, 512))  # hangs on an inherited team
        (torch.randn(1 << 20) * 2).sum()
        copy.deepcopy(torch.nn.Linear(512, 512))
        return {"report": forksafe.inherited_report(), "threads": torch.get_num_threads()}
""")


def _run(code: str, hook: bool) -> dict:
    env = dict(os.environ, PJRT_DEVICE="CPU")
    env.pop(forksafe.TEST_HOOK_ENV, None)
    env.pop("OMP_NUM_THREADS", None)  # a notebook's default: a team on every core (.ci/run sets 1)
    if hook:
        env[forksafe.TEST_HOOK_ENV] = "1"
    p = subprocess.run([sys.executable, "-c", _JOB + textwrap.dedent(code)], env=env,
                       capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


_SIMULATED = """
    threads = rt.launch_job(job, (), placement=rt.resolve(1, simulate=1), timeout=120,
                            sim_threads=True)
    procs = rt.launch(job, simulate=2, timeout=120)
    print(json.dumps({"threads": threads, "procs": procs, "caller": torch.get_num_threads()}))
"""


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_zygote_jobs_keep_full_parallelism_and_are_checked():
    out = _run(_SIMULATED, hook=False)
    for design in ("threads", "procs"):
        assert out[design]["report"] == {"checked": True, "new_threads": 0, "limited": False}, \
            (design, out)
        assert out[design]["threads"] == out["caller"], (design, out)


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: OpenMP starts no team")
@pytest.mark.timeout(420)
def test_a_team_in_the_zygote_is_detected_and_the_job_limited():
    # The test hook makes the zygote run parallel torch ops before each fork: the
    # check must see the team's threads and the jobs must run (not hang) limited.
    out = _run(_SIMULATED, hook=True)
    for design in ("threads", "procs"):
        report = out[design]["report"]
        assert report["checked"] and report["limited"], (design, out)
        assert report["new_threads"] >= 1, (design, out)
        assert out[design]["threads"] == 1, (design, out)


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: OpenMP starts no team")
@pytest.mark.timeout(300)
def test_tpu_style_job_forked_from_a_caller_with_a_team_runs_in_a_fresh_thread():
    # The TPU path forks the caller itself (here on XLA:CPU, cores=1: xmp.spawn
    # runs the replica in the job process). The job's work runs in a new thread:
    # full parallelism, and nothing of the caller's team to wait for.
    out = _run("""
        from xla_utils.runtime.launcher import _launch_tpu
        from xla_utils.runtime.placement import Placement
        r = _launch_tpu(job, (), Placement("xla", "tpu", 1, one_core=True), timeout=120)
        print(json.dumps({"job": r, "caller": torch.get_num_threads()}))
    """, hook=False)
    assert out["job"]["threads"] == out["caller"] >= 2, out
    assert out["job"]["report"]["limited"] is False, out
