"""The training run: it learns, and a run stopped and resumed ends with the same weights."""

from __future__ import annotations

import csv
import dataclasses
import fcntl
import json
from pathlib import Path

import pytest
import torch

from server.training import train
from server.training.model import Config, MoeLM


def test_loss_falls_and_is_logged(tiny_run: Path) -> None:
    with (tiny_run / "loss.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, train.TINY.steps + 1))
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"]) - 0.5
    assert rows[-1]["heldout_loss"], "the last step evaluates the held-out split"


def test_resume_gives_the_same_weights(tiny_run: Path, small_corpus: Path, tmp_path: Path) -> None:
    # the same config and data, stopped at step 12 then resumed to the end
    run = tmp_path / "run"
    run.mkdir()
    for name in ("tokenizer.json", "train.bin", "heldout.bin"):
        (run / name).write_bytes((tiny_run / name).read_bytes())
    assert train.train(run, train.TINY, until=12, corpus_dir=small_corpus) == 12
    assert train.train(run, train.TINY, corpus_dir=small_corpus) == train.TINY.steps
    resumed, _, _ = train.load_model(run)
    straight, _, _ = train.load_model(tiny_run)
    for (name, a), (_, b) in zip(resumed.state_dict().items(), straight.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    with (run / "loss.csv").open() as f:
        steps = [int(r["step"]) for r in csv.DictReader(f)]
    assert steps == list(range(1, train.TINY.steps + 1))


def test_a_shortened_schedule_replays_from_run_json(
    tiny_run: Path, small_corpus: Path, tmp_path: Path
) -> None:
    # stopped at step 12 and rescheduled to end at 20; then replayed from step 0 with the
    # run.json it left: the same lr at every step, the same weights
    runs = []
    for name in ("cut", "replay"):
        run = tmp_path / name
        run.mkdir()
        for f in ("tokenizer.json", "train.bin", "heldout.bin"):
            (run / f).write_bytes((tiny_run / f).read_bytes())
        runs.append(run)
    cut, replay = runs
    assert train.train(cut, train.TINY, until=12, corpus_dir=small_corpus) == 12
    assert train.train(cut, train.TINY, corpus_dir=small_corpus, reschedule_to=20) == 20
    rc = train.RunConfig.from_json(json.loads((cut / "run.json").read_text()))
    assert rc.reschedules == ((12, 20),) and rc.last_step == 20
    assert train.lr_at(rc, 11) == train.lr_at(train.TINY, 11)
    assert train.lr_at(rc, 19) < train.lr_at(train.TINY, 19)
    (replay / "run.json").write_text((cut / "run.json").read_text())
    assert train.train(replay, train.TINY, corpus_dir=small_corpus) == 20
    a, _, _ = train.load_model(cut)
    b, _, _ = train.load_model(replay)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    with pytest.raises(ValueError, match="the run is at step 20"):
        train.train(cut, train.TINY, corpus_dir=small_corpus, reschedule_to=15)


def test_dispatch_runs_only_the_chosen_experts() -> None:
    cfg = dataclasses.replace(train.TINY.model, n_layer=1)
    model = MoeLM(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    moe = model.blocks[0].moe
    x = torch.randn(5, cfg.n_embd, generator=torch.Generator().manual_seed(1))
    _, top_i, top_w = moe.route(x)
    out, _ = moe(x)
    # the dense reference: every expert on every row, weighted by the router's choice
    dense = torch.zeros_like(x)
    for r in range(x.shape[0]):
        for j in range(cfg.n_expert_used):
            e = int(top_i[r, j])
            h = torch.nn.functional.silu(moe.gate[e] @ x[r]) * (moe.up[e] @ x[r])
            dense[r] += top_w[r, j] * (moe.down[e] @ h)
    torch.testing.assert_close(out, dense)
    assert isinstance(cfg, Config)


def test_a_second_trainer_is_refused(tiny_run: Path, small_corpus: Path) -> None:
    with (tiny_run / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(train.RunBusyError, match="another process is training"):
            train.train(tiny_run, train.TINY, corpus_dir=small_corpus)
