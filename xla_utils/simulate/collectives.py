"""Host collectives inside a simulated replica process: torch_xla patched.

:func:`_patch_torch_xla` replaces torch_xla's world queries and collectives in
the replica with versions that report the simulated world and exchange CPU
copies of the tensors through files in the job's shared-memory folder, after
every rank has recorded its arrival in the store (:func:`_arrive`), so that a
rank-dependent collective is a named :class:`CollectiveError`, never a hang.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from typing import Any, Callable, Iterable, Iterator

from .compiled import patch_torch_compile
from .ddp import refresh_grad_views, track_ddp
from .dist import DIST_DIRS, patch_distributed
from .protocol import (ABORT, SEP, WAIT_SLICE_S, CollectiveError, PeerFailed, arrival_key,
                       finished_key, read_payload, rendezvous_name, td, tensor_name, timeout_s,
                       write_payload)

# Frames in these folders are xla_utils' own (a call site is the frame before them).
_RUNTIME_DIR = os.path.join("xla_utils", "runtime", "")
_SIMULATE_DIR = os.path.join("xla_utils", "simulate", "")
_DYNAMO_DIR = os.path.join("torch", "_dynamo", "")


class _World:
    """This replica's view of the simulated world (set by _replica_main)."""

    rank = 0
    size = 1
    store = None
    seq = 0
    shm = ""  # folder (on /dev/shm) where replicas publish collective inputs
    files: dict = {}  # seq -> this rank's published files


_SYNCS: list = []


def _profile_sync() -> None:
    import torch_xla

    orig = torch_xla.sync

    def sync(*a, **k):
        t = time.perf_counter()
        orig(*a, **k)
        _SYNCS.append((t, time.perf_counter() - t))

    torch_xla.sync = sync


def _profile_report(rank: int) -> None:
    """XLA_UTILS_SIM_PROFILE=1: median phase times (ms) of the gradient all-reduces
    after the first 20 (steady state), printed to stderr."""
    import statistics

    rows = [r for r in _PROF if r[0] > 1 and len(r) == 8][20:]
    if not rows:
        return
    med = lambda i: 1000 * statistics.median(r[i] for r in rows)  # noqa: E731
    gaps = [rows[k + 1][1] - sum(rows[k + 1][2:5]) - rows[k][7] for k in range(len(rows) - 1)]
    syncs = [d for t, d in _SYNCS if t > rows[0][1]]
    print(f"[sim-profile rank {rank}] {len(rows)} grad all-reduces: materialize {med(2):.1f} "
          f"to-cpu {med(3):.1f} arrive(wait) {med(4):.1f} collect+reduce {med(5):.1f} "
          f"to-device {med(6):.1f}; between all-reduces {1000 * statistics.median(gaps):.1f}; "
          f"sync {1000 * statistics.median(syncs):.1f} ms", file=sys.stderr, flush=True)


def _call_site() -> tuple[str, str]:
    """(API name, user file:line) of the collective being entered: the outermost
    torch_xla / xla_utils.runtime frame and the frame that called it."""
    # Frames from _arrive's caller outwards, without reading source lines (this
    # runs at every collective of every replica).
    frames = traceback.StackSummary.extract(traceback.walk_stack(sys._getframe(2)),
                                            lookup_lines=False)
    frames.reverse()
    api, where = "collective", "?"
    for i in range(len(frames) - 1, -1, -1):
        f = frames[i]
        lib = ("torch_xla" in f.filename or _SIMULATE_DIR in f.filename
               or _RUNTIME_DIR in f.filename or _DYNAMO_DIR in f.filename
               or any(d in f.filename for d in DIST_DIRS))
        if not lib:
            where = f"{f.filename}:{f.lineno}"
            if i + 1 < len(frames):
                nxt = frames[i + 1]
                # torch.distributed's functions are wrapped (c10d_logger's `wrapper`)
                for f2 in frames[i + 1:]:
                    if f2.name not in ("wrapper", "inner", "_fn"):
                        nxt = f2
                        break
                mod = ("xla_utils.runtime" if _RUNTIME_DIR in nxt.filename else
                       "dist" if any(d in nxt.filename for d in DIST_DIRS) else "xm")
                # our replacements of torch_xla's collectives are _sim_<name>
                api = f"{mod}.{nxt.name.removeprefix('_sim_')}"
            break
    return api, where


