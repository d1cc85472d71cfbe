"""The opt-in boundary bottleneck: a model change that the pipeline cuts between its two halves."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import launch_forked
from lightning_clapping import Bottleneck, build_partition

sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("bottleneck")
    for mode, ranks in (("single", 1), ("pipe", 2), ("pipe_after", 2)):
        launch_forked("bottleneck_run.py", str(out), mode, ranks=ranks, cwd=out)
    return out


def test_a_split_point_naming_a_bottleneck_cuts_between_its_halves():
    from bottleneck_run import BottleneckMLP

    part = build_partition(BottleneckMLP(), 2, ["net.2"])
    assert part.cut_points == ("net.2.up",)
    assert part.unit_stage["net.2.down"] == 0 and part.unit_stage["net.2.up"] == 1


def test_the_bottlenecked_model_trains_on_stages_as_in_one_process(runs):
    single = json.loads((runs / "bottleneck_single.json").read_text())
    pipe = json.loads((runs / "bottleneck_pipe.json").read_text())
    assert len(pipe["losses"]) == 4 and pipe["losses"] == pytest.approx(single["losses"], rel=0, abs=1e-5)
    a, b = torch.load(runs / "bottleneck_single.pt"), torch.load(runs / "bottleneck_pipe.pt")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5, msg=lambda m: f"{k}: {m}")


def test_the_wire_carries_the_code_not_the_full_width(runs):
    from bottleneck_run import BATCH, RANK

    code = json.loads((runs / "bottleneck_pipe.json").read_text())["totals"]
    wide = json.loads((runs / "bottleneck_pipe_after.json").read_text())["totals"]
    # the same messages (headers, step results) but for the boundary tensor: per step the batch's [BATCH, 32] values
    # after the bottleneck against its [BATCH, RANK] code, forward and back, as fp32
    assert code["steps"] == wide["steps"] == 4
    assert wide["raw_bytes"] - code["raw_bytes"] == 4 * 2 * BATCH * (32 - RANK) * 4
    assert wide["bytes"] - code["bytes"] == 4 * 2 * BATCH * (32 - RANK) * 4


def test_the_checkpoint_holds_the_projection_and_one_process_runs_through_it(runs):
    from bottleneck_run import BottleneckMLP

    trained = torch.load(runs / "bottleneck_pipe.pt")
    model = BottleneckMLP.load_from_checkpoint(runs / "bottleneck_pipe.ckpt", map_location="cpu")
    state = model.state_dict()
    assert {"net.2.down.weight", "net.2.up.weight"} <= state.keys()
    for k, v in trained.items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=0, msg=lambda m: f"{k}: {m}")
    x = torch.randn(5, 16)
    h = model.net[1](model.net[0](x))
    code = h @ state["net.2.down.weight"].t()
    assert torch.allclose(model.net[2](h), code @ state["net.2.up.weight"].t(), atol=1e-6)


def test_a_bottleneck_starts_as_an_orthogonal_projection_and_refuses_bad_sizes():
    b = Bottleneck(16, 4)
    torch.testing.assert_close(b.down.weight @ b.down.weight.t(), torch.eye(4), atol=1e-5, rtol=0)
    x = torch.randn(3, 16)
    torch.testing.assert_close(b(b(x)), b(x), atol=1e-5, rtol=0)  # a projection: applying it twice changes nothing
    with pytest.raises(ValueError, match="smaller than features"):
        Bottleneck(8, 8)
    with pytest.raises(ValueError, match="positive integer"):
        Bottleneck(8, 0)
    with pytest.raises(ValueError, match="last dimension is 7"):
        b(torch.randn(2, 7))


def test_a_rescaled_bottleneck_keeps_an_even_input_s_energy_with_balanced_halves():
    torch.manual_seed(0)
    x = torch.randn(20000, 64)
    energy = x.pow(2).sum(-1).mean()
    with torch.no_grad():
        plain, rescaled = Bottleneck(64, 8), Bottleneck(64, 8, init="rescaled")
        # the projection keeps rank / features of it, the rescaled start all of it (within sampling noise)
        torch.testing.assert_close(plain(x).pow(2).sum(-1).mean() / energy, torch.tensor(8 / 64), atol=0.01, rtol=0)
        torch.testing.assert_close(rescaled(x).pow(2).sum(-1).mean() / energy, torch.tensor(1.0), atol=0.05, rtol=0)
        # both halves carry the same gain, (64 / 8) ** 0.25, in every direction they use
        for half in (rescaled.down.weight, rescaled.up.weight):
            torch.testing.assert_close(torch.linalg.svdvals(half), torch.full((8,), 8 ** 0.25), atol=1e-5, rtol=0)
    assert "init='rescaled'" in repr(rescaled)
    with pytest.raises(ValueError, match="init must be one of 'projection', 'rescaled'"):
        Bottleneck(64, 8, init="xavier")


# ------------------------------------------------------------------- a Bottleneck put into a Hugging Face GPT-2
@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    """GPT-2 (transformers, built from a config) with its second block wrapped by ``BottleneckAfter(block, 32, 8)``:
    on 2 stages cut at the bottleneck, the same model cut after the wrapper (``gpt2bnwide``), and one process; and
    the bottleneck started by ``FitBottlenecks`` (``gpt2bnfit``), on 2 stages and in one process."""
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("hf_bottleneck")
    launch_forked("tied_run.py", str(out), "pipe", "gpt2bn,gpt2bnwide,gpt2bnfit", ranks=2, cwd=out, timeout=600)
    launch_forked("tied_run.py", str(out), "single", "gpt2bn,gpt2bnfit", ranks=1, cwd=out, timeout=600)
    return out


def _hf_row(out, case, mode, rank=0):
    return json.loads((out / f"{case}_{mode}_rank{rank}.json").read_text())


def test_a_bottleneck_in_a_hugging_face_gpt2_trains_on_2_stages_as_in_one_process(hf_runs):
    pipe, single = _hf_row(hf_runs, "gpt2bn", "pipe"), _hf_row(hf_runs, "gpt2bn", "single")
    assert pipe["cut_points"] == ["model.transformer.h.1.bottleneck.up"]
    assert len(pipe["losses"]) == 4 and pipe["losses"] == pytest.approx(single["losses"], rel=0, abs=1e-5)
    a, b = torch.load(hf_runs / "gpt2bn_single_weights.pt"), torch.load(hf_runs / "gpt2bn_pipe_weights.pt")
    assert a.keys() == b.keys() and "model.transformer.h.1.bottleneck.down.weight" in a
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5, msg=lambda m: f"{k}: {m}")


def test_fit_bottlenecks_starts_a_hugging_face_gpt2_on_2_stages_as_in_one_process(hf_runs):
    pipe, single = _hf_row(hf_runs, "gpt2bnfit", "pipe"), _hf_row(hf_runs, "gpt2bnfit", "single")
    assert len(pipe["losses"]) == 4 and pipe["losses"] == pytest.approx(single["losses"], rel=0, abs=1e-5)
    assert pipe["losses"][0] != pytest.approx(_hf_row(hf_runs, "gpt2bn", "pipe")["losses"][0], rel=0, abs=1e-3)
    a, b = torch.load(hf_runs / "gpt2bnfit_single_weights.pt"), torch.load(hf_runs / "gpt2bnfit_pipe_weights.pt")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5, msg=lambda m: f"{k}: {m}")


def test_only_the_code_crosses_a_cut_at_a_hugging_face_model_s_bottleneck(hf_runs):
    from tied_run import BOTTLENECK_RANK, SEQ

    batch = 4  # a step of 8 sequences in 2 micro-batches
    code, wide = _hf_row(hf_runs, "gpt2bn", "pipe"), _hf_row(hf_runs, "gpt2bnwide", "pipe")

    def sent(case):  # what the first stage sent forward and the last one sent back, whichever rank holds them
        rows = [_hf_row(hf_runs, case, "pipe", rank)["sent"] for rank in (0, 1)]
        return {name: shapes for row in rows for name, shapes in row.items()}

    assert sent("gpt2bn") == {"fwd_out": [[batch, SEQ, BOTTLENECK_RANK]], "bwd_out": [[batch, SEQ, BOTTLENECK_RANK]]}
    assert sent("gpt2bnwide") == {"fwd_out": [[batch, SEQ, 32]], "bwd_out": [[batch, SEQ, 32]]}
    # 4 steps x 2 micro-batches, each way: at least the width the code leaves out (the wide cut's message may also
    # hold the block's integer inputs, e.g. position ids)
    assert wide["totals"]["raw_bytes"] - code["totals"]["raw_bytes"] >= 4 * 2 * 2 * batch * SEQ * (32 - 8) * 4


def test_a_hugging_face_model_with_a_bottleneck_loads_in_one_process_and_runs_through_it(hf_runs):
    from tied_run import VOCAB, TiedLM

    loaded = TiedLM.load_from_checkpoint(_hf_row(hf_runs, "gpt2bn", "pipe")["checkpoint"], map_location="cpu")
    trained = torch.load(hf_runs / "gpt2bn_pipe_weights.pt")
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    wrapper = loaded.model.transformer.h[1]
    seen = []
    wrapper.bottleneck.down.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    logits = loaded.model(input_ids=torch.randint(0, VOCAB, (2, 5))).logits
    assert logits.shape == (2, 5, VOCAB) and seen == [torch.Size([2, 5, 8])]


def test_a_bottleneck_after_a_block_passes_the_block_s_arguments_and_compresses_its_first_output():
    from lightning_clapping import BottleneckAfter

    class Block(torch.nn.Module):  # called as a Hugging Face layer is: positional and keyword arguments
        def forward(self, hidden, mask, *, scale=1.0, as_tuple=False):
            out = (hidden + mask) * scale
            return (out, "cache") if as_tuple else out

    wrapped, x, mask = BottleneckAfter(Block(), 6, 2), torch.randn(3, 6), torch.ones(3, 6)
    expected = wrapped.bottleneck((x + mask) * 2.0)
    torch.testing.assert_close(wrapped(x, mask, scale=2.0), expected, rtol=0, atol=0)
    out = wrapped(x, mask, scale=2.0, as_tuple=True)
    assert out[1] == "cache"
    torch.testing.assert_close(out[0], expected, rtol=0, atol=0)
    assert wrapped.bottleneck.rank == 2 and isinstance(wrapped.block, Block)
    wrapped.block.attention_type = "sliding"  # what a model's loop may read from its layers
    assert wrapped.attention_type == "sliding"
    with pytest.raises(AttributeError):
        wrapped.not_an_attribute


# ------------------------------------------------------------------- fit_bottlenecks: a start from the data
class _Reversed(torch.nn.Module):
    """Two bottlenecks registered in the opposite order of the one the forward reaches them in."""

    def __init__(self):
        super().__init__()
        self.late = Bottleneck(12, 3)
        self.mix = torch.nn.Linear(12, 12)
        self.early = Bottleneck(12, 3)

    def forward(self, x):
        return self.late(torch.tanh(self.mix(self.early(x))))


def _low_rank_batches(seed=0, features=12, rank=3, n=4):
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(rank, features, generator=g)
    return [torch.randn(64, rank, generator=g) @ basis + 0.01 * torch.randn(64, features, generator=g)
            for _ in range(n)]


def test_a_fitted_bottleneck_keeps_the_directions_its_inputs_span():
    from lightning_clapping import fit_bottlenecks

    torch.manual_seed(0)
    batches = _low_rank_batches()
    b = Bottleneck(12, 3)
    random_error = sum((b(x) - x).pow(2).sum() for x in batches) / sum(x.pow(2).sum() for x in batches)
    kept = fit_bottlenecks(b, batches)
    with torch.no_grad():
        error = sum((b(x) - x).pow(2).sum() for x in batches) / sum(x.pow(2).sum() for x in batches)
    assert random_error > 0.3 and error < 1e-3 and kept[""] == pytest.approx(1 - float(error), abs=1e-6)
    torch.testing.assert_close(b.down.weight @ b.down.weight.t(), torch.eye(3), atol=1e-6, rtol=0)
    assert torch.equal(b.up.weight, b.down.weight.t())
    # each direction's sign is fixed (its largest-magnitude entry positive), so no process may pick the other one
    rows = b.down.weight.detach()
    assert bool((rows.gather(1, rows.abs().argmax(1, keepdim=True)) > 0).all())


def test_bottlenecks_are_fitted_in_the_order_the_forward_reaches_them_and_only_from_the_data():
    from lightning_clapping import fit_bottlenecks

    batches = _low_rank_batches(features=12, rank=5)
    torch.manual_seed(1)
    model = _Reversed().train()
    torch.manual_seed(2)
    other = _Reversed()
    other.mix.load_state_dict(model.mix.state_dict())  # the same model, its bottlenecks started elsewhere
    model.mix.eval()  # a submodule kept in eval mode inside a training model stays so
    kept = fit_bottlenecks(model, batches)
    assert list(kept) == ["early", "late"] and model.training and model.early.training and not model.mix.training
    fitted = {k: v.clone() for k, v in model.state_dict().items()}
    # each one was fitted with the ones before it in place: fitting again finds the same directions
    again = fit_bottlenecks(model, batches)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, fitted[k], atol=1e-5, rtol=0, msg=lambda m: f"{k}: {m}")
    assert again == pytest.approx(kept, abs=1e-6)
    # the start does not depend on the random one it replaces: same batches, same weights (every rank agrees)
    fit_bottlenecks(other, batches)
    for k, v in other.state_dict().items():
        assert torch.equal(v, fitted[k]), k


def test_fit_bottlenecks_refuses_what_it_cannot_fit_with_the_reason():
    from lightning_clapping import fit_bottlenecks

    batches = _low_rank_batches()
    with pytest.raises(ValueError, match="holds no Bottleneck"):
        fit_bottlenecks(torch.nn.Linear(12, 12), batches)
    with pytest.raises(ValueError, match="iterated more than once"):
        fit_bottlenecks(Bottleneck(12, 3), iter(batches))
    model = torch.nn.ModuleDict({"used": Bottleneck(12, 3), "unused": Bottleneck(12, 3)})
    with pytest.raises(ValueError, match="never reached unused"):
        fit_bottlenecks(model, batches, run=lambda x: model["used"](x))
    b = Bottleneck(12, 3)
    before = b.down.weight.detach().clone()
    with pytest.raises(ValueError, match="values reaching .* hold NaN or inf"):
        fit_bottlenecks(b, [batches[0], torch.full((2, 12), float("nan"))])
    assert torch.equal(b.down.weight, before)  # nothing half-fitted
    twice = Bottleneck(12, 3)
    with pytest.raises(ValueError, match="called more than once per forward"):
        fit_bottlenecks(twice, batches, run=lambda x: twice(twice(x)))
    shared = torch.nn.ModuleDict({"a": Bottleneck(12, 3), "b": Bottleneck(12, 3)})
    shared["b"].down = shared["a"].down
    with pytest.raises(ValueError, match="a and b share a weight"):
        fit_bottlenecks(shared, batches, run=lambda x: shared["b"](shared["a"](x)))


def _padded_batches(seed=0, features=12, rank=3, n=4):
    """Dicts of [16, 10, features] values: real tokens in a rank-``rank`` subspace, padding (the last 5 positions of
    every other sample) far larger and along other directions, and the attention mask that tells them apart."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(features, features, generator=g))[0].t()
    out = []
    for _ in range(n):
        x = torch.randn(16, 10, rank, generator=g) @ basis[:rank]
        mask = torch.ones(16, 10, dtype=torch.long)
        mask[::2, 5:] = 0
        junk = 30 * torch.randn(16, 10, features - rank, generator=g) @ basis[rank:]
        out.append({"x": torch.where(mask.bool().unsqueeze(-1), x, junk), "attention_mask": mask})
    return out


