"""Training patterns as their users write them, on 2 pipeline stages or on one device (tests/conformance).

python conformance_run.py OUT CASE MODE      MODE: pipe (ClappingStrategy, 2 stages, microbatches=1,
                                                   freeze_rng=False) | single (a plain one-device Trainer)

One case per launch (a case that fails must not take the others with it). Every case starts from
``seed_everything(0)`` at the top, builds its data from a generator of its own, trains with SGD (no momentum) for 2
epochs of 3 steps on a DataLoader that does not shuffle (and has no ``generator=``, as most users write it), with
Lightning's logger and checkpointing off, and seeds again when training starts (``SeedAtTrainStart``: the one
difference to one process that is Lightning's own, not the pattern's). Each rank writes
``OUT/CASE_MODE_rankR.json`` (losses per step, ``callback_metrics``, how many batches started, and the error if the
run raised: type and message, written before the exception goes on); global rank 0 writes the whole trained model,
``OUT/CASE_MODE_weights.pt`` (after ``fit`` the launching process's module holds every stage's weights).

Cases (the model has at least two submodules, cut at ``SPLITS[case]``):

ddpm:             the noise and the timesteps drawn in ``training_step`` (``randn_like``, ``randint``), ``x_t`` from a
                  registered buffer ``a_bar``; the model predicts the noise from ``x_t`` and the timestep.
mlm:              BERT-style masking in ``training_step`` (``torch.rand(ids.shape) < 0.15``), loss on masked
                  positions only (``logits[mask]``).
mixup_torch:      ``torch.randperm`` and ``torch.distributions.Beta(0.4, 0.4).sample()`` in ``training_step``.
mixup_numpy:      the same with ``np.random.beta``.
running_sum:      ``self.total = torch.zeros(())`` set in ``__init__``, ``self.total += loss.detach()`` in each
                  step, logged in ``on_train_epoch_end``.
dropout_parent:   ``F.dropout(x, 0.1, self.training)`` in the LightningModule's loop between blocks.
stochastic_depth: ``if self.training and torch.rand(()) < 0.2: continue`` in the loop over the blocks.
grad_reverse:     DANN: a custom ``torch.autograd.Function`` reversing the gradient of the backbone's features on
                  their way to the domain discriminator, applied in ``training_step``.
swa:              Lightning's ``StochasticWeightAveraging(swa_lrs=0.1, swa_epoch_start=1)`` over 2 epochs.
hashing:          a straight-through ``sign`` Function that saves its input for backward (binary hashing codes),
                  applied in ``training_step`` to the backbone's features after the cut.
writes:           the step writes the backbone's features into buffers it made, one by index (``a[:, :2] = f[:, :2]``)
                  and one through a view (``b[:, 2:].copy_(...)``), and uses both in the loss after the cut.
rank_dependent:   a value before the cut computed from the process's rank (state that differs between processes,
                  which the tracker cannot see): the run-time guard must stop it at the first step.
drift:            a scale used before and after the cut, which an epoch-end hook changes on the last stage only
                  (with recheck_every=2, the guard's check at step 4 stops it).
mae:              a masked autoencoder (MAE's reference code): random masking in the encoder, blocks in ModuleLists run
                  in the parent's loops, cut between encoder and decoder.
gumbel_vae:       a categorical VAE as tutorials write it: ``F.gumbel_softmax`` between encoder and decoder, a sigmoid
                  decoder and ``binary_cross_entropy``, which checks that its input lies in [0, 1].
checkpoint_loop:  ``torch.utils.checkpoint(blk, x, use_reentrant=False)`` around each block in the parent's loop.
mean_teacher:     a mean teacher: a copy of the network updated as the student's moving average in
                  ``on_train_batch_end`` (the teacher's layers live on a later stage than most of the student's).
hf_bert_mlm:      Hugging Face BERT for masked LM (dropout on, decoder tied to the embeddings), masked in the step as
                  transformers' DataCollatorForLanguageModeling does (bernoulli draws, random replacement tokens).
opt:              Hugging Face OPT built from a config, cut between its decoder layers: ``final_layer_norm`` is
                  registered before the layers and called after them (refused with what to do);
opt_reordered:    the same after doing what the refusal says (``final_layer_norm`` registered again after the layers).
ddpm_frozen:      the ddpm case with the default ``freeze_rng=True`` and 2 micro-batches, against the same strategy on
                  one device (modes ``pipe_frozen`` / ``single_frozen``): every draw happens before the first cut, on
                  stage 0 under the micro-batch's frozen seed, so both runs draw the same numbers.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import StochasticWeightAveraging
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

import lightning_clapping

BATCH = 16


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _classification(n: int, d: int = 16, classes: int = 4, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = _generator(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, classes, generator=g)
    return x, (x @ w).argmax(-1)


class _SGD(L.LightningModule):
    lr = 0.1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


# ------------------------------------------------------------------------------------------------ ddpm
class DDPM(_SGD):
    def __init__(self, dim: int = 8, steps: int = 50):
        super().__init__()
        self.T = steps
        betas = torch.linspace(1e-4, 0.02, steps)
        self.register_buffer("a_bar", torch.cumprod(1 - betas, 0))
        self.time_embed = nn.Embedding(steps, 8)
        self.net = nn.Sequential(nn.Linear(dim + 8, 32), nn.SiLU(), nn.Linear(32, 32), nn.SiLU(), nn.Linear(32, dim))

    def forward(self, x_t, t):
        return self.net(torch.cat([x_t, self.time_embed(t)], dim=-1))

    def training_step(self, batch, batch_idx):
        x = batch[0]
        noise = torch.randn_like(x)
        t = torch.randint(0, self.T, (x.shape[0],), device=self.device)
        a = self.a_bar[t].unsqueeze(-1)
        x_t = a.sqrt() * x + (1 - a).sqrt() * noise
        loss = F.mse_loss(self(x_t, t), noise)
        self.log("train_loss", loss)
        return loss


# ------------------------------------------------------------------------------------------------ mlm
class ResidualBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class MaskedLM(_SGD):
    def __init__(self, vocab: int = 20, d: int = 16, mask_token_id: int = 1):
        super().__init__()
        self.mask_token_id = mask_token_id
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([ResidualBlock(d) for _ in range(2)])
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        labels = ids.clone()
        mask = torch.rand(ids.shape) < 0.15
        inputs = ids.clone()
        inputs[mask] = self.mask_token_id
        logits = self(inputs)
        loss = F.cross_entropy(logits[mask], labels[mask])
        self.log("train_loss", loss)
        return loss


# ------------------------------------------------------------------------------------------------ mixup
class MLP(_SGD):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss


class Mixup(MLP):
    def __init__(self, numpy_lam: bool = False):
        super().__init__()
        self.numpy_lam = numpy_lam

    def training_step(self, batch, batch_idx):
        x, y = batch
        perm = torch.randperm(x.size(0))
        if self.numpy_lam:
            lam = float(np.random.beta(0.4, 0.4))
        else:
            lam = torch.distributions.Beta(0.4, 0.4).sample()
        mixed = lam * x + (1 - lam) * x[perm]
        out = self(mixed)
        loss = lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[perm])
        self.log("train_loss", loss)
        return loss


# ------------------------------------------------------------------------------------------------ running_sum
class RunningSum(MLP):
    def __init__(self):
        super().__init__()
        self.total = torch.zeros(())

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.total += loss.detach()
        return loss

    def on_train_epoch_end(self):
        self.log("total", self.total)


# ------------------------------------------------------------------------------------------------ blocks in a loop
class Blocks(_SGD):
    """An input layer, blocks run in the LightningModule's own loop, an output layer."""

    def __init__(self, depth: int = 3):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(depth)])
        self.out = nn.Linear(32, 4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss


class DropoutParent(Blocks):
    def forward(self, x):
        x = self.inp(x)
        for blk in self.blocks:
            x = F.dropout(x, 0.1, self.training)
            x = blk(x)
        return self.out(x)


class StochasticDepth(Blocks):
    def __init__(self):
        super().__init__(depth=4)

    def forward(self, x):
        x = self.inp(x)
        for blk in self.blocks:
            if self.training and torch.rand(()) < 0.2:
                continue
            x = blk(x)
        return self.out(x)


# ------------------------------------------------------------------------------------------------ grad_reverse
class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha):
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.alpha * grad, None


