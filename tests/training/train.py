"""A small data-parallel trainer for the training-through-faults tests: a 32-64-1 MLP learning a
fixed linear target on CPU (gloo), rank 0 checkpointing every `--checkpoint-every` steps to a
shared directory, every trainer resuming from the newest checkpoint when the job re-forms.

On SIGTERM (Kubernetes' notice that the pod is going: an eviction, a graceful restart) a trainer
of any rank saves the step it finished last (data parallel: every rank holds the same model) and
exits 0, so the job resumes from exactly there: the few lines a user adds to their own trainer.
`--ignore-sigterm` leaves that out, as a trainer that does not save would.

It prints one JSON object per line, which the tests read from the pods' logs:
`{"event": "start", "world": W, "rank": R, "resumed_from": N}` once per (re)formation and
`{"event": "step", "step": N, "world": W, "rank": R, "loss": L}` every `--report-every` steps,
`{"event": "saved", "step": N, ...}` when it saved on SIGTERM, each with `"t"` (Unix time). It
exits 0 after `--steps` steps."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import paddle
import paddle.distributed as dist


def say(**fields: object) -> None:
    print(json.dumps({"t": round(time.time(), 3), **fields}), flush=True)


def newest(directory: Path) -> tuple[int, Path | None]:
    found = sorted(
        (int(p.name.split("-")[1]), p) for p in directory.glob("step-*") if p.name[5:].isdigit()
    )
    return found[-1] if found else (0, None)


def save(
    directory: Path, step: int, model: paddle.nn.Layer, opt: paddle.optimizer.Optimizer
) -> None:
    final = directory / f"step-{step}"
    if final.exists():
        return  # saved before a re-formation resumed from an older one
    # A trainer leaving on SIGTERM may save the same step as rank 0: each writes its own copy.
    partial = directory / f".partial-{step}-{os.getpid()}"
    partial.mkdir(parents=True, exist_ok=True)
    paddle.save(model.state_dict(), str(partial / "model.pdparams"))
    paddle.save(opt.state_dict(), str(partial / "opt.pdopt"))
    try:
        partial.rename(final)
    except OSError:
        if not final.exists():
            raise  # not the other copy's arrival: a real failure


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoints", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--report-every", type=int, default=10)
    parser.add_argument("--step-seconds", type=float, default=0.02, help="pause per step")
    parser.add_argument("--ignore-sigterm", action="store_true", help="do not save on SIGTERM")
    args = parser.parse_args()
    leaving = threading.Event()
    if not args.ignore_sigterm:
        signal.signal(signal.SIGTERM, lambda _signum, _frame: leaving.set())

    dist.init_parallel_env()
    world, rank = dist.get_world_size(), dist.get_rank()
    paddle.seed(1)
    model = paddle.nn.Sequential(
        paddle.nn.Linear(32, 64), paddle.nn.ReLU(), paddle.nn.Linear(64, 1)
    )
    opt = paddle.optimizer.SGD(learning_rate=0.01, parameters=model.parameters())
    step, path = newest(args.checkpoints)
    if path is not None:
        model.set_state_dict(paddle.load(str(path / "model.pdparams")))
        opt.set_state_dict(paddle.load(str(path / "opt.pdopt")))
    model = paddle.DataParallel(model) if world > 1 else model
    say(event="start", world=world, rank=rank, resumed_from=step)
    target = paddle.arange(32, dtype="float32").reshape([32, 1]) / 32
    while step < args.steps:
        paddle.seed(step * 1000 + rank)
        x = paddle.randn([16, 32])
        loss = paddle.nn.functional.mse_loss(model(x), x @ target)
        loss.backward()
        opt.step()
        opt.clear_grad()
        step += 1
        if step % args.report_every == 0:
            say(event="step", step=step, world=world, rank=rank, loss=round(float(loss), 5))
        inner = model._layers if isinstance(model, paddle.DataParallel) else model
        if leaving.is_set():
            save(args.checkpoints, step, inner, opt)
            say(event="saved", step=step, world=world, rank=rank)
            return 0
        if rank == 0 and step % args.checkpoint_every == 0:
            save(args.checkpoints, step, inner, opt)
        time.sleep(args.step_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
