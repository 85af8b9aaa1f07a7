"""Train the qwen3moe model on the corpus, on the CPU, resumably.

A run lives in one directory of its own, outside the checkout (`make train TRAIN_DIR=DIR`):
  run.json        the run's config and seed; a resume reads it back (--reschedule-to appends a
                  new schedule length from the step it is given at, so the run stays reproducible)
  corpus/         train.txt, heldout.txt, manifest.json (server/training/corpus.py)
  tokenizer.json  the trained tokenizer; train.bin, heldout.bin: token ids (uint16)
  ckpt.pt         the latest checkpoint (model, optimizer, step), replaced atomically
  loss.csv        step, tokens, train loss, balance loss, lr, training seconds, held-out loss
  lock            held (flock) by the process training there; a second one is refused

Batches depend only on (seed, step), and the checkpoint holds everything else the next step
needs, so a run killed at any point and resumed gives the same weights as one never stopped.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import fcntl
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from server.training import corpus, tokenizer
from server.training.model import Config, MoeLM

logger = logging.getLogger(__name__)

LOSS_COLUMNS = ("step", "tokens", "loss", "balance", "lr", "seconds", "heldout_loss")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: Config
    seed: int = 0
    batch: int = 16
    seq: int = 256
    steps: int = 6000  # the cosine schedule's length; a run may stop earlier and resume
    # (step, length): from that step on the cosine runs to `length` instead; written by
    # --reschedule-to so that a run shortened mid-way can be replayed from run.json alone
    reschedules: tuple[tuple[int, int], ...] = ()
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 200
    weight_decay: float = 0.1
    balance_coef: float = 0.01
    checkpoint_every: int = 25
    eval_every: int = 250
    eval_batches: int = 8

    @staticmethod
    def from_json(d: dict[str, Any]) -> RunConfig:
        resched = tuple((int(a), int(n)) for a, n in d.get("reschedules", ()))
        return RunConfig(**{**d, "model": Config(**d["model"]), "reschedules": resched})

    def steps_at(self, step: int) -> int:
        """The schedule's length in force at `step`."""
        n = self.steps
        for at, length in self.reschedules:
            if step >= at:
                n = length
        return n

    @property
    def last_step(self) -> int:
        return self.reschedules[-1][1] if self.reschedules else self.steps


# a tiny configuration for the tests: trains in seconds
TINY = RunConfig(
    model=Config(n_vocab=512, n_embd=64, n_layer=2, n_head=2, n_head_kv=1, head_dim=32, n_expert=8,
                 n_expert_used=2, n_ff_exp=32, n_ctx=128),
    batch=4, seq=64, steps=30, warmup=5, checkpoint_every=10, eval_every=10, eval_batches=2,
)  # fmt: skip