class DANN(_SGD):
    def __init__(self, total_steps: int = 5):
        super().__init__()
        self.total_steps = total_steps
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh())
        self.classifier = nn.Linear(16, 4)
        self.discriminator = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y, domain = batch
        p = (self.global_step + 1) / self.total_steps
        alpha = 2.0 / (1.0 + math.exp(-10 * p)) - 1
        features = self.backbone(x)
        class_loss = F.cross_entropy(self.classifier(features), y)
        domain_loss = F.cross_entropy(self.discriminator(GradReverse.apply(features, alpha)), domain)
        loss = class_loss + domain_loss
        self.log("train_loss", loss)
        return loss


class SignSTE(torch.autograd.Function):
    """sign() forward, a clipped identity backward (binary hashing's straight-through estimator)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.sign(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (x.abs() <= 1).to(grad.dtype)


class Hashing(DANN):
    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        features = self.backbone(x)
        class_loss = F.cross_entropy(self.classifier(features), y)
        codes = SignSTE.apply(features)  # after the cut: the features crossed it
        loss = class_loss + 0.1 * (codes * self.discriminator[0].weight[0, :16]).sum()
        self.log("train_loss", loss)
        return loss


class Writes(DANN):
    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        features = self.backbone(x)
        indexed = torch.zeros(x.shape[0], 4)
        indexed[:, :2] = features[:, :2]  # x[...] = v returns nothing: the written tensor is the value
        viewed = torch.zeros(x.shape[0], 4)
        viewed[:, 2:].copy_(features[:, 4:6] * 2)  # written through a view: its base changes
        loss = F.cross_entropy(self.classifier(features), y) + indexed.pow(2).mean() + viewed.pow(2).mean()
        self.log("train_loss", loss)
        return loss


class RankDependent(DANN):
    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        weights = torch.ones(x.shape[0]) * (1 + self.trainer.global_rank)  # differs between the processes
        features = self.backbone(x)
        loss = (F.cross_entropy(self.classifier(features), y, reduction="none") * weights).mean()
        return loss


class Drift(DANN):
    """A scale kept as a plain tensor attribute, used before the cut (on the input) and after it (in the loss), and
    changed in ``on_train_epoch_end``, a hook that runs on the last stage only: from the second epoch on, the stages
    compute with different scales."""

    def __init__(self, total_steps: int = 5):
        super().__init__(total_steps)
        self.scale = torch.ones(())

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        weights = self.scale.expand(x.shape[0]).clone()
        features = self.backbone(x * self.scale)
        return (F.cross_entropy(self.classifier(features), y, reduction="none") * weights).mean()

    def on_train_epoch_end(self):
        self.scale.mul_(0.5)


class MAE(_SGD):
    """A masked autoencoder as MAE's reference code writes it: random masking inside the encoder's method, encoder
    and decoder blocks in ModuleLists run in the parent's loops, the loss on the masked patches."""

    def __init__(self, patch_dim=12, L_=16, d=16, dd=8, depth=2, ddepth=2, mask_ratio=0.75):
        super().__init__()
        self.mask_ratio = mask_ratio
        self.patch_embed = nn.Linear(patch_dim, d)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = nn.Parameter(torch.randn(1, L_ + 1, d) * 0.02, requires_grad=False)
        self.blocks = nn.ModuleList([ResidualBlock(d) for _ in range(depth)])
        self.norm = nn.LayerNorm(d)
        self.decoder_embed = nn.Linear(d, dd)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dd))
        self.decoder_pos_embed = nn.Parameter(torch.randn(1, L_ + 1, dd) * 0.02, requires_grad=False)
        self.decoder_blocks = nn.ModuleList([ResidualBlock(dd) for _ in range(ddepth)])
        self.decoder_norm = nn.LayerNorm(dd)
        self.decoder_pred = nn.Linear(dd, patch_dim)
        torch.nn.init.normal_(self.cls_token, std=0.02)
        torch.nn.init.normal_(self.mask_token, std=0.02)

    def random_masking(self, x, mask_ratio):
        N, L_, D = x.shape
        len_keep = int(L_ * (1 - mask_ratio))
        noise = torch.rand(N, L_, device=x.device)
        ids_shuffle = torch.argsort(noise, dim=1)
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        ids_keep = ids_shuffle[:, :len_keep]
        x_masked = torch.gather(x, dim=1, index=ids_keep.unsqueeze(-1).repeat(1, 1, D))
        mask = torch.ones([N, L_], device=x.device)
        mask[:, :len_keep] = 0
        mask = torch.gather(mask, dim=1, index=ids_restore)
        return x_masked, mask, ids_restore

    def forward_encoder(self, x, mask_ratio):
        x = self.patch_embed(x)
        x = x + self.pos_embed[:, 1:, :]
        x, mask, ids_restore = self.random_masking(x, mask_ratio)
        cls_token = self.cls_token + self.pos_embed[:, :1, :]
        cls_tokens = cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat((cls_tokens, x), dim=1)
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x)
        return x, mask, ids_restore

    def forward_decoder(self, x, ids_restore):
        x = self.decoder_embed(x)
        mask_tokens = self.mask_token.repeat(x.shape[0], ids_restore.shape[1] + 1 - x.shape[1], 1)
        x_ = torch.cat([x[:, 1:, :], mask_tokens], dim=1)
        x_ = torch.gather(x_, dim=1, index=ids_restore.unsqueeze(-1).repeat(1, 1, x.shape[2]))
        x = torch.cat([x[:, :1, :], x_], dim=1)
        x = x + self.decoder_pos_embed
        for blk in self.decoder_blocks:
            x = blk(x)
        x = self.decoder_norm(x)
        x = self.decoder_pred(x)
        return x[:, 1:, :]

    def forward_loss(self, target, pred, mask):
        loss = ((pred - target) ** 2).mean(dim=-1)
        return (loss * mask).sum() / mask.sum()

    def forward(self, imgs):
        latent, mask, ids_restore = self.forward_encoder(imgs, self.mask_ratio)
        pred = self.forward_decoder(latent, ids_restore)
        loss = self.forward_loss(imgs, pred, mask)
        return loss, pred, mask

    def training_step(self, batch, batch_idx):
        loss, _, _ = self(batch[0])
        return loss


