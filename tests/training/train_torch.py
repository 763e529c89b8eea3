"""train.py's twin on PyTorch, for torchrun: the same 32-64-1 MLP learning the same linear
target on CPU, data parallel over gloo (DistributedDataParallel), rank 0 checkpointing every
`--checkpoint-every` steps to a shared directory, every trainer resuming from the newest
checkpoint when the job re-forms; on SIGTERM a trainer saves the step it finished and exits 0.

torchrun gives it its rank and world through the environment (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) and starts it again after every re-formation. It prints the same JSON lines as
train.py (`start`, `step`, `saved`), which the tests read from the pods' logs. A collective that
a vanished peer leaves hanging fails after COLLECTIVE_TIMEOUT, and the trainer exits 1, so that
its launcher re-forms the job."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from trainer_io import after_step, arguments, leaving_on_sigterm, newest, publish, say

COLLECTIVE_TIMEOUT = timedelta(seconds=30)


def save(directory: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    def write(partial: Path) -> None:
        torch.save(model.state_dict(), partial / "model.pt")
        torch.save(opt.state_dict(), partial / "opt.pt")

    publish(directory, step, write)


def main() -> int:
    args = arguments(__doc__)
    leaving = leaving_on_sigterm(args.ignore_sigterm)

    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step, path = newest(args.checkpoints)
    if path is not None:
        model.load_state_dict(torch.load(path / "model.pt"))
        opt.load_state_dict(torch.load(path / "opt.pt"))
    parallel = DistributedDataParallel(model)

    def saving(at: int) -> None:
        save(args.checkpoints, at, model, opt)

    say(event="start", world=world, rank=rank, resumed_from=step)
    target = torch.arange(32, dtype=torch.float32).reshape(32, 1) / 32
    while step < args.steps:
        torch.manual_seed(step * 1000 + rank)
        x = torch.randn(16, 32)
        loss = nn.functional.mse_loss(parallel(x), x @ target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if after_step(args, leaving, (step, rank, world), float(loss), saving):
            return 0
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
