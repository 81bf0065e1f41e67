"""Exact resume under kill -9 (issue 22, item 3; the long form is benchmarks/fault_tolerance.py).

Two processes train with ``StableCheckpoint(every_n_train_steps=1, async_save=True)`` (each write in the
background, so most kills land inside one): under DDP (fp32, ``AtomicCheckpointIO``, a
NaN gradient skipped by ``GradientNormMonitor``) and under ``StableFSDPStrategy`` (fp16 with ``LossScaleTuner``:
an overflow skipped, the scale backed off and grown; sharded checkpoints). Each run is killed with SIGKILL 3
times at random moments (a random rank first, inside a step or inside a checkpoint write), every checkpoint on
disk must verify after each kill, and each restart with ``trainer.fit(ckpt_path="last")`` must resume from the
newest healthy checkpoint listed. The resumed run, finished, must equal an uninterrupted one bit for bit on
every rank: weights, AdamW's state, LR (``WarmupConstantCosineLR``), loss scale and scaler state, the ledger's
counts, the step, the epoch and the data of every step (8 steps per epoch, reshuffled each epoch: a plain
``DataLoader(shuffle=True)`` with Lightning's ``DistributedSampler``, see soak_run.py). The kill moments are random;
the seed is in the printed line.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.checkpoint.soak import soak

pytestmark = pytest.mark.distributed

KILLS, STEPS = 3, 24


@pytest.mark.parametrize("config", ["ddp", "fsdp_fp16"])
def test_killed_run_resumes_exactly(tmp_path: Path, config: str) -> None:
    seed = random.randrange(2**32)
    result = soak(tmp_path, config, kills=KILLS, steps=STEPS, seed=seed)
    print(f"seed {seed}: {result.line()}")
    assert result.kills == KILLS
    assert not result.mismatches, f"seed {seed}, log {tmp_path / f'{config}.log'}: {result.line()}"
    assert result.max_abs_diff == 0.0