class CatVAE(_SGD):
    """The categorical VAE as tutorials write it: view to (B, latent, categories), gumbel over the last dim, KL."""

    def __init__(self, d=16, latent=4, cats=5):
        super().__init__()
        self.latent, self.cats = latent, cats
        self.encoder = nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, latent * cats))
        self.decoder = nn.Sequential(nn.Linear(latent * cats, 32), nn.ReLU(), nn.Linear(32, d), nn.Sigmoid())

    def forward(self, x):
        q = self.encoder(x.view(-1, 16))
        q_y = q.view(q.size(0), self.latent, self.cats)
        z = F.gumbel_softmax(q_y, tau=max(0.5, math.exp(-1e-3 * self.global_step)), hard=True)
        return self.decoder(z.view(-1, self.latent * self.cats)), F.softmax(q_y, dim=-1).reshape(*q.size())

    def training_step(self, batch, batch_idx):
        x = batch[0]
        recon, qy = self(x)
        bce = F.binary_cross_entropy(recon, x, reduction="sum") / x.shape[0]
        log_ratio = torch.log(qy * self.cats + 1e-20)
        kld = torch.sum(qy * log_ratio, dim=-1).mean()
        loss = bce + kld
        self.log("loss", loss)
        return loss


class CheckpointedLoop(_SGD):
    """``torch.utils.checkpoint`` around each block, in the parent's loop."""

    def __init__(self, d=16, depth=4):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(depth)])
        self.out = nn.Linear(d, 4)

    def forward(self, x):
        x = self.inp(x)
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=False)
        return self.out(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)


