"""Hugging Face models with tied weights, wrapped in a LightningModule as their docs show, trained as users do.

python tied_run.py OUT MODE CASE[,CASE...]
    MODE "pipe": ClappingStrategy, automatic balance, as many processes as the case's stages x replicas
    MODE "single": a plain Trainer on one device (the reference)
Several cases run one after the other in the same processes (each from the same seed), as several scripts would.

gpt2:     GPT2LMHeadModel (lm_head.weight is transformer.wte.weight), SGD, Lightning's default checkpointing
gpt2q:    the same with the tied gradients' sum compressed (tied_codec="q4"), more steps
bert:     BertForMaskedLM (cls.predictions.decoder.weight is bert.embeddings.word_embeddings.weight)
gpt2x4:   gpt2 on 4 stages (the middle stages hold no copy)
replicas: gpt2 on 2 stages x 2 replicas with gradient accumulation and clipping (the single run: the union of the
          replicas' batches, as tests/scripts/replicas_run.py does)
replicas_diloco: gpt2 on 2 stages x 2 replicas under DiLoCo (H=2, q8 pseudo-gradients) with tied_codec="q4"
replicas_every, replicas_diloco1: gpt2 on 2 stages x 2 replicas, every-step averaging and DiLoCo(inner_steps=1,
          outer_lr=1, momentum=0), which under SGD is the same training
hparams:  gpt2, the network passed to the LightningModule and saved in its hyperparameters (``net: nn.Module``)
gpt2bn:   gpt2 with its second block wrapped by ``BottleneckAfter(block, 32, 8)`` (a ``Bottleneck`` on the hidden
          states it returns) and the split point naming that bottleneck; gpt2bnwide: the same model, cut after the
          wrapper; gpt2bnfit: gpt2bn with its bottleneck started by ``FitBottlenecks`` (two batches, token 0 left out)
resume:   (single only) one process resumes the gpt2 pipeline run's checkpoint for a second epoch
bert_resume: the bert pipeline run's checkpoint resumed for a second epoch (pipe: on 2 stages; single: one process)

Every rank writes OUT/<case>_<mode>_rank<r>.json: per-step losses, the byte totals, the last logged byte values,
the checkpoint path, the cut points and the shapes of the floating tensors this stage last sent each way, and
``copies``: this rank's copy of each tied tensor at the end of training (its own stage's, recorded before teardown).
Rank 0 also saves the final weights as OUT/<case>_<mode>_weights.pt.
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_clapping
from lightning_clapping import DiLoCo

VOCAB, SEQ = 97, 16
TIED = {"gpt2": ("model.transformer.wte.weight", "model.lm_head.weight"),
        "bert": ("model.bert.embeddings.word_embeddings.weight", "model.cls.predictions.decoder.weight")}


def build(arch: str, bottleneck: int = 0):
    if arch == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(config)
        if bottleneck:
            h = model.transformer.h
            h[1] = lightning_clapping.BottleneckAfter(h[1], config.n_embd, bottleneck)
        return model
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return BertForMaskedLM(config)


class TiedLM(L.LightningModule):
    def __init__(self, arch: str = "gpt2", lr: float = 0.5, bottleneck: int = 0):
        super().__init__()
        self.save_hyperparameters()
        self.model = build(arch, bottleneck)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.model(input_ids=x, labels=x).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class NetHolder(L.LightningModule):
    """The most used template's shape: the network is a constructor argument, saved with the hyperparameters."""

    def __init__(self, net: torch.nn.Module, lr: float = 0.5):
        super().__init__()
        self.save_hyperparameters()
        self.model = net

    training_step = TiedLM.training_step
    configure_optimizers = TiedLM.configure_optimizers


class Record(L.Callback):
    def __init__(self, keys):
        self.keys, self.losses, self.copies, self.sent = keys, [], {}, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

    def on_train_end(self, trainer, pl_module):  # before the strategy gathers the model: this stage's own copies
        params = dict(pl_module.named_parameters(remove_duplicate=False))
        self.copies = {k: params[k].detach().cpu().clone() for k in self.keys if not params[k].is_meta}
        executor = getattr(trainer.strategy, "executor", None)
        if executor is not None:  # the floating tensors of this stage's last message in each direction
            self.sent = {name: [list(shape) for shape, dtype, _ in specs if dtype.is_floating_point]
                         for name, specs in executor.sent_specs.items()}


