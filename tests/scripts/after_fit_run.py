"""A project laid out like the Lightning Hydra template: the network is an argument of the LightningModule, which
keeps it with ``save_hyperparameters()``; it is a Hugging Face BERT built from a config under
``trainer.init_module(empty_init=True)``. Two stages fit with a ``ModelCheckpoint``, then
``trainer.test(ckpt_path="best", weights_only=False)`` runs, then the launching process uses its module and loads
the checkpoint.

python after_fit_run.py OUT

Every rank writes OUT/init_rank{r}.pt (the tensors it materialized, at the start of training) and
OUT/tested_rank{r}.json (what trainer.test returned, or its error); rank 0 also writes OUT/after.pt: which of its
module's tensors are still on the meta device, the module's output on a batch, the output of
``load_from_checkpoint`` of the best checkpoint, and BERT's ``position_ids`` (or the errors).
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning_clapping


def bert_config():
    from transformers import BertConfig

    return BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                      max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def build_net() -> nn.Module:
    from transformers import BertModel

    return BertModel(bert_config(), add_pooling_layer=False)


class Classifier(L.LightningModule):
    def __init__(self, net: nn.Module, classes: int = 3) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.net = net
        self.head = nn.Linear(net.config.hidden_size, classes)

    def forward(self, ids):
        return self.head(self.net(input_ids=ids).last_hidden_state[:, 0])

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", F.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def data():
    g = torch.Generator().manual_seed(0)
    return torch.randint(1, 64, (16, 8), generator=g), torch.randint(0, 3, (16,), generator=g)


class SaveInit(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module):
        named = dict(pl_module.named_parameters()) | dict(pl_module.named_buffers())
        own = {k: v.detach().clone() for k, v in named.items() if not v.is_meta}
        torch.save(own, self.out / f"init_rank{trainer.global_rank}.pt")


def attempt(fn):
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - the test reads the error
        return f"{type(err).__name__}: {err}"


def main(out: Path) -> None:
    L.seed_everything(0)
    x, y = data()
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    best = L.pytorch.callbacks.ModelCheckpoint(dirpath=out / "ckpt", monitor="val_loss")
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[best, SaveInit(out)],
                        strategy=lightning_clapping.ClappingStrategy(split_points=["net.encoder.layer.1"],
                                                                     microbatches=2))
    with trainer.init_module(empty_init=True):
        model = Classifier(build_net())
    trainer.fit(model, loader, loader)
    tested = attempt(lambda: trainer.test(model, loader, ckpt_path="best", weights_only=False, verbose=False))
    (out / f"tested_rank{trainer.global_rank}.json").write_text(json.dumps(tested))
    if trainer.global_rank == 0:
        meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
        model.eval()
        with torch.no_grad():
            after = attempt(lambda: model(x))
            loaded = attempt(lambda: Classifier.load_from_checkpoint(best.best_model_path, weights_only=False).eval()(x))
        torch.save({"meta": meta, "output": after, "loaded": loaded,
                    "position_ids": model.net.embeddings.position_ids.clone()}, out / "after.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
