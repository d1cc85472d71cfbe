"""A model built on the meta device gets its own initialisation on every stage, the same whatever the cut.

Each stage is simulated in this process as a rank does it: the model is built afresh under the strategy's meta
context (``building_on_meta``, what ``configure_model()`` and ``trainer.init_module(empty_init=True)`` run under),
cut, and only that stage's modules are materialized (``stage_setup.materialize_own_stage``).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from conftest import has_minilm
from lightning_clapping.pipeline.materialize import building_on_meta, materialize_module
from lightning_clapping.pipeline.partition import build_partition
from lightning_clapping.stage_setup import materialize_own_stage


def stage_tensors(build, stages: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """What each of ``stages`` ranks holds after materializing its stage (parameters and buffers by name)."""
    out = []
    for stage in range(stages):
        with building_on_meta():
            model = build()
        materialize_own_stage(model, build_partition(model, stages, None), stage, torch.device("cpu"), seed=seed)
        named = dict(model.named_parameters()) | dict(model.named_buffers())
        out.append({k: v.detach().clone() for k, v in named.items() if not v.is_meta})
    return out


def whole(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return merged


def one_process(build, seed: int = 0) -> dict[str, torch.Tensor]:
    with building_on_meta():
        model = build()
    materialize_module(model, seed=seed)
    return dict(model.named_parameters()) | dict(model.named_buffers())


# ------------------------------------------------------------------- a parent that initialises its children
class Block(nn.Module):
    def __init__(self, d: int, t: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)
        self.register_buffer("mask", torch.tril(torch.ones(t, t, dtype=torch.bool)), persistent=False)

    def forward(self, x):
        return x + self.c_proj(torch.relu(self.fc(self.ln(x))))


class GPTStyle(nn.Module):
    """Written the way nanoGPT is: children built with torch's defaults, then the parent re-initialises them all
    (``self.apply(self._init_weights)``), rescales the residual projections by name, and holds a parameter of its
    own (so that its ``reset_parameters`` over the children runs on every stage)."""

    def __init__(self, vocab: int = 32, d: int = 16, layers: int = 4, t: int = 8) -> None:
        super().__init__()
        self.layers = layers
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, t, d))
        self.scale = nn.Parameter(torch.ones(d))
        self.blocks = nn.ModuleList(Block(d, t) for _ in range(layers))
        self.head = nn.Linear(d, vocab)
        self.reset_parameters()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(std=0.02)
            module.weight.data[0].zero_()  # a padding row, written through a view of .data

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.pos, std=0.02)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.layers))

    def forward(self, idx):
        x = self.tok(idx) + self.pos[:, : idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(x * self.scale)


def test_a_parent_that_initialises_its_children_gives_the_same_weights_on_1_2_and_4_stages():
    one = whole(stage_tensors(GPTStyle, 1))
    for stages in (2, 4):
        merged = whole(stage_tensors(GPTStyle, stages))
        assert merged.keys() == one.keys()
        assert [k for k in one if not torch.equal(one[k], merged[k])] == [], stages
    assert one.keys() == one_process(GPTStyle).keys()
    assert all(torch.equal(one[k], v) for k, v in one_process(GPTStyle).items())
    # the values are the model's own: its _init_weights, the rescaled projections, the view writes and
    # what the constructors computed (ones, a causal mask), not torch's default initialisation
    assert abs(float(one["blocks.0.fc.weight"].std()) - 0.02) < 0.004
    assert abs(float(one["blocks.3.c_proj.weight"].std()) - 0.02 / math.sqrt(8)) < 0.0015
    assert torch.count_nonzero(one["head.bias"]) == 0 and torch.count_nonzero(one["tok.weight"][0]) == 0
    assert torch.equal(one["scale"], torch.ones(16)) and one["pos"].abs().max() > 0
    assert torch.equal(one["blocks.2.mask"], torch.tril(torch.ones(8, 8, dtype=torch.bool)))
    # another seed, other weights
    assert not torch.equal(whole(stage_tensors(GPTStyle, 2, seed=1))["blocks.0.fc.weight"], one["blocks.0.fc.weight"])


def test_tied_tensors_stay_tied_and_keep_their_attributes():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(8, 4)
            self.out = nn.Linear(4, 8, bias=False)
            self.out.weight = self.emb.weight
            self.emb.weight.no_decay = True

    with building_on_meta():
        model = Tied()
    materialize_module(model)
    assert model.out.weight is model.emb.weight and not model.emb.weight.is_meta
    assert getattr(model.emb.weight, "no_decay", False)


# ----------------------------------------------------------------------------------- Hugging Face from config
def _hf(family: str):
    transformers = pytest.importorskip("transformers")
    small = dict(vocab_size=64, hidden_size=16, num_hidden_layers=4, num_attention_heads=2, intermediate_size=32,
                 max_position_embeddings=16)
    if family == "bert":
        config = transformers.BertConfig(**small, pad_token_id=0)
        return lambda: transformers.BertModel(config)
    if family == "llama":
        config = transformers.LlamaConfig(**small, num_key_value_heads=2)
        return lambda: transformers.LlamaForCausalLM(config)
    config = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=4, n_head=2, n_positions=16,
                                     tie_word_embeddings=False)
    return lambda: transformers.GPT2LMHeadModel(config)


@pytest.mark.skipif(not has_minilm(), reason="needs transformers (the test extras)")
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_a_hugging_face_model_from_config_materializes_per_stage_with_its_own_initialisation(family):
    build = _hf(family)
    reference = one_process(build)
    for stages in (2, 4):
        merged = whole(stage_tensors(build, stages))
        assert merged.keys() == reference.keys()
        assert [k for k in reference if not torch.equal(reference[k], merged[k])] == [], stages
    # the model's _init_weights (post_init in one process), not torch's defaults (std 0.14 for these layers)
    linears = {k: v for k, v in reference.items() if v.dim() == 2 and v.numel() >= 256 and "c_proj" not in k}
    assert linears and all(abs(float(w.std()) - 0.02) < 0.004 for w in linears.values())
    norms = [v for k, v in reference.items() if ("norm" in k.lower() or "ln_" in k) and k.endswith("weight")]
    assert norms and all(torch.equal(w, torch.ones_like(w)) for w in norms)
    if family == "bert":
        assert torch.equal(reference["embeddings.position_ids"], torch.arange(16)[None])
        assert torch.count_nonzero(reference["embeddings.word_embeddings.weight"][0]) == 0  # the padding row
    if family == "gpt2":  # GPT-2's residual projections, scaled by 1/sqrt(2 x layers)
        assert abs(float(reference["transformer.h.0.attn.c_proj.weight"].std()) - 0.02 / math.sqrt(8)) < 0.002
    if family == "llama":  # the rotary table (a module without parameters) is materialized on every stage
        inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float) / 8))
        for part in stage_tensors(build, 4):
            assert torch.equal(part["model.rotary_emb.inv_freq"], inv_freq)
            assert torch.equal(part["model.rotary_emb.original_inv_freq"], inv_freq)