def _arrive(kind: str, signature: str, data: list | None = None,
            blob: bytes | None = None) -> int:
    """Record this replica's arrival at its next collective and wait for all ranks.

    ``data`` (CPU tensors) is published for the others first (see _publish).
    Returns the collective's sequence number. Raises CollectiveError (mismatch,
    peers gone, timeout) or PeerFailed (another replica failed first).
    """
    w = _World
    store, n, r = w.store, w.size, w.rank
    seq = w.seq = w.seq + 1
    api, where = _call_site()
    if data:
        _publish(seq, data)
    if blob is not None:
        w.files.setdefault(seq, []).append(write_payload(w.shm, rendezvous_name(seq, r), blob))
    mine = SEP.join((kind, signature, api, where))
    store.set(arrival_key(seq, r), mine)
    keys = [arrival_key(seq, k) for k in range(n)]
    timeout = timeout_s()
    t0 = time.monotonic()
    gone_since = None
    while True:
        # Blocks in the store until the last rank arrives (no polling delay);
        # every WAIT_SLICE_S it looks for failed, returned or missing peers.
        try:
            store.wait(keys, td(WAIT_SLICE_S))
            break
        except RuntimeError:  # DistStoreError: not all arrived yet
            if store.check(keys):
                break
        if store.check([ABORT]):
            raise PeerFailed(f"stopped in {api} at {where}: "
                              f"{store.get(ABORT).decode()} (see that replica's error)")
        # Finished first, arrivals second: a rank arrives before it finishes, so one
        # seen finished and then not arrived never will (read the other way round, a
        # peer that arrives, passes and returns between the two reads looks gone).
        finished = {k for k in range(n) if store.check([finished_key(k)])}
        missing = [k for k in range(n) if not store.check([arrival_key(seq, k)])]
        if not missing:
            break
        gone = [k for k in missing if k in finished]
        now = time.monotonic()
        if gone and gone_since is None:
            gone_since = now
        # A peer that returned never arrives; give the other missing ones a
        # moment to return too, so that the message says where everyone is.
        if (gone and (len(gone) == len(missing) or now - gone_since > 2.0)) \
                or now - t0 > timeout:
            raise CollectiveError(_where_message(seq, api, where, gone, now - t0, timeout))
    others = [v.decode() for v in _multi_get(store, keys)]
    sigs = {tuple(o.split(SEP)[:2]) for o in others}
    if len(sigs) > 1:
        lines = []
        for k, o in enumerate(others):
            kd, sg, ap, wh = o.split(SEP)
            lines.append(f"  rank {k}: {ap} ({f'{kd} {sg}'.strip()}) at {wh}")
        raise CollectiveError(
            f"simulated replicas reached different collectives as collective #{seq}: "
            "rank-dependent code (an `if` on the rank or on data around a collective), "
            "which hangs or corrupts a real multi-core run too. Where each rank is:\n"
            + "\n".join(lines))
    # Everyone has passed collective seq - 1 (and read its payloads and tensors):
    # free this rank's keys and files of it.
    for path in w.files.pop(seq - 1, ()):
        with contextlib.suppress(OSError):
            os.unlink(path)
    if seq > 1:
        with contextlib.suppress(Exception):
            store.delete_key(arrival_key(seq - 1, r))
    return seq


def _multi_get(store, keys: list[str]) -> list[bytes]:
    if hasattr(store, "multi_get"):
        return store.multi_get(keys)
    return [store.get(k) for k in keys]


