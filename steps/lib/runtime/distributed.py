"""Several processes, one job: the world (rank, size, device) from torchrun's environment, the
draft wrapped for data parallelism (DDP by default, FSDP for large drafts), work split across
ranks, full state dicts that do not depend on the world size, and rank-0-only writes.

Reads the variables torchrun sets (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
`MASTER_PORT`); writes nothing. Without them (the pipeline's in-process steps, the tests) the
world is one process and every helper here is a no-op, so the single-process path is the same
code with `size == 1`.

    torchrun --nproc-per-node 8 -m steps.train --config C --target T --hidden H --vocab V
    torchrun --nproc-per-node 8 -m steps.extract --config C --target T --dataset D

Conventions every caller relies on:
- Training splits the rows of each *global* batch across ranks and normalises the loss by the
  global count of predictions, so N processes take the same optimizer steps as one process on the
  same data (same loss curve, within float tolerance: tests/unit/test_distributed.py).
- Checkpoints hold full (unsharded) tensors keyed by parameter name, written by rank 0 only, so a
  run saved at one world size resumes at any other.
- Only rank 0 writes files meant for the store (logs, checkpoints, manifests); other ranks
  upload only the shards they computed (extraction) and wait at a barrier.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from torch import nn

T = TypeVar("T")
Parallel = Literal["auto", "ddp", "fsdp"]

#: a rank waits this long at a collective before failing (an extraction round on a large target is
#: minutes; a hung peer should still end the job in finite time).
TIMEOUT = dt.timedelta(minutes=60)


# --- the world ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class World:
    """This process's place in the job. Without a process group (one process) every collective is a
    no-op and nothing is wrapped."""
    rank: int
    local_rank: int
    size: int
    device: torch.device
    #: a process group is joined: always when size > 1; at size 1 only when asked (benchmarks measure
    #: the DDP/FSDP wrappers' own cost on one GPU).
    grouped: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.grouped


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def pick_device(kind: str, local_rank: int) -> torch.device:
    """`auto`: this rank's GPU when CUDA is present, else the CPU; `cuda` insists on a GPU."""
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"device={kind!r} but torch sees no CUDA device; set train.device=cpu or auto")
    if local_rank >= torch.cuda.device_count():
        raise RuntimeError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA devices are "
                           "visible; launch torchrun with --nproc-per-node <= the GPUs of this host")
    return torch.device("cuda", local_rank)


def setup(device: str = "auto", *, group: bool | None = None) -> World:
    """The world of this process; joins the process group (NCCL on GPUs, gloo on CPUs) under torchrun
    with several ranks (or with `group=True`, which needs torchrun's MASTER_ADDR/PORT even for one).

    Idempotent: a second call (train after extract in one process) reuses the group.
    """
    size = env_world_size()
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local_rank)
    group = size > 1 if group is None else group or size > 1
    if group and not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=TIMEOUT,
                                **({"device_id": dev} if dev.type == "cuda" else {}))
    if group and dist.get_world_size() != size:
        raise RuntimeError(f"WORLD_SIZE={size} but the process group has {dist.get_world_size()} ranks")
    return World(rank=rank, local_rank=local_rank, size=size, device=dev, grouped=group)


def shutdown() -> None:
    """Leave the process group (end of a torchrun `main()`, also on the way out of an exception);
    nothing when there is none. On return no gloo worker thread is still finishing a collective."""
    if dist.is_initialized():
        dist.destroy_process_group()
        _wait_for_gloo_workers()


#: gloo's collective worker threads, as torch names them (`ProcessGroupGloo::runLoop`).
_GLOO_WORKER = "pt_gloo_runloop"


def _wait_for_gloo_workers(limit_s: float = 30.0, poll_s: float = 0.01) -> None:
    """Wait (GIL released, at most `limit_s`) until gloo's worker threads of this process are parked.

    Why: destroy_process_group() only drops torch.distributed's own references; the gloo group and its
    worker threads live on as long as anything holds it, and FSDP2 leaves holders that neither we nor
    gc can reach (e.g. DTensor's sharding caches keep its DeviceMesh, which keeps the group). A worker thread
    frees the last reference to a finished collective (with its tensors) only *after* waking the
    caller, and freeing a tensor that Python has seen takes the GIL. When the process exits right
    after a collective (an exception or Ctrl-C between steps) and that worker has not run yet (a
    loaded machine), it takes the GIL during interpreter finalization; CPython then ends the thread
    with pthread_exit, whose unwinding through gloo's noexcept ~AsyncWork calls std::terminate:
    "terminate called without an active exception", SIGABRT (torch issue #190489). So, before letting
    the interpreter finalize, sleep until every gloo worker is asleep and has not been woken for one
    poll (a worker waiting for the GIL gets it during our sleeps). Linux only (/proc); elsewhere, or
    without gloo threads (NCCL, or a group that destroy did free), this returns at once."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return
    workers = [t for t in tasks.iterdir() if _read(t / "comm").strip() == _GLOO_WORKER]
    deadline, before = time.monotonic() + limit_s, None
    while workers and time.monotonic() < deadline:
        time.sleep(poll_s)
        now = [_thread_state(t) for t in workers]
        if now == before and all(state in "SD" for state, *_ in now):
            return
        before = now


def _thread_state(task: Path) -> tuple[str, str, str]:
    """(state letter, voluntary and involuntary context switches so far) of one thread; a thread
    that has ended reads as asleep."""
    fields = {k: v.strip() for k, _, v in (line.partition(":") for line in _read(task / "status").splitlines())}
    return (fields.get("State", "S")[:1] or "S", fields.get("voluntary_ctxt_switches", ""),
            fields.get("nonvoluntary_ctxt_switches", ""))


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:                                     # the thread ended meanwhile
        return ""


# --- collectives (no-ops for one process) ------------------------------------------------------------

def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def all_reduce_sum(world: World, values: Sequence[float]) -> list[float]:
    """Element-wise sum over ranks of a short list of numbers (counts, loss parts), float64."""
    if not world.distributed:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_comm_device(world))
    dist.all_reduce(t)
    return t.tolist()


def all_gather_object(world: World, obj: T) -> list[T]:
    """Every rank's `obj` (small JSON-like records), in rank order."""
    if not world.distributed:
        return [obj]
    out: list[Any] = [None] * world.size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(world: World, obj: T | None) -> T:
    """Rank 0's `obj` on every rank (small JSON-like records)."""
    if not world.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def follow_batches(world: World, forward: Callable[[Any], Any]) -> int:
    """Ranks > 0 of a collective forward: run `forward` on each batch rank 0 broadcasts until it broadcasts
    None (`release_followers`); the number of batches run. Their outputs are dropped: rank 0 writes."""
    batches = 0
    while (batch := broadcast_object(world, None)) is not None:
        forward(batch)
        batches += 1
    return batches


