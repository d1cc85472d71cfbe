"""Transformer models as people write them, whose values cross cuts outside the cut modules' inputs.

python crossings_run.py OUT MODE      MODE: single | pipe2 | pipe4 | compressed

loop:  residuals written in the parent's loop (``for blk in self.blocks: x = blk(x) + x``);
demo:  Lightning's own ``lightning.pytorch.demos.Transformer`` (nn.Transformer encoder-decoder) in its
       ``LightningTransformer``: the decoder's input embedding is computed before the encoder;
llama: Hugging Face ``LlamaForCausalLM`` from a config: rotary tables (``rotary_emb``, registered after the layers,
       called first) and the causal mask reach every layer as keyword arguments.

Each family trains 4 steps of SGD and validates from the same seed, one after the other in the same processes, under
the strategy with automatic balance (pipe2, pipe4), in one process (single), or compressed on 2 stages
(compressed: ef21 with q8 forward / q8 backward). Every rank writes nothing; rank 0 writes OUT/crossings_MODE.json
(losses, validation loss, byte counters) and OUT/crossings_MODE_FAMILY.pt (the final weights).
"""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.demos import Transformer
from lightning.pytorch.demos.transformer import LightningTransformer
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_clapping import ClappingStrategy

V, T = 61, 12


class Recording(L.LightningModule):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class LoopResidual(Recording):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
                                    for _ in range(4))
        self.head = nn.Linear(32, V)
        self.losses = []

    def forward(self, x):
        x = self.embed(x)
        for blk in self.blocks:
            x = blk(x) + x
        return self.head(x)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = F.cross_entropy(self(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        (x,) = batch
        self.log("val_loss", F.cross_entropy(self(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()))


class Demo(Recording, LightningTransformer):
    """Lightning's transformer example as it is, with a small model and no dropout (so one process can compare)."""

    def __init__(self):
        LightningTransformer.__init__(self, vocab_size=V)
        self.model = Transformer(vocab_size=V, ninp=32, nhead=2, nhid=64, nlayers=2, dropout=0.0)
        self.losses = []

    def prepare_data(self):  # the example downloads WikiText-2 here; these tests bring their own tokens
        pass

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return LightningTransformer.training_step(self, (x[:, :-1].contiguous(), x[:, 1:].contiguous()), batch_idx)

    def validation_step(self, batch, batch_idx):
        (x,) = batch
        out = self(x[:, :-1], x[:, 1:])
        self.log("val_loss", F.nll_loss(out, x[:, 1:].reshape(-1)))


class Llama(Recording):
    def __init__(self):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        self.model = LlamaForCausalLM(config)
        self.losses = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.model(input_ids=x, attention_mask=torch.ones_like(x), labels=x, use_cache=False).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        (x,) = batch
        self.log("val_loss", self.model(input_ids=x, labels=x, use_cache=False).loss)


FAMILIES = {"loop": LoopResidual, "demo": Demo, "llama": Llama}


def main(out: Path, mode: str) -> None:
    g = torch.Generator().manual_seed(1)
    # counting sequences with a random start: a pattern a few steps of SGD begin to learn
    tokens = (torch.randint(0, V, (40, 1), generator=g) + torch.arange(T)) % V
    results = {}
    for name, cls in FAMILIES.items():
        L.seed_everything(0)
        model = cls()
        if mode == "single":
            strategy, devices = "auto", 1
        elif mode == "compressed":
            strategy, devices = ClappingStrategy(microbatches=2, variant="ef21", forward_codec="q8",
                                                 backward_codec="q8"), 2
        else:
            strategy, devices = ClappingStrategy(microbatches=2), int(mode[-1])
        trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=4, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, limit_val_batches=1)
        train = DataLoader(TensorDataset(tokens[:32]), batch_size=8)
        val = DataLoader(TensorDataset(tokens[32:]), batch_size=8)
        trainer.fit(model, train, val)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        totals = trainer.strategy.byte_totals if isinstance(trainer.strategy, ClappingStrategy) else {}
        results[name] = {"losses": model.losses, "val_loss": metrics.get("val_loss"),
                         "raw_bytes": totals.get("raw_bytes"), "crossing_raw_bytes": totals.get("crossing_raw_bytes")}
        if trainer.global_rank == 0:
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                       out / f"crossings_{mode}_{name}.pt")
    if int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0:
        (out / f"crossings_{mode}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