class MeanTeacher(MLP):
    """A mean teacher: a copy of the network, updated in ``on_train_batch_end`` as an exponential moving average of
    the student's weights, and a consistency loss between the two."""

    def __init__(self):
        super().__init__()
        self.teacher = copy.deepcopy(self.net)
        for p in self.teacher.parameters():
            p.requires_grad_(False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        student = self(x)
        with torch.no_grad():
            teacher = self.teacher(x)
        loss = F.cross_entropy(student, y) + F.mse_loss(student.softmax(-1), teacher.softmax(-1))
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        with torch.no_grad():
            for t, s in zip(self.teacher.parameters(), self.net.parameters()):
                t.mul_(0.9).add_(s, alpha=0.1)


class BertMLM(_SGD):
    """Hugging Face BERT for masked LM from a config, dropout on, masked in ``training_step`` as transformers'
    DataCollatorForLanguageModeling masks: 15 % of the tokens, 80 % of those replaced by [MASK], 10 % by a random
    token (its decoder is tied to the word embeddings, on the other stage)."""

    def __init__(self):
        super().__init__()
        from transformers import BertConfig, BertForMaskedLM

        config = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.1,
                            attention_probs_dropout_prob=0.1)
        self.model = BertForMaskedLM(config)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        labels = ids.clone()
        masked = torch.bernoulli(torch.full(labels.shape, 0.15)).bool()
        labels[~masked] = -100
        replaced = torch.bernoulli(torch.full(labels.shape, 0.8)).bool() & masked
        ids = ids.clone()
        ids[replaced] = 3  # [MASK]
        randomized = torch.bernoulli(torch.full(labels.shape, 0.5)).bool() & masked & ~replaced
        ids[randomized] = torch.randint(40, labels.shape)[randomized]
        loss = self.model(input_ids=ids, labels=labels).loss
        self.log("train_loss", loss)
        return loss