def _where_message(seq: int, api: str, where: str, gone: list[int], waited: float,
                   timeout: float) -> str:
    w = _World
    arrived = [k for k in range(w.size) if w.store.check([arrival_key(seq, k)])]
    missing = [k for k in range(w.size) if k not in arrived]
    returned = [k for k in missing if w.store.check([finished_key(k)])]
    running = [k for k in missing if k not in returned]
    details = []
    if returned:
        details.append(f"ranks {returned} had returned from the replica function")
    if running:
        last = None
        prev = arrival_key(seq - 1, running[0])
        if seq > 1 and w.store.check([prev]):
            last = w.store.get(prev).decode().split(SEP)
        details.append(f"ranks {running} are still running" + (
            f" (rank {running[0]}'s last collective was {last[2]} at {last[3]})" if last else
            " (no collective since)"))
    why = ("other ranks returned without reaching it" if gone else
           f"the others did not arrive within {timeout:g} s "
           "(XLA_UTILS_COLLECTIVE_TIMEOUT)")
    return (f"rank {w.rank} waited {waited:.1f} s in {api} at {where} (collective #{seq}); "
            f"{why}. Ranks arrived: {arrived}; missing: {missing}: " + "; ".join(details)
            + ". Every replica must call the same collectives in the same order: look for "
            "a collective inside a rank-dependent `if` (e.g. `if xm.is_master_ordinal():`).")


_WARNED_FULL_GRAPH: list = []


@contextlib.contextmanager
def _host_exchange():
    """Allow graph execution during a host collective.

    Inside ``torch_xla.compile(full_graph=True)`` torch_xla forbids executing a
    graph before the step's end; a host collective must run the pending graph to
    read its inputs. It is allowed here, and one warning says what is then not
    checked (the step is still traced and run by XLA, numbers are unchanged).
    """
    import torch_xla

    allowed = torch_xla._XLAC._get_allow_execution()
    if not allowed:
        if not _WARNED_FULL_GRAPH and _World.rank == 0:
            print("xla_utils.simulate: warning: torch_xla.compile(full_graph=True) is not "
                  "checked on simulated cores: the step's collectives are host exchanges, "
                  "which run the step as several graphs (on a TPU it must be one graph; "
                  "run it on a TPU to check that). The numbers are unchanged.",
                  file=sys.stderr, flush=True)
        _WARNED_FULL_GRAPH.append(1)
        torch_xla._XLAC._set_allow_execution(True)
    try:
        yield
    finally:
        if not allowed:
            torch_xla._XLAC._set_allow_execution(False)


def _materialize() -> None:
    """Run the pending graph (without step closures), so that reading collective
    inputs is a transfer, not a recomputation of the forward/backward. DDP's
    gradient views are brought up to date first (:mod:`.ddp`: else the graph
    outputs a copy of a bucket per parameter)."""
    import torch_xla

    refresh_grad_views()
    torch_xla._XLAC._xla_step_marker(torch_xla._XLAC._xla_get_default_device(), [], wait=False)


def _group_of(groups, api: str) -> list[int]:
    """The ranks of this replica's replica group, in group order (all ranks when
    ``groups`` is empty). ``groups`` must partition the ranks into equal groups,
    as XLA requires."""
    n = _World.size
    if not groups:
        return list(range(n))
    groups = [list(map(int, g)) for g in groups]
    flat = sorted(r for g in groups for r in g)
    if flat != list(range(n)) or len({len(g) for g in groups}) != 1:
        raise ValueError(
            f"{api}(groups={groups}): replica groups must split the {n} replicas "
            f"(0..{n - 1}) into groups of equal size, each replica in exactly one group")
    return next(g for g in groups if _World.rank in g)


def _gsig(groups) -> str:
    return f"groups={[list(g) for g in groups]}|" if groups else ""


