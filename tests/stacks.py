"""Which of CI's two stacks runs which test (docs/CONTRIBUTING.md "Which stack runs a test").

``.ci/run`` runs the suite on Colab's stack (torch 2.9 / torch_xla 2.9 / Python 3.13) and on
Kaggle's (torch 2.8 / torch_xla 2.8 / Python 3.11) side by side, with ``XLA_UTILS_CI_STACK``
naming the stack; ``tests/conftest.py`` then deselects the tests this table gives to the
other stack. Without ``XLA_UTILS_CI_STACK`` (a developer's ``pytest``) every test runs.

The rule (docs/CONTRIBUTING.md "Which stack runs a test"): a test runs on **both** stacks
when it tests a module that imports torch_xla, torch.distributed, multiprocessing or
subprocess, or forks (the packages env/, runtime/, simulate/ and cache/runners.py): the
stacks differ there (torch_xla 2.8/2.9 runtimes, torch 2.8/2.9 process groups, Python
3.11/3.13 forking). Also on both: the installed wheel and import-time behaviour. Each form of
multi-core program runs on both in its smallest program. The slow tests of those packages
(``@pytest.mark.slow``: the same seams again through larger programs: Ray clusters, repeated
collectives and launches, script runners) run on one stack, but for those whose subject is
itself a difference between the stacks: forking after threads (Python 3.12's warning, torch's
thread pools), the installed wheel on each Python, the notebook's CUDA query (torch's bad-fork
flag), torch_xla's own runtime checks.

A test runs on **one** stack when it reaches those only through ``xla_utils.runtime``'s
public functions, which the both-stacks tests pin down on each stack (the trainer, the LR
finder, predictions, the cache's format and storage, the data pipeline, the docs, README and
notebooks, the command line), and when it is a larger program of a form that already runs on
both. torch_xla v2.9.0's own programs (tests/simulate/test_torch_xla_corpus.py) run on torch_xla
2.9's stack. The one-stack tests are split so that the two stacks take about the same time.

Entries are path prefixes of pytest node ids; the longest matching prefix wins, so one test
(``file::name`` or ``file::name[param]``) can leave its file's stack. ``tests/test_stacks.py``
checks that every test file has an entry and that every entry names a test that exists.
"""
from __future__ import annotations

import os

__all__ = ["BOTH", "COLAB", "KAGGLE", "STACKS", "current", "markdown", "stack_of"]

STACKS = ("colab", "kaggle")

BOTH = [
    # the packages whose modules import torch_xla or torch.distributed, or start processes
    # (tests/test_stacks.py keeps this equal to the code)
    "tests/env/",
    "tests/runtime/",
    "tests/simulate/",
    "tests/cache/test_runners.py",  # the cache builder's process pool (fork, Ray)
    # the builder's pool as users meet it: forked workers and Python 3.12's fork warning
    "tests/cache/test_cache.py::test_torch_dataset_with_parallel_ops_builds_on_several_workers",
    "tests/cache/test_cache.py::test_only_the_builders_own_forks_are_quiet",
    # the installed wheel on each Python, import-time behaviour, this table
    "tests/test_install.py",
    "tests/test_import.py",
    "tests/test_stacks.py",
    # what a simulated job exposes to the network (torch_xla's and gloo's sockets)
    "tests/simulate/test_footprint.py::test_a_simulated_job_listens_on_loopback_only",
    "tests/simulate/test_footprint.py::test_an_spmd_job_listens_on_loopback_only",
    # torch.compile differs between torch 2.8 and 2.9: dynamo's graph-break report on each
    "tests/train/test_compile.py::test_check_reports_graph_breaks",
]

# One stack each.
COLAB: list[str] = [
    # torch_xla v2.9.0's own multi-core tests and examples run on torch_xla 2.9's stack; the
    # forms they use run on both in tests/simulate/test_forms.py's smaller programs
    "tests/simulate/test_torch_xla_corpus.py",
    # the slow tests of the both-stacks packages: the same seams again, through larger programs
    "tests/runtime/test_runtime.py::test_simulated_all_reduce_exact_20_times_after_a_caller_backward",
    "tests/runtime/test_runtime.py::test_simulated_launch_leaves_torch_xla_to_the_zygote",
    "tests/simulate/test_simulate.py::test_50_launches_after_caller_side_backward",
    "tests/simulate/test_simulate.py::test_function_and_model_defined_in_main_work",
    "tests/simulate/test_forms.py::test_spmd_script_gets_8_devices_and_an_8_way_sharding_via_cli",
    # a rehearsed pod slice's larger programs (its placement runs on both)
    "tests/simulate/test_pod.py::test_quick_start_on_two_hosts_equals_one_host_of_as_many_cores",
    "tests/simulate/test_pod.py::test_a_host_killed_mid_run_ends_the_slice_naming_it",
    "tests/simulate/test_pod.py::test_a_cache_only_on_the_first_host_s_disk_is_refused_on_the_second",
    "tests/simulate/test_pod.py::test_every_host_building_one_bucket_cache_builds_it_once",
    # the simulator's memory (simulate/footprint.py reaches no torch_xla): the estimate, and
    # torch_xla's DDP ResNet on 8 cores in 12 GiB (it takes turns on the corpus' memory lock)
    "tests/simulate/test_footprint.py",
    "tests/cache/",
    "tests/diagnostics/",
    "tests/train/test_lr_finder.py",
    "tests/train/test_trainer_safety.py",
    "tests/step/test_strategy.py",
    "tests/train/test_mesh_tasks.py",
    "tests/test_ci.py",
    "tests/test_docs.py",
    "tests/test_layering.py",
    "tests/test_cli.py",
    "tests/test_bench_gpu.py",
    # trainer tests that balance the two suites' times (issue 42)
    "tests/train/test_finetune.py",
    "tests/train/test_ema.py",
]

