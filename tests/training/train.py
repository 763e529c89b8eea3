"""A small data-parallel trainer for the training-through-faults tests: a 32-64-1 MLP learning a
fixed linear target on CPU (gloo), rank 0 checkpointing every `--checkpoint-every` steps to a
shared directory, every trainer resuming from the newest checkpoint when the job re-forms.

It prints one JSON object per line, which the tests read from the pods' logs:
`{"event": "start", "world": W, "rank": R, "resumed_from": N}` once per (re)formation and
`{"event": "step", "step": N, "world": W, "rank": R, "loss": L}` every `--report-every` steps,
each with `"t"` (Unix time). It exits 0 after `--steps` steps."""

from __future__ import annotations

import argparse
import json
import sys
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
    if (directory / f"step-{step}").exists():
        return  # saved before a re-formation resumed from an older one
    partial = directory / f".partial-{step}"
    partial.mkdir(parents=True, exist_ok=True)
    paddle.save(model.state_dict(), str(partial / "model.pdparams"))
    paddle.save(opt.state_dict(), str(partial / "opt.pdopt"))
    partial.rename(directory / f"step-{step}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoints", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--report-every", type=int, default=10)
    parser.add_argument("--step-seconds", type=float, default=0.02, help="pause per step")
    args = parser.parse_args()

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
        if rank == 0 and step % args.checkpoint_every == 0:
            inner = model._layers if isinstance(model, paddle.DataParallel) else model
            save(args.checkpoints, step, inner, opt)
        time.sleep(args.step_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