class OPT(_SGD):
    """Hugging Face OPT from a config: its decoder registers ``final_layer_norm`` before ``layers`` and calls it after
    them. ``reordered``: what the refusal says to do, registering it again after the layers."""

    def __init__(self, reordered: bool = False):
        super().__init__()
        from transformers import OPTConfig, OPTForCausalLM

        config = OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, ffn_dim=32, num_attention_heads=2,
                           max_position_embeddings=32, word_embed_proj_dim=16, dropout=0.0, attention_dropout=0.0)
        self.model = OPTForCausalLM(config)
        if reordered:
            decoder = self.model.model.decoder
            decoder.final_layer_norm = decoder._modules.pop("final_layer_norm")

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss)
        return loss


# ------------------------------------------------------------------------------------------------ the cases
SPLITS = {
    "ddpm": ["net.2"],
    "mlm": ["blocks.1"],
    "mixup_torch": ["net.2"],
    "mixup_numpy": ["net.2"],
    "running_sum": ["net.2"],
    "dropout_parent": ["blocks.1"],
    "stochastic_depth": ["blocks.2"],
    "grad_reverse": ["classifier"],
    "swa": ["net.2"],
    "hashing": ["classifier"],
    "writes": ["classifier"],
    "rank_dependent": ["classifier"],
    "ddpm_frozen": ["net.2"],
    "opt": ["model.model.decoder.layers.1"],
    "hf_bert_mlm": ["model.bert.encoder.layer.1"],
    "mean_teacher": ["net.2"],
    "drift": ["classifier"],
    "mae": ["decoder_embed"],
    "checkpoint_loop": ["blocks.2"],
    "gumbel_vae": ["decoder"],
    "opt_reordered": ["model.model.decoder.layers.1"],
}
STRATEGY = {"drift": {"recheck_every": 2}}  # the strategy's arguments a case sets besides the common ones
EPOCHS = 2  # the loader is iterated anew between them (in one process it draws its workers' seed from the RNG)
STEPS_PER_EPOCH = 3