def _sig(tensors: list) -> str:
    return ";".join(f"{tuple(t.shape)}:{str(t.dtype).replace('torch.', '')}" for t in tensors)


def _wire(t):
    """A CPU tensor as a numpy array (bfloat16 travels as its int16 bits)."""
    import torch

    t = t.detach().contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def _publish(seq: int, data: list) -> None:
    """Write this rank's CPU tensors for collective ``seq`` to shared memory.

    Every rank reads every rank's file once all have arrived (one barrier, no
    ring of sequential messages: on a 2-core host the N replica processes then
    need not be scheduled one after another). Files are deleted by their writer
    after the next collective, when everyone has read them.
    """
    w = _World
    paths = w.files.setdefault(seq, [])
    for i, t in enumerate(data):
        path = os.path.join(w.shm, tensor_name(seq, w.rank, i))
        _wire(t).tofile(path)
        paths.append(path)


def _collect(seq: int, i: int, like, ranks: list[int] | None = None) -> list:
    """Tensor ``i`` of collective ``seq`` of each of ``ranks`` (default all), in
    that order (same shape/dtype as ``like``)."""
    return list(_each_rank(seq, i, like, ranks))


def _each_rank(seq: int, i: int, like, ranks: list[int] | None = None) -> Iterator:
    """:func:`_collect`, one rank's tensor at a time (read when it is needed)."""
    import numpy as np
    import torch

    w = _World
    for k in (range(w.size) if ranks is None else ranks):
        if k == w.rank:
            yield like
            continue
        arr = np.fromfile(os.path.join(w.shm, tensor_name(seq, k, i)), dtype=_wire(like[:0]).dtype)
        t = torch.from_numpy(arr)
        yield (t.view(torch.bfloat16) if like.dtype == torch.bfloat16 else t).view(like.shape)


def _to_cpu_batched(tensors: list) -> list:
    """CPU copies of ``tensors`` (XLA or CPU), the XLA ones in one batched transfer."""
    import torch_xla

    xla = [i for i, t in enumerate(tensors) if t.device.type == "xla"]
    out = [t.detach() if t.device.type == "cpu" else None for t in tensors]
    if xla:
        for i, c in zip(xla, torch_xla._XLAC._xla_get_cpu_tensors([tensors[i].detach()
                                                                   for i in xla])):
            out[i] = c
    return [o if o is not None else t.detach().to("cpu") for o, t in zip(out, tensors)]


def _flat_groups(tensors: list) -> tuple[list, list]:
    """CPU copies of ``tensors`` flattened into one buffer per dtype: (buffers, index lists)."""
    import torch

    by_dtype: dict = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    # One batched device-to-host transfer for all tensors (not one per tensor).
    host = _to_cpu_batched(tensors)
    bufs, groups = [], []
    for idx in by_dtype.values():
        cpu = [host[i].reshape(-1) for i in idx]
        bufs.append(torch.cat(cpu) if len(cpu) > 1 else cpu[0].clone())
        groups.append(idx)
    return bufs, groups


def _reduce(reduce_type: str, parts: Iterable):
    """Reduce the ranks' buffers in rank order (identical result on every rank).
    ``parts`` may be an iterator: each is read when it is added (one bucket in
    memory, not one per rank)."""
    import torch

    parts = iter(parts)
    first = next(parts)
    dtype = first.dtype
    acc_dtype = torch.float32 if dtype in (torch.bfloat16, torch.float16) else (
        torch.int32 if dtype == torch.bool else dtype)
    acc = first.to(acc_dtype).clone()
    for p in parts:
        p = p.to(acc_dtype)
        if reduce_type == "sum":
            acc += p
        elif reduce_type == "mul":
            acc *= p
        elif reduce_type in ("min", "and"):
            acc = torch.minimum(acc, p)
        elif reduce_type in ("max", "or"):
            acc = torch.maximum(acc, p)
        else:
            raise ValueError(f"unknown reduce_type {reduce_type!r}")
    return acc


