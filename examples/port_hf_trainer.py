"""Port a Hugging Face Trainer recipe to Lightning with lightning_stability: the same model, the same
TrainingArguments values, each mapped to a callback or a Trainer argument.

The model is a tiny GPT-2 built from a config (no download). Run: python examples/port_hf_trainer.py
(EXAMPLE_STEPS=20 runs it at a tiny size, as CI does)
"""

import os

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_stability import CosineSchedule, GradientAccumulation, GradientNormMonitor, ScheduledLR

STEPS = int(os.environ.get("EXAMPLE_STEPS", 200))

# the recipe, as it was given to transformers.TrainingArguments
hf = dict(
    learning_rate=5e-4,
    weight_decay=0.01,
    adam_beta1=0.9,
    adam_beta2=0.95,
    lr_scheduler_type="cosine",
    warmup_ratio=0.05,
    max_grad_norm=1.0,
    gradient_accumulation_steps=4,
    per_device_train_batch_size=8,
    max_steps=STEPS,
    logging_steps=10,
    seed=0,
)


class GPT2Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2)
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss  # shifts the labels itself, as in HF's Trainer
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):  # HF's AdamW: decay on everything but biases and LayerNorm weights
        decay = [p for n, p in self.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.ndim < 2]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": hf["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hf["learning_rate"],
            betas=(hf["adam_beta1"], hf["adam_beta2"]),
            fused=True,
        )

    def train_dataloader(self):
        tokens = torch.randint(0, 128, (512, 32), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(tokens), batch_size=hf["per_device_train_batch_size"], shuffle=True)


if __name__ == "__main__":
    L.seed_everything(hf["seed"])
    trainer = L.Trainer(
        max_steps=hf["max_steps"],  # optimizer steps, as HF counts them
        log_every_n_steps=hf["logging_steps"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[
            GradientNormMonitor(max_norm=hf["max_grad_norm"]),
            ScheduledLR(CosineSchedule(warmup=hf["warmup_ratio"])),  # lr_scheduler_type="cosine" + warmup_ratio
            GradientAccumulation(steps=hf["gradient_accumulation_steps"]),  # the LR as set, as in transformers
        ],
    )
    trainer.fit(GPT2Module())
    print(f"steps: {trainer.global_step}, loss: {float(trainer.callback_metrics['train_loss']):.3f}")
    assert trainer.global_step == STEPS