def build(case: str) -> tuple[L.LightningModule, DataLoader, list[L.Callback]]:
    """The model, the training loader (no shuffling) and the case's own callbacks."""
    n = STEPS_PER_EPOCH * BATCH
    callbacks: list[L.Callback] = []
    if case in ("ddpm", "ddpm_frozen"):
        model = DDPM()
        data = (torch.randn(n, 8, generator=_generator(1)),)
    elif case == "mlm":
        model = MaskedLM()
        data = (torch.randint(2, 20, (n, 8), generator=_generator(1)),)
    elif case in ("mixup_torch", "mixup_numpy"):
        model, data = Mixup(numpy_lam=case == "mixup_numpy"), _classification(n)
    elif case == "running_sum":
        model, data = RunningSum(), _classification(n)
    elif case == "dropout_parent":
        model, data = DropoutParent(), _classification(n)
    elif case == "stochastic_depth":
        model, data = StochasticDepth(), _classification(n)
    elif case in ("grad_reverse", "hashing", "writes", "rank_dependent", "drift"):
        x, y = _classification(n)
        domain = torch.randint(0, 2, (n,), generator=_generator(2))
        kind = {"grad_reverse": DANN, "hashing": Hashing, "writes": Writes, "rank_dependent": RankDependent,
                "drift": Drift}[case]
        model, data = kind(total_steps=EPOCHS * STEPS_PER_EPOCH), (x, y, domain)
    elif case == "hf_bert_mlm":
        model, data = BertMLM(), (torch.randint(5, 40, (n, 12), generator=_generator(1)),)
    elif case in ("opt", "opt_reordered"):
        model = OPT(reordered=case == "opt_reordered")
        data = (torch.randint(0, 64, (n, 12), generator=_generator(1)),)
    elif case == "mae":
        model, data = MAE(), (torch.randn(n, 16, 12, generator=_generator(1)),)
    elif case == "gumbel_vae":
        model, data = CatVAE(), (torch.rand(n, 16, generator=_generator(1)),)
    elif case == "checkpoint_loop":
        model, data = CheckpointedLoop(), _classification(n)
    elif case == "mean_teacher":
        model, data = MeanTeacher(), _classification(n)
    elif case == "swa":
        model, data = MLP(), _classification(n)
        callbacks.append(StochasticWeightAveraging(swa_lrs=0.1, swa_epoch_start=1))
    else:
        raise SystemExit(f"unknown case {case!r}")
    loader = DataLoader(TensorDataset(*data), batch_size=BATCH)  # no shuffling, no generator of its own
    return model, loader, callbacks


class SeedAtTrainStart(L.Callback):
    """``seed_everything(0)`` again when training starts, on every rank. Distributed strategies (DDP's, and this one's
    ``setup_environment``) call Lightning's ``reset_seed()`` when they set up the processes; a one-device Trainer does
    not, so without this the global RNG at the first step would differ for a reason that is not the pattern's.
    Everything after it (the loader's draws between epochs included) is the strategy's to keep as one process has it.
    """

    def on_train_start(self, trainer, pl_module):
        L.seed_everything(0, verbose=False)


class Recorder(L.Callback):
    """The loss every rank got back for each step, and how many batches started."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.started = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.started += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))


def main(out: Path, case: str, mode: str) -> None:
    rank = int(os.environ.get("LOCAL_RANK", 0))
    row: dict = {"case": case, "mode": mode, "rank": rank, "error": None}
    recorder = Recorder()
    try:
        L.seed_everything(0)
        model, loader, callbacks = build(case)
        if mode == "pipe":
            strategy = lightning_clapping.ClappingStrategy(split_points=SPLITS[case], microbatches=1,
                                                           freeze_rng=False, **STRATEGY.get(case, {}),
                                                           timeout=timedelta(seconds=60))  # a hang fails in time
            devices = 2
        elif mode == "single":
            strategy, devices = "auto", 1
        elif mode in ("pipe_frozen", "single_frozen"):  # the default freeze_rng=True, 2 micro-batches
            devices = 2 if mode == "pipe_frozen" else 1
            strategy = lightning_clapping.ClappingStrategy(split_points=SPLITS[case] if devices > 1 else None,
                                                           microbatches=2, timeout=timedelta(seconds=60))
        else:
            raise SystemExit(f"unknown mode {mode!r}")
        trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=EPOCHS,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
                            default_root_dir=out / f"{case}_{mode}",
                            callbacks=[SeedAtTrainStart(), recorder, *callbacks])
        trainer.fit(model, loader)
        row["global_rank"] = trainer.global_rank
        row["metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
        if trainer.global_rank == 0:
            torch.save({k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                       out / f"{case}_{mode}_weights.pt")
    except BaseException as err:
        chain, seen = [], err
        while seen is not None and len(chain) < 8:  # the exception and those it was raised from / while handling
            chain.append(f"{type(seen).__name__}: {seen}")
            seen = seen.__cause__ or seen.__context__
        row["error"] = {"type": type(err).__name__, "message": str(err), "chain": chain}
        raise
    finally:
        row["losses"], row["batches_started"] = recorder.losses, recorder.started
        (out / f"{case}_{mode}_rank{rank}.json").write_text(json.dumps(row))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