# XLA_UTILS_SIM_PROFILE=1: each replica times the phases of its gradient all-reduces
# and prints their medians to stderr when its function returns (a debugging aid).
_PROF: list | None = [] if os.environ.get("XLA_UTILS_SIM_PROFILE") else None


def _host_all_reduce(reduce_type: str, tensors: list, scale: float, api_sig: str,
                     group: list[int] | None = None) -> list:
    """Arrive at the collective, then all-reduce CPU copies of ``tensors`` over the
    ranks of ``group`` (default all); CPU results."""
    with _host_exchange():
        return _host_all_reduce_body(reduce_type, tensors, scale, api_sig, group)


def _host_all_reduce_body(reduce_type: str, tensors: list, scale: float, api_sig: str,
                          group: list[int] | None) -> list:
    if reduce_type not in ("sum", "mul", "min", "max", "and", "or"):
        raise ValueError(f"unknown reduce_type {reduce_type!r}")
    t0 = time.perf_counter()
    _materialize()
    t1 = time.perf_counter()
    bufs, groups = _flat_groups(tensors)
    t2 = time.perf_counter()
    seq = _arrive("all_reduce" if api_sig.startswith("all_reduce") else "reduce_scatter",
                  api_sig.split(":", 1)[1], bufs)
    t3 = time.perf_counter()
    if _PROF is not None:
        _PROF.append((len(tensors), t3, t1 - t0, t2 - t1, t3 - t2))
    out: list = [None] * len(tensors)
    for gi, (buf, idx) in enumerate(zip(bufs, groups)):
        work = _reduce(reduce_type, _each_rank(seq, gi, buf, group))
        if scale != 1.0:
            work = work * scale
        work = work.to(buf.dtype)
        pos = 0
        for i in idx:
            numel = tensors[i].numel()
            out[i] = work[pos:pos + numel].view(tensors[i].shape)
            pos += numel
    return out


def _to_device(cpu_tensors: list, device) -> list:
    import torch_xla.core.xla_model as xm

    return xm.send_cpu_data_to_device(list(cpu_tensors), device)


def _patch_torch_xla(rank: int, n: int, local: int | None = None, local_n: int | None = None,
                     host: int = 0) -> None:
    """Make this process's torch_xla report and reduce over the simulated world: global
    ordinal ``rank`` of ``n``; on a rehearsed pod slice, core ``local`` of ``local_n`` on host
    ``host`` (default: one host, ``local == rank``)."""
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    local = rank if local is None else local
    local_n = n if local_n is None else local_n
    xr.world_size = lambda: n
    xr.global_ordinal = lambda: rank
    xr.local_ordinal = lambda: local
    xr.local_process_count = lambda: local_n
    xr.global_device_count = lambda: n
    xr.process_index = lambda: rank  # one process per device, as xmp.spawn on a TPU VM
    xr.process_count = lambda: n
    xr.host_index = lambda: host
    xr._WORLD_SIZE, xr._ORDINAL = n, rank
    for name, value in (("get_ordinal", lambda local=False: rank),
                        ("xrt_world_size", lambda: n)):
        if hasattr(xm, name):
            setattr(xm, name, value)
    patch_distributed(rank, n, _World.store)
    track_ddp()
    if n == 1:
        return  # torch_xla's own collectives are no-ops on one device
    _sim_rendezvous.__wrapped__ = xm.rendezvous
    xm.all_to_all = _sim_all_to_all
    xm.collective_permute = _sim_collective_permute
    xm.send = _unsupported("xm.send", "use xm.all_gather (or xm.rendezvous for bytes)")
    xm.recv = _unsupported("xm.recv", "use xm.all_gather (or xm.rendezvous for bytes)")
    xr.use_spmd = _spmd_in_replica
    xm.all_reduce = _sim_all_reduce
    xm.all_gather = _sim_all_gather
    xm.reduce_scatter = _sim_reduce_scatter
    xm.rendezvous = _sim_rendezvous
    patch_torch_compile(rank, {"all_reduce": _sim_all_reduce, "all_gather": _sim_all_gather,
                               "reduce_scatter": _sim_reduce_scatter,
                               "all_to_all": _sim_all_to_all,
                               "collective_permute": _sim_collective_permute,
                               "rendezvous": _sim_rendezvous})
    xm.xla_rendezvous = lambda payload=b"", ordinals=None, tag=None: _sim_rendezvous(
        tag or "", payload, ordinals or [])