def _kept_on_real_tokens(b, batches):
    with torch.no_grad():
        real = torch.cat([d["x"][d["attention_mask"].bool()] for d in batches])
        return float(b.down(real).pow(2).sum() / real.pow(2).sum())


def test_fit_bottlenecks_counts_only_the_positions_asked_for():
    from lightning_clapping import fit_bottlenecks

    batches = _padded_batches()
    b = Bottleneck(12, 3)
    fit_bottlenecks(b, batches, run=lambda d: b(d["x"]))
    everywhere = _kept_on_real_tokens(b, batches)
    kept = fit_bottlenecks(b, batches, run=lambda d: b(d["x"]), positions=lambda d: d["attention_mask"].bool())
    assert everywhere < 0.5  # fitted to the padding's directions, the real tokens lose most of their energy
    assert _kept_on_real_tokens(b, batches) > 1 - 1e-6 and kept[""] == pytest.approx(1.0, abs=1e-6)


def test_fit_bottlenecks_refuses_positions_that_do_not_fit_the_values_with_the_reason():
    from lightning_clapping import fit_bottlenecks

    batches = _padded_batches()
    b = Bottleneck(12, 3)
    before = b.down.weight.detach().clone()
    run = lambda d: b(d["x"])  # noqa: E731
    with pytest.raises(ValueError, match=r"bool tensor shaped like .* \(16, 10\), got torch.int64 \(16, 10\)"):
        fit_bottlenecks(b, batches, run=run, positions=lambda d: d["attention_mask"])
    with pytest.raises(ValueError, match=r"\(16, 10\), got torch.bool \(16,\)"):
        fit_bottlenecks(b, batches, run=run, positions=lambda d: d["attention_mask"][:, 0].bool())
    with pytest.raises(ValueError, match="no position reaching .* counted"):
        fit_bottlenecks(b, batches, run=run, positions=lambda d: torch.zeros(16, 10, dtype=torch.bool))
    assert torch.equal(b.down.weight, before)
    # a later bottleneck that sees other leading dimensions is refused before the first one is fitted
    pooled = torch.nn.ModuleDict({"tokens": Bottleneck(12, 3), "pooled": Bottleneck(12, 3)})
    first = pooled["tokens"].down.weight.detach().clone()
    with pytest.raises(ValueError, match=r"reaches pooled, \(16,\)"):
        fit_bottlenecks(pooled, batches, run=lambda d: pooled["pooled"](pooled["tokens"](d["x"]).mean(1)),
                        positions=lambda d: d["attention_mask"].bool())
    assert torch.equal(pooled["tokens"].down.weight, first)


