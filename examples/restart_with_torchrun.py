"""Let torchrun restart the job after a process dies: the training script is the same for the first run and every
restart, and trainer.fit(model, ckpt_path="last") is all it needs.

Launch it as you would on a GPU node (here on 2 CPU processes):
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 --max-restarts=3 \\
        examples/restart_with_torchrun.py CKPT_DIR
Run as `python examples/restart_with_torchrun.py`, it launches itself that way into a temporary directory and kills
rank 1 (SIGKILL) mid-epoch in the first attempt; torchrun restarts both ranks, which resume from the newest healthy
checkpoint. (EXAMPLE_STEPS=20 runs it at a tiny size, as CI does.)
"""

import os
import signal
import subprocess
import sys
import tempfile

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_stability import StableCheckpoint

STEPS = int(os.environ.get("EXAMPLE_STEPS", 200))
KILL_AT = STEPS // 2 + 3  # mid-epoch (5 steps an epoch on 2 ranks), after a save


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):  # DDP gives each rank its share (a DistributedSampler)
        x = torch.randn(320, 16, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32, shuffle=True)


class KillRank1Once(L.Callback):
    """Stands in for a lost process: rank 1 dies in the first attempt (torchrun counts the restarts)."""

    def on_train_batch_start(self, trainer, *args):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
        if first_attempt and trainer.global_rank == 1 and trainer.global_step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)


def train(ckpt_dir: str) -> None:
    """The training script torchrun runs on every rank, the first time and after each restart."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        strategy="ddp",
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        callbacks=[StableCheckpoint(dirpath=ckpt_dir, every_n_train_steps=5, keep=3), KillRank1Once()],
    )
    trainer.fit(Regression(), ckpt_path="last")  # nothing there on the first run: a fresh start
    if trainer.is_global_zero:
        print(f"attempt {attempt} resumed from {trainer.ckpt_path and os.path.basename(trainer.ckpt_path)}")
        print(f"attempt {attempt} finished at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:  # under torchrun
        train(sys.argv[1])
        sys.exit(0)
    ckpt_dir = tempfile.mkdtemp(prefix="ckpts-")
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=3"]
    done = subprocess.run([*command, __file__, ckpt_dir], env=env, capture_output=True, text=True, timeout=600)
    said = [line for line in done.stdout.splitlines() if line.startswith("attempt")]
    print("\n".join(said))
    assert done.returncode == 0, done.stderr[-3000:]
    assert said[-1] == f"attempt 1 finished at step {STEPS}", said