def _spmd_in_replica(*args, **kwargs):
    raise RuntimeError(
        "xr.use_spmd() inside a simulated xmp.spawn / torch_xla.launch replica: a program "
        "is either SPMD (one process, all devices) or multi-process, not both. Run an "
        "SPMD program as SPMD: `python -m xla_utils.simulate --form spmd --cores N "
        "script.py` (or run_script(..., form='spmd')), which gives it N XLA:CPU devices "
        "in one process; do not call it from xmp.spawn / torch_xla.launch.")


def _unsupported(api: str, alternative: str) -> Callable[..., Any]:
    def fail(*args, **kwargs):
        raise NotImplementedError(
            f"{api} is not simulated on XLA:CPU replicas (it needs a real device mesh); "
            f"{alternative}")
    return fail


def _copy_into(output, single: bool, moved: list):
    """``output`` (a tensor or a list) filled in place with ``moved``; returned."""
    import torch

    outs = [output] if single else list(output)
    with torch.no_grad():
        for o, m in zip(outs, moved):
            if o.shape == m.shape:
                o.copy_(m)
            else:  # torch_xla's *_out collectives give the output the result's shape
                o.data = m.to(o.dtype)
    return output


# torch_xla's signatures, replaced inside simulated replicas (see _patch_torch_xla).
def _sim_all_reduce(reduce_type, inputs, scale=1.0, groups=None, pin_layout=True):
    import torch

    group = _group_of(groups, "xm.all_reduce")
    single = isinstance(inputs, torch.Tensor)
    tensors = [inputs] if single else list(inputs)
    if not tensors:
        return inputs
    cpu = _host_all_reduce(reduce_type, tensors, scale,
                           f"all_reduce:{reduce_type}|{scale}|{_gsig(groups)}{_sig(tensors)}",
                           group)
    t4 = time.perf_counter()
    moved = _to_device(cpu, tensors[0].device)
    if single:
        return moved[0]
    _copy_into(inputs, False, moved)
    if _PROF is not None:
        _PROF[-1] += (t4 - _PROF[-1][1], time.perf_counter() - t4, time.perf_counter())
    return inputs


def _sim_all_gather(value, dim=0, groups=None, output=None, pin_layout=True, channel_id=None,
                    use_global_device_ids=None):
    import torch

    group = _group_of(groups, "xm.all_gather")
    single = isinstance(value, torch.Tensor)
    tensors = [value] if single else list(value)
    with _host_exchange():
        _materialize()
        cpu = [t.detach().to("cpu").contiguous() for t in tensors]
        seq = _arrive("all_gather", f"{dim}|{_gsig(groups)}{_sig(tensors)}", cpu)
    results = [torch.cat(_collect(seq, i, c, group), dim=dim if dim >= 0 else c.dim() + dim)
               for i, c in enumerate(cpu)]
    moved = _to_device(results, tensors[0].device)
    if output is not None:
        return _copy_into(output, single, moved)
    return moved[0] if single else moved