def test_fit_bottlenecks_leaves_no_hook_and_every_mode_as_it_was_when_the_forward_fails():
    from lightning_clapping import fit_bottlenecks

    model = _Reversed().train()
    model.mix.eval()

    def failing(x):
        model(x)
        raise RuntimeError("the user's forward failed")

    with pytest.raises(RuntimeError, match="forward failed"):
        fit_bottlenecks(model, _low_rank_batches(), run=failing)
    assert all(not m._forward_pre_hooks for m in model.modules())
    assert model.training and model.early.training and not model.mix.training
    # a bottleneck the model calls by keyword is fitted like any other
    kept = fit_bottlenecks(model.early, _low_rank_batches(), run=lambda x: model.early(x=x))
    assert kept[""] > 0.99


def test_fit_bottlenecks_starts_a_hugging_face_model_s_bottleneck_from_what_crosses_the_cut():
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    from lightning_clapping import BottleneckAfter, fit_bottlenecks

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=50, n_positions=16))
    model.transformer.h[1] = BottleneckAfter(model.transformer.h[1], 32, 4)
    bottleneck = model.transformer.h[1].bottleneck
    batches = [torch.randint(0, 50, (4, 16)) for _ in range(3)]
    seen = []
    bottleneck.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach().reshape(-1, 32)))

    def energy_kept():
        seen.clear()
        with torch.no_grad():
            for ids in batches:
                model(input_ids=ids)
            x = torch.cat(seen)
            return float(bottleneck(x).pow(2).sum() / x.pow(2).sum())

    model.eval()
    random_start = energy_kept()
    model.train()
    kept = fit_bottlenecks(model, batches, run=lambda ids: model(input_ids=ids))
    assert list(kept) == ["transformer.h.1.bottleneck"] and model.training
    model.eval()
    fitted = energy_kept()
    # the projection keeps what its eigenvectors span of the inputs it was fitted on, far more than a random one
    assert fitted == pytest.approx(kept["transformer.h.1.bottleneck"], abs=1e-4)
    assert fitted > 2 * random_start