KAGGLE: list[str] = [
    # larger programs of forms that run on both in smaller ones: every form trained to the
    # one-device curve, mnist's three modes in one script, a model trained on 8 simulated
    # cores against 1 core (script and function)
    "tests/simulate/test_forms.py::test_every_form_gives_the_one_device_loss_curve",
    "tests/simulate/test_forms.py::test_mp_mnist_style_script_three_modes_agree",
    "tests/simulate/test_simulate.py::test_runner_idiom_script_8_cores_equals_1_core",
    "tests/simulate/test_simulate.py::test_launch_idiom_function_8_cores_equals_1_core",
    # the slow tests of the both-stacks packages: the same seams again, through larger programs
    "tests/cache/test_runners.py::test_ray_build_on_two_nodes_gives_the_local_bytes",
    "tests/cache/test_runners.py::test_a_killed_driver_is_rerun_to_the_same_bytes",
    "tests/runtime/test_hosts.py::test_two_torchrun_nodes_train_as_one_four_replica_run",
    "tests/simulate/test_pod.py::test_checkpoints_in_a_bucket_resume_on_every_host_and_a_local_folder_is_refused",
    "tests/simulate/test_pod.py::test_a_torch_xla_script_sees_the_slice_s_world_on_every_host",
    "tests/simulate/test_simulate.py::test_torch_xla_launch_entry_point_via_run_script[4]",
    "tests/simulate/test_forms.py::test_spmd_script_via_run_script_4_devices",
    "tests/simulate/test_forms.py::test_mixing_spmd_and_spawn_is_named",
    "tests/cache/test_runners.py::test_a_node_killed_mid_build_changes_nothing",
    "tests/simulate/test_simulate.py::test_run_script_exit_status_and_arguments",
    "tests/simulate/test_simulate.py::test_runner_reports_replica_exception_with_status_1",
    "tests/simulate/test_transport.py::test_xm_save_and_mesh_reduce_of_64_mb_on_8_cores",
    "tests/data/",
    "tests/step/",
    "tests/train/",
    "tests/train/test_compile.py",  # compile= (issue 45): its fits on torch 2.8, one test on both
    "tests/utils/",
    "tests/test_readme.py",
    "tests/test_notebooks.py",
    "tests/test_demo.py",
]


def stack_of(nodeid: str) -> str:
    """The stack that runs a test: ``"both"``, ``"colab"`` or ``"kaggle"``.

    Args:
        nodeid: pytest's node id, relative to the checkout (``tests/x/test_y.py::test_z``).

    Raises:
        KeyError: no entry covers the test (add one to this module's tables).
    """
    best, where = "", ""
    for stack, entries in (("both", BOTH), ("colab", COLAB), ("kaggle", KAGGLE)):
        for entry in entries:
            if _covers(entry, nodeid) and len(entry) > len(best):
                best, where = entry, stack
    if not where:
        raise KeyError(f"{nodeid}: no entry in tests/stacks.py gives it a stack "
                       "(docs/CONTRIBUTING.md 'Which stack runs a test')")
    return where


def _covers(entry: str, nodeid: str) -> bool:
    if not nodeid.startswith(entry):
        return False
    rest = nodeid[len(entry):]
    # a folder ends in "/", a file is followed by "::", a test by "[" (its parameters) or nothing
    return entry.endswith("/") or not rest or rest.startswith(("::", "["))


def current() -> str | None:
    """The stack this session runs as (``XLA_UTILS_CI_STACK``), or None: every test runs."""
    stack = os.environ.get("XLA_UTILS_CI_STACK") or None
    if stack is not None and stack not in STACKS:
        raise ValueError(f"XLA_UTILS_CI_STACK={stack!r}: expected one of {', '.join(STACKS)}")
    return stack


DOC = "docs/CONTRIBUTING.md"
DOC_BEGIN = "<!-- the list tests/stacks.py produces: `python tests/stacks.py --write` -->"
DOC_END = "<!-- end of the list -->"


def markdown() -> str:
    """The tables as docs/CONTRIBUTING.md lists them (between DOC_BEGIN and DOC_END)."""
    out = [DOC_BEGIN]
    for title, entries in (("Both stacks", BOTH), ("Colab's stack only", COLAB),
                           ("Kaggle's stack only", KAGGLE)):
        out += ["", f"{title}:", ""] + [f"- `{e}`" for e in entries]
    return "\n".join(out + ["", DOC_END])


if __name__ == "__main__":  # python tests/stacks.py [--write]: print the list, or write it into the doc
    import sys
    from pathlib import Path

    doc = Path(__file__).resolve().parents[1] / DOC
    if "--write" in sys.argv:
        text = doc.read_text()
        head, rest = text.split(DOC_BEGIN, 1)
        doc.write_text(head + markdown() + rest.split(DOC_END, 1)[1])
    else:
        print(markdown())