def release_followers(world: World) -> None:
    """Rank 0: no more batches (also after a failure, so that no rank waits for a forward forever)."""
    if world.distributed:
        broadcast_object(world, None)


def solo(world: World) -> World:
    """This rank as a world of its own: collectives are no-ops (the one writer of a tensor-parallel job)."""
    return World(rank=0, local_rank=world.local_rank, size=1, device=world.device)


def _comm_device(world: World) -> torch.device:
    # NCCL only moves device tensors; gloo only host tensors.
    return world.device if world.device.type == "cuda" else torch.device("cpu")


# --- splitting work ----------------------------------------------------------------------------------

def split_range(n: int, world: World) -> range:
    """This rank's contiguous block of `range(n)`; blocks differ in length by at most one."""
    base, extra = divmod(n, world.size)
    start = world.rank * base + min(world.rank, extra)
    return range(start, start + base + (1 if world.rank < extra else 0))


def split_contiguous(items: Sequence[T], world: World) -> list[T]:
    """This rank's contiguous block of `items` (extraction: a shard range per rank)."""
    r = split_range(len(items), world)
    return list(items[r.start:r.stop])


def split_strided(items: Sequence[T], world: World) -> list[T]:
    """Every `size`-th item from `rank` (training: rows of one global batch, balanced in length)."""
    return list(items[world.rank::world.size])


# --- wrapping the model -----------------------------------------------------------------------------

def trainable_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def choose_parallel(parallel: Parallel, model: nn.Module, *, fsdp_min_params: int) -> str:
    """`auto` → fsdp for drafts of at least `fsdp_min_params` trainable parameters, else ddp.

    AdamW in fp32 costs 16 bytes per trainable parameter (weight, grad, two moments): an 8B-shaped
    draft (~0.43B) needs ~7 GB per replica, where DDP is simplest and fastest; a 7168-wide draft with
    a 32k vocab (~1B) needs ~16 GB per replica beside its frozen 163k-row embedding, so sharding pays."""
    if parallel != "auto":
        return parallel
    return "fsdp" if trainable_params(model) >= fsdp_min_params else "ddp"


def parallelize(module: nn.Module, world: World, mode: str, *, shard: Sequence[nn.Module] = ()) -> nn.Module:
    """The module to call for a data-parallel step (`module` itself for one process).

    ddp: a replica per rank, gradients all-reduced (averaged) in backward.
    fsdp: FSDP2 `fully_shard` on each module of `shard` (own all-gather group, e.g. the decoder
    layer) and then on `module` (the rest: fc, norm, lm_head, the frozen embedding); parameters,
    gradients and optimizer state are sharded, gradients reduce-scattered (averaged).
    Only `module.forward` may be called on the result (its hooks do the communication); build the
    optimizer afterwards, from `module.parameters()` (FSDP replaces them with sharded ones).
    """
    if not world.distributed:
        return module
    module.to(world.device)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(module, device_ids=[world.device.index] if world.device.type == "cuda" else None)
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for sub in shard:
            fully_shard(sub)
        fully_shard(module)
        return module
    raise ValueError(f"train.parallel={mode!r}: expected one of auto, ddp, fsdp")


def full_state(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> tuple[dict, dict | None]:
    """(model state, optimizer state keyed by parameter name), unsharded on the CPU: the same layout for
    1 process, DDP and FSDP, so a checkpoint resumes at any world size. Collective under FSDP: every
    rank calls it; the tensors are meant for rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if opt is None:
        return get_model_state_dict(model, options=opts), None
    return get_state_dict(model, opt, options=opts)


def load_full_state(model: nn.Module, opt: torch.optim.Optimizer, model_state: dict, opt_state: dict) -> None:
    """Load what `full_state` returned (every rank passes the full tensors)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, opt, model_state_dict=model_state, optim_state_dict=opt_state,
                   options=StateDictOptions(full_state_dict=True))


# --- rank-0-only output ------------------------------------------------------------------------------

class _SilentBar:
    """What ranks other than 0 get instead of a progress bar: one bar per job, not per GPU."""

    def update(self, n: float = 1) -> None:
        pass

    def set_postfix(self, **kwargs: object) -> None:
        pass

    def set_note(self, **fields: object) -> None:
        pass


def progress_bar(world: World, *, total: float, desc: str, unit: str, initial: float = 0):
    """`steps.lib.runtime.progress.bar(...)` on rank 0 (terminal + listeners), a silent stand-in elsewhere."""
    from contextlib import nullcontext

    from steps.lib.runtime import progress

    if world.is_main:
        return progress.bar(total=total, desc=desc, unit=unit, initial=initial)
    return nullcontext(_SilentBar())