def lr_at(rc: RunConfig, step: int) -> float:
    if step < rc.warmup:
        return rc.lr * (step + 1) / rc.warmup
    t = min(1.0, (step - rc.warmup) / max(1, rc.steps_at(step) - rc.warmup))
    return rc.lr * (rc.min_lr_ratio + (1 - rc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def prepare(run_dir: Path, rc: RunConfig, corpus_dir: Path | None = None) -> None:
    """Corpus, tokenizer and token files for a new run (skipped when already there)."""
    cdir = corpus_dir or run_dir / "corpus"
    if not (cdir / "train.txt").exists():
        corpus.build(cdir)
    if not (run_dir / "tokenizer.json").exists():
        docs = (cdir / "train.txt").read_text(encoding="utf-8").split(corpus.DOC_SEPARATOR)
        tok = tokenizer.train(docs, rc.model.n_vocab)
        tmp = run_dir / "tokenizer.json.tmp"
        tok.save(str(tmp))
        os.replace(tmp, run_dir / "tokenizer.json")
    tok = tokenizer.load(run_dir / "tokenizer.json")
    eos = tok.token_to_id(corpus.DOC_SEPARATOR)
    if eos is None:
        raise ValueError(f"the tokenizer has no {corpus.DOC_SEPARATOR} token")
    for split in ("train", "heldout"):
        out = run_dir / f"{split}.bin"
        if out.exists():
            continue
        docs = (cdir / f"{split}.txt").read_text(encoding="utf-8").split(corpus.DOC_SEPARATOR)
        ids: list[int] = []
        for enc in tok.encode_batch(docs):
            ids.extend(enc.ids)
            ids.append(eos)
        # written whole, then renamed: a run killed here redoes the file instead of training on a part
        np.asarray(ids, dtype=np.uint16).tofile(out.with_name(out.name + ".tmp"))
        os.replace(out.with_name(out.name + ".tmp"), out)


def batch_at(tokens: np.ndarray, rc: RunConfig, step: int, stream: int = 0) -> torch.Tensor:
    """(batch, seq + 1) windows at random offsets drawn from (seed, stream, step) alone."""
    rng = np.random.default_rng([rc.seed, stream, step])
    starts = rng.integers(0, len(tokens) - rc.seq - 1, size=rc.batch)
    return torch.from_numpy(np.stack([tokens[s : s + rc.seq + 1] for s in starts]).astype(np.int64))


def lm_loss(model: MoeLM, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits, balance = model(ids[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return loss, balance


@torch.no_grad()
def heldout_loss(model: MoeLM, heldout: np.ndarray, rc: RunConfig) -> float:
    model.eval()
    losses = [lm_loss(model, batch_at(heldout, rc, i, stream=1))[0].item() for i in range(rc.eval_batches)]
    model.train()
    return float(np.mean(losses))


def new_model(rc: RunConfig) -> MoeLM:
    model = MoeLM(rc.model)
    model.init_weights(torch.Generator().manual_seed(rc.seed))
    return model


def make_optimizer(model: MoeLM, rc: RunConfig) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": rc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=rc.lr, betas=(0.9, 0.95))


def save_checkpoint(path: Path, model: MoeLM, opt: torch.optim.Optimizer, step: int, seconds: float) -> None:
    tmp = path.with_name(path.name + ".tmp")
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "seconds": seconds}
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_model(run_dir: Path) -> tuple[MoeLM, RunConfig, int]:
    """The latest checkpoint's model (eval mode), the run's config and the step it reached."""
    rc = RunConfig.from_json(json.loads((run_dir / "run.json").read_text()))
    model = MoeLM(rc.model)
    ckpt = torch.load(run_dir / "ckpt.pt", weights_only=True)
    model.load_state_dict(ckpt["model"])
    model.eval()
    return model, rc, int(ckpt["step"])


def _trim_log(path: Path, step: int) -> None:
    """Drop loss.csv rows past `step` (written after the checkpoint a resume starts from)."""
    if not path.exists():
        return
    with path.open() as f:
        rows = [r for r in csv.reader(f)]
    kept = [rows[0]] + [r for r in rows[1:] if int(r[0]) <= step]
    with path.open("w", newline="") as f:
        csv.writer(f).writerows(kept)


def train(
    run_dir: Path,
    rc: RunConfig,
    until: int | None = None,
    corpus_dir: Path | None = None,
    reschedule_to: int | None = None,
) -> int:
    """Train from the run's checkpoint (or from scratch) up to step `until` (default: the
    schedule's end). `reschedule_to` ends the cosine at that step instead, from the checkpoint's
    step on, and records it in run.json.

    Raises RunBusyError when another process is training in `run_dir`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "lock").open("w") as lock:
        try:
            # released when the process ends, however it ends
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunBusyError(f"another process is training in {run_dir}") from None
        return _train_locked(run_dir, rc, until, corpus_dir, reschedule_to)


class RunBusyError(RuntimeError):
    """Two trainers in one run directory would overwrite each other's checkpoints."""


def _train_locked(
    run_dir: Path, rc: RunConfig, until: int | None, corpus_dir: Path | None, reschedule_to: int | None
) -> int:
    run_json = run_dir / "run.json"
    if run_json.exists():
        rc = RunConfig.from_json(json.loads(run_json.read_text()))
    else:
        run_json.write_text(json.dumps(dataclasses.asdict(rc), indent=2) + "\n")
    prepare(run_dir, rc, corpus_dir)
    torch.manual_seed(rc.seed)
    train_tokens = np.fromfile(run_dir / "train.bin", dtype=np.uint16)
    held_tokens = np.fromfile(run_dir / "heldout.bin", dtype=np.uint16)
    model = new_model(rc)
    opt = make_optimizer(model, rc)
    ckpt_path, log_path = run_dir / "ckpt.pt", run_dir / "loss.csv"
    step, seconds = 0, 0.0
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        step, seconds = int(ckpt["step"]), float(ckpt["seconds"])
        logger.info("resumed %s at step %d", run_dir, step)
    if reschedule_to is not None and reschedule_to != rc.last_step:
        if reschedule_to <= max(step, rc.warmup):
            raise ValueError(
                f"--reschedule-to {reschedule_to}: the run is at step {step}, warm-up {rc.warmup}"
            )
        # later entries replace any that start at or after this step: the run never reached them
        kept = tuple(r for r in rc.reschedules if r[0] < step)
        rc = dataclasses.replace(rc, reschedules=(*kept, (step, reschedule_to)))
        tmp = run_json.with_name(run_json.name + ".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(rc), indent=2) + "\n")
        os.replace(tmp, run_json)
        logger.info("schedule ends at step %d from step %d on", reschedule_to, step)
    _trim_log(log_path, step)
    if not log_path.exists():
        log_path.write_text(",".join(LOSS_COLUMNS) + "\n")
    end = rc.last_step if until is None else until
    model.train()
    t0 = time.monotonic() - seconds  # seconds: training time of the sessions before this one
    while step < end:
        lr = lr_at(rc, step)
        for group in opt.param_groups:
            group["lr"] = lr
        loss, balance = lm_loss(model, batch_at(train_tokens, rc, step))
        if not torch.isfinite(loss):
            # stop before a bad step reaches the checkpoint: the last good one stays
            raise FloatingPointError(f"loss is {loss.item()} at step {step + 1}")
        opt.zero_grad(set_to_none=True)
        torch.autograd.backward(loss + rc.balance_coef * balance)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        held = heldout_loss(model, held_tokens, rc) if step % rc.eval_every == 0 or step == end else None
        with log_path.open("a") as f:
            f.write(
                f"{step},{step * rc.batch * rc.seq},{loss.item():.4f},{balance.item():.4f},{lr:.6g},"
                f"{time.monotonic() - t0:.1f},{'' if held is None else f'{held:.4f}'}\n"
            )
        if step % rc.checkpoint_every == 0 or step == end:
            save_checkpoint(ckpt_path, model, opt, step, time.monotonic() - t0)
            logger.info("step %d loss %.4f balance %.3f lr %.2e", step, loss.item(), balance.item(), lr)
    return step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", type=Path, required=True, help="the run's directory (outside git)")
    p.add_argument("--seed", type=int, default=0, help="a new run's seed (a resume keeps its own)")
    p.add_argument("--until", type=int, default=None, help="stop at this step (default: the schedule's end)")
    p.add_argument(
        "--reschedule-to",
        type=int,
        default=None,
        help="end the cosine at this step, from the checkpoint's step on (recorded in run.json)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the machine is shared)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    logger.info("%d torch threads", args.threads)
    try:
        train(
            args.run_dir,
            RunConfig(model=Config(), seed=args.seed),
            until=args.until,
            reschedule_to=args.reschedule_to,
        )
    except (ValueError, RunBusyError) as exc:
        p.error(str(exc))  # a message and exit status 2, not a traceback
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