CASES = {
    # name: (arch, stages, replicas, trainer kwargs, strategy kwargs, samples)
    "gpt2": ("gpt2", 2, 1, {}, {}, 32),
    "gpt2q": ("gpt2", 2, 1, {}, {"tied_codec": "q4"}, 96),
    "bert": ("bert", 2, 1, {}, {}, 32),
    "gpt2x4": ("gpt2", 4, 1, {}, {}, 32),
    "bertx4": ("bert", 4, 1, {}, {}, 32),
    "replicas": ("gpt2", 2, 2, {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}, {}, 32),
    # DiLoCo over the replicas with a compressed tied sum and compressed pseudo-gradients (pipe only)
    "replicas_diloco": ("gpt2", 2, 2, {}, {"replica_sync": DiLoCo(inner_steps=2, codec="q8"), "tied_codec": "q4"},
                        48),
    # every-step averaging and DiLoCo(H=1, outer lr 1, no momentum) under SGD: the same training (pipe only)
    "replicas_every": ("gpt2", 2, 2, {}, {}, 32),
    "replicas_diloco1": ("gpt2", 2, 2, {}, {"replica_sync": DiLoCo(inner_steps=1, outer_lr=1.0, momentum=0.0)}, 32),
    "resume": ("gpt2", 1, 1, {"max_epochs": 2}, {}, 32),
    "bert_resume": ("bert", 2, 1, {"max_epochs": 2}, {}, 32),
    "hparams": ("gpt2", 2, 1, {}, {}, 32),
    "gpt2bn": ("gpt2", 2, 1, {}, {"split_points": ["model.transformer.h.1.bottleneck"]}, 32),
    "gpt2bnwide": ("gpt2", 2, 1, {}, {"split_points": ["model.transformer.h.2"]}, 32),
    "gpt2bnfit": ("gpt2", 2, 1, {}, {"split_points": ["model.transformer.h.1.bottleneck"]}, 32),
}
BOTTLENECK_RANK = 8


def run(out: Path, mode: str, case: str) -> None:
    arch, stages, replicas, trainer_kw, strategy_kw, samples = CASES[case]
    L.seed_everything(0)
    bottleneck = BOTTLENECK_RANK if case.startswith("gpt2bn") else 0
    model = NetHolder(build(arch)) if case == "hparams" else TiedLM(arch, bottleneck=bottleneck)
    # counting sequences over the first 10 tokens: something to learn, so the loss falls
    start = torch.randint(0, 10, (samples, 1), generator=torch.Generator().manual_seed(1))
    x = (start + torch.arange(SEQ)) % 10
    dataset = TensorDataset(x)
    per_step = 8
    if mode == "pipe":
        strategy = lightning_clapping.ClappingStrategy(stages=stages, microbatches=2, **strategy_kw)
        devices, batch = stages * replicas, per_step // replicas
        data = DataLoader(dataset, batch_size=batch)  # with replicas, Lightning's DistributedSampler shards it
    else:
        strategy, devices = "auto", 1
        sampler = DistributedSampler(dataset, 1, 0, shuffle=True, seed=0) if replicas > 1 else None
        data = DataLoader(dataset, batch_size=per_step, sampler=sampler)
    record = Record(TIED[arch])
    callbacks = [record]
    if case == "gpt2bnfit":  # the bottleneck started from two batches, token 0 not counted
        callbacks.append(lightning_clapping.FitBottlenecks([(x[:8],), (x[8:16],)], positions=lambda b: b[0] != 0))
    trainer_kw = {"max_epochs": 1, **trainer_kw}
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, callbacks=callbacks,
                        default_root_dir=out / f"{case}_{mode}", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, **trainer_kw)
    resume = json.loads((out / f"{arch}_pipe_rank0.json").read_text())["checkpoint"] if "resume" in case else None
    try:
        trainer.fit(model, data, ckpt_path=resume)
    except ValueError as err:  # the resume case reports a checkpoint this process cannot load, for its test
        if resume is None:
            raise
        (out / f"{case}_{mode}_rank{trainer.global_rank}.json").write_text(json.dumps({"error": str(err)}))
        return
    rank = trainer.global_rank
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("clapping/")}
    row = {"losses": record.losses, "metrics": metrics, "checkpoint": trainer.checkpoint_callback.best_model_path,
           "totals": trainer.strategy.byte_totals if mode == "pipe" else {}, "steps": trainer.global_step,
           "cut_points": list(trainer.strategy.partition.cut_points) if mode == "pipe" else None, "sent": record.sent,
           # after a "full" run the launching process holds the whole model: tied as one process holds it
           "tied_after_fit": model.get_parameter(TIED[arch][0]) is model.get_parameter(TIED[arch][1])
           if rank == 0 and case != "hparams" else None}
    torch.save(record.copies, out / f"{case}_{mode}_copies_rank{rank}.pt")
    if rank == 0:
        torch.save(model.state_dict(), out / f"{case}_{mode}_weights.pt")
    (out / f"{case}_{mode}_rank{rank}.json").write_text(json.dumps(row))


if __name__ == "__main__":
    for name in sys.argv[3].split(","):
        run(Path(sys.argv[1]), sys.argv[2], name)
