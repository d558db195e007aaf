"""The processes of a `torchrun` launch, as a trainer sees them (`gen linearize`).

    group = join(torch.device("cuda"))     # WORLD_SIZE > 1: init_process_group; else one process
    local = group.shard(batch)             # this rank's slice of the global batch (same on every rank)
    net = group.wrap(module)               # DistributedDataParallel: gradients averaged over ranks
    if group.main: write(...)              # rank 0 alone writes files and prints
    group.close()

Under torchrun (WORLD_SIZE > 1) each process is one rank: NCCL on CUDA, each rank on
cuda:LOCAL_RANK; gloo on the CPU. Every rank draws the same global batch (same seed) and takes
its own slice of it; DistributedDataParallel averages the gradients, so with equal slices each
rank's optimizer sees the gradient of the whole batch: the run equals one process on that batch
(up to float rounding). Without WORLD_SIZE (or 1) nothing is initialised and `wrap` returns the
module unchanged.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

from engine.errors import InvalidArgumentError


@dataclass
class Group:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    owned: bool = False          # this process initialised the process group (close() ends it)

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def check_batch(self, flag: str, n: int) -> None:
        """A global batch of n rows must split evenly over the ranks (one line otherwise)."""
        if n % self.world:
            raise InvalidArgumentError(f"{flag} {n} does not split evenly over {self.world} processes; "
                                       f"give a multiple of {self.world}")

    def shard(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a global batch (rows along dim 0, a multiple of the world size)."""
        per = rows.shape[0] // self.world
        return rows[self.rank * per:(self.rank + 1) * per]

    def wrap(self, module: torch.nn.Module, find_unused_parameters: bool = False) -> torch.nn.Module:
        """DistributedDataParallel over `module` (its trainable parameters); one process: `module`."""
        if not self.distributed:
            return module
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids, find_unused_parameters=find_unused_parameters)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of a tensor over the ranks (a detached copy; itself with one process)."""
        value = value.detach()
        if not self.distributed:
            return value
        out = value.clone()
        torch.distributed.all_reduce(out)
        return out / self.world

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on one (a budget's deadline: all ranks stop at one step)."""
        if not self.distributed:
            return flag
        t = torch.tensor([int(flag)], device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item())

    def barrier(self) -> None:
        if self.distributed:
            torch.distributed.barrier(**({"device_ids": [self.device.index]} if self.device.type == "cuda" else {}))

    def close(self) -> None:
        if self.owned and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        self.owned = False


def join(device: torch.device) -> Group:
    """The group this process belongs to: one process (WORLD_SIZE unset or 1), or its rank of a torchrun
    launch, with the process group initialised (reused when the caller initialised it). `device`: the
    device asked for (cuda: each rank on cuda:LOCAL_RANK)."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return Group(device=device)
    if not torch.distributed.is_available():
        raise InvalidArgumentError(f"WORLD_SIZE={world}, but this torch build has no torch.distributed; "
                                   "run one process")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        if device.index is not None:
            raise InvalidArgumentError(f"--device {device} under torchrun: give --device cuda, and each process "
                                       f"takes cuda:LOCAL_RANK")
        if local >= torch.cuda.device_count():
            raise InvalidArgumentError(f"LOCAL_RANK {local}, but this machine has {torch.cuda.device_count()} "
                                       f"CUDA device(s); give --nproc_per_node at most that")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise InvalidArgumentError(f"--device {device} under torchrun: use cuda (NCCL) or cpu (gloo)")
    owned = False
    if not torch.distributed.is_initialized():
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "RANK") if v not in os.environ]
        if missing:
            raise InvalidArgumentError(f"WORLD_SIZE={world} but {', '.join(missing)} unset: launch with "
                                       f"torchrun --nproc_per_node N (or unset WORLD_SIZE for one process)")
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
        owned = True
    return Group(rank=torch.distributed.get_rank(), world=torch.distributed.get_world_size(), device=device,
                 owned=owned)


__all__ = ["Group", "join"]