def _sim_reduce_scatter(reduce_type, input, scale, scatter_dim, shard_count, groups=None,
                        output=None, pin_layout=True, channel_id=None,
                        use_global_device_ids=None):
    import torch

    group = _group_of(groups, "xm.reduce_scatter")
    n = len(group)
    if shard_count != n:
        raise ValueError(f"xm.reduce_scatter(shard_count={shard_count}) on {_World.size} "
                         f"simulated cores (groups={groups}): shard_count must equal the "
                         f"number of replicas in a group ({n})")
    single = isinstance(input, torch.Tensor)
    tensors = [input] if single else list(input)
    reduced = _host_all_reduce(
        reduce_type, tensors, scale,
        f"reduce_scatter:{reduce_type}|{scale}|{scatter_dim}|{_gsig(groups)}{_sig(tensors)}",
        group)
    me = group.index(_World.rank)
    shards = [torch.chunk(c, n, dim=scatter_dim)[me].contiguous() for c in reduced]
    moved = _to_device(shards, tensors[0].device)
    if output is not None:
        return _copy_into(output, single, moved)
    return moved[0] if single else moved


def _sim_rendezvous(tag, payload=b"", replicas=[]):  # noqa: B006 (torch_xla's signature)
    import torch_xla

    n = _World.size
    if replicas and len(replicas) != n:
        # torch_xla's PJRT rendezvous raises the same type
        raise ValueError(f"Only global rendezvous is supported: xm.rendezvous(tag={tag!r}, "
                         f"replicas={replicas}) names {len(replicas)} of the {n} replicas")
    if not isinstance(payload, bytes):
        raise TypeError(f"`payload` must be bytes, not {type(payload)}")
    torch_xla.sync()  # as torch_xla's rendezvous does
    # Payloads travel as files (no size limit; a store value is limited to 8 MiB),
    # deleted by their writer after its next collective, when all have read them.
    seq = _arrive("rendezvous", "", blob=payload)
    return [payload if k == _World.rank else read_payload(_World.shm, rendezvous_name(seq, k))
            for k in range(n)]


def _publish_one(api: str, signature: str, value) -> tuple[int, Any]:
    """Publish ``value``'s CPU copy for a point-to-point style collective."""
    with _host_exchange():
        _materialize()
        cpu = value.detach().to("cpu").contiguous()
        return _arrive(api, signature, [cpu]), cpu


def _sim_all_to_all(value, split_dimension, concat_dimension, split_count, groups=None,
                    pin_layout=True):
    """``xm.all_to_all``: chunk ``j`` of each group member's ``value`` (split along
    ``split_dimension`` into ``split_count``) goes to member ``j``; the received
    chunks are concatenated along ``concat_dimension`` in member order."""
    import torch

    group = _group_of(groups, "xm.all_to_all")
    if split_count != len(group):
        raise ValueError(f"xm.all_to_all(split_count={split_count}) on {_World.size} simulated "
                         f"cores (groups={groups}): split_count must equal the number of "
                         f"replicas in a group ({len(group)})")
    seq, cpu = _publish_one(
        "all_to_all", f"{split_dimension}|{concat_dimension}|{_gsig(groups)}{_sig([value])}",
        value)
    me = group.index(_World.rank)
    parts = [torch.chunk(v, split_count, dim=split_dimension)[me]
             for v in _collect(seq, 0, cpu, group)]
    return _to_device([torch.cat(parts, dim=concat_dimension)], value.device)[0]


def _sim_collective_permute(value, pairs):
    """``xm.collective_permute``: each ``[source, target]`` pair sends the source's
    ``value`` to the target; a replica that is no target gets zeros (as XLA)."""
    import torch

    pairs = [tuple(map(int, p)) for p in pairs]
    seq, cpu = _publish_one("collective_permute", f"{sorted(pairs)}|{_sig([value])}", value)
    sources = [s for s, d in pairs if d == _World.rank]
    if len(sources) > 1:
        raise ValueError(f"xm.collective_permute(pairs={[list(p) for p in pairs]}): replica "
                         f"{_World.rank} is the target of {len(sources)} pairs; at most one")
    out = _collect(seq, 0, cpu, sources)[0] if sources else torch.zeros_like(cpu)
    return _to_device([out], value.device)[0]
