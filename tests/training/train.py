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

import sys
from pathlib import Path

import paddle
import paddle.distributed as dist
from trainer_io import after_step, arguments, leaving_on_sigterm, newest, publish, say


def save(
    directory: Path, step: int, model: paddle.nn.Layer, opt: paddle.optimizer.Optimizer
) -> None:
    def write(partial: Path) -> None:
        paddle.save(model.state_dict(), str(partial / "model.pdparams"))
        paddle.save(opt.state_dict(), str(partial / "opt.pdopt"))

    publish(directory, step, write)


def main() -> int:
    args = arguments(__doc__)
    leaving = leaving_on_sigterm(args.ignore_sigterm)

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
    inner, model = model, paddle.DataParallel(model) if world > 1 else model

    def saving(at: int) -> None:
        save(args.checkpoints, at, inner, opt)

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
        if after_step(args, leaving, (step, rank, world), float(loss), saving):
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
