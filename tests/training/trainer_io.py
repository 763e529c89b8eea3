"""What the test trainers share (train.py on PaddlePaddle, train_torch.py on PyTorch): their
command line, the JSON lines they print, the newest checkpoint, how a checkpoint is published
whole, and the SIGTERM that asks a trainer to save and leave.

Each trainer runs as a script (`python train.py ...`), so this module is imported from the
script's own directory."""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path


def say(**fields: object) -> None:
    print(json.dumps({"t": round(time.time(), 3), **fields}), flush=True)


def arguments(description: str | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--checkpoints", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--report-every", type=int, default=10)
    parser.add_argument("--step-seconds", type=float, default=0.02, help="pause per step")
    parser.add_argument("--ignore-sigterm", action="store_true", help="do not save on SIGTERM")
    return parser.parse_args()


def leaving_on_sigterm(ignore: bool) -> threading.Event:
    """Set when SIGTERM arrives (never, with `ignore`: the default action kills the trainer)."""
    leaving = threading.Event()
    if not ignore:
        signal.signal(signal.SIGTERM, lambda _signum, _frame: leaving.set())
    return leaving


def newest(directory: Path) -> tuple[int, Path | None]:
    found = sorted(
        (int(p.name.split("-")[1]), p) for p in directory.glob("step-*") if p.name[5:].isdigit()
    )
    return found[-1] if found else (0, None)


def publish(directory: Path, step: int, write: Callable[[Path], None]) -> None:
    """Checkpoint `step` into `directory/step-N`: `write` fills a partial directory, which is
    then renamed into place, so a reader never sees half a checkpoint."""
    final = directory / f"step-{step}"
    if final.exists():
        return  # saved before a re-formation resumed from an older one
    # A trainer leaving on SIGTERM may save the same step as rank 0: each writes its own copy.
    partial = directory / f".partial-{step}-{os.getpid()}"
    partial.mkdir(parents=True, exist_ok=True)
    write(partial)
    try:
        partial.rename(final)
    except OSError:
        if not final.exists():
            raise  # not the other copy's arrival: a real failure


def after_step(
    args: argparse.Namespace,
    leaving: threading.Event,
    where: tuple[int, int, int],
    loss: float,
    save: Callable[[int], None],
) -> bool:
    """What a trainer does after each step (`where`: the step, its rank and world size): report
    it every `--report-every` steps; when SIGTERM asked it to leave, `save` that step and say so
    (True: leave now); rank 0's checkpoint every `--checkpoint-every` steps; the pause."""
    step, rank, world = where
    if step % args.report_every == 0:
        say(event="step", step=step, world=world, rank=rank, loss=round(loss, 5))
    if leaving.is_set():
        save(step)
        say(event="saved", step=step, world=world, rank=rank)
        return True
    if rank == 0 and step % args.checkpoint_every == 0:
        save(step)
    time.sleep(args.step_seconds)
    return False
