"""The fused CPU kernels of the per-channel quantizer (numba): the same bytes and values as the eager code, and only
where they apply."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("numba", reason="the fused CPU kernels need numba (in the test extras: pip install -e '.[test]')")

from lightning_clapping.codecs import fused_cpu, get_codec  # noqa: E402
from lightning_clapping.codecs import _numba_kernels  # noqa: E402
from lightning_clapping.codecs.base import NonFiniteError  # noqa: E402


def _message(shape: tuple[int, ...], levels: int, seed: int = 0) -> torch.Tensor:
    """Values whose columns span 60 orders of magnitude, with a zero column, the column's own +-max, and values on
    the midpoints between two codes (where one rounding and two roundings of ``x * inv + offset`` part)."""
    g = torch.Generator().manual_seed(seed)
    cols = shape[-1]
    magnitude = torch.logspace(-30, 30, cols, dtype=torch.float64).float()
    x = torch.randn(shape, generator=g) * magnitude
    x[..., 0] = 0.0
    flat = x.view(-1, cols)
    scale = flat.abs().amax(0)
    flat[0], flat[1] = scale, -scale
    k = torch.randint(-levels, levels, (flat.shape[0] // 2, cols), generator=g)
    flat[2 : 2 + k.shape[0]] = (k + 0.5) / levels * scale  # midpoints between codes k and k + 1
    return x


def _eager(fn):
    with fused_cpu.eager():
        return fn()


class _Spy:
    def __init__(self, monkeypatch):
        self.calls = []
        for name in ("encode_planes", "decode_planes"):
            original = getattr(_numba_kernels, name)
            monkeypatch.setattr(_numba_kernels, name, self._wrap(name, original))

    def _wrap(self, name, original):
        def wrapped(*args):
            self.calls.append(name)
            return original(*args)

        return wrapped


def test_stochastic_rounding_is_encoded_eagerly_and_decoded_by_the_fused_kernels(monkeypatch):
    codec = get_codec("q4:sr")
    x = _message((1024, 128), codec.levels)
    assert not codec.runs_fused(x) and codec.runs_fused(x, decoding=True)
    spy = _Spy(monkeypatch)
    payload = codec.encode(x, seed=3)
    decoded = codec.decode(payload, x.shape, x.dtype, seed=3)
    assert spy.calls == ["decode_planes"]
    assert torch.equal(payload, _eager(lambda: codec.encode(x, seed=3)))
    assert torch.equal(decoded, _eager(lambda: codec.decode(payload, x.shape, x.dtype, seed=3)))


@pytest.mark.parametrize("spec", ["q2", "q4", "q8", "q4:fp16"])
@pytest.mark.parametrize("shape", [(2048, 512), (64, 32, 384), (4096, 48)])
def test_the_fused_kernels_write_the_eager_bytes_and_decode_the_eager_values(monkeypatch, spec, shape):
    codec = get_codec(spec)
    x = _message(shape, codec.levels)
    spy = _Spy(monkeypatch)
    payload = codec.encode(x)
    decoded = codec.decode(payload, x.shape, x.dtype)
    into = codec.decode_into(payload, torch.full_like(x, float("nan")))
    assert spy.calls == ["encode_planes", "decode_planes", "decode_planes"]  # the fused path ran, every time
    eager_payload = _eager(lambda: codec.encode(x))
    eager_decoded = _eager(lambda: codec.decode(eager_payload, x.shape, x.dtype))
    assert torch.equal(payload, eager_payload)
    assert torch.equal(decoded, eager_decoded)
    assert torch.equal(into, eager_decoded)


def test_a_scale_too_small_for_a_float32_inverse_falls_back_to_the_eager_float64_codes(monkeypatch):
    codec = get_codec("q4")
    x = _message((1024, 128), codec.levels)
    x[:, 5] = torch.linspace(-1e-39, 1e-39, 1024)  # a subnormal scale: 7 / s overflows float32
    spy = _Spy(monkeypatch)
    payload = codec.encode(x)
    assert spy.calls == ["encode_planes"]  # tried, refused, and the eager code wrote the codes
    assert torch.equal(payload, _eager(lambda: codec.encode(x)))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), -float("nan")])
def test_a_non_finite_value_is_refused_on_the_fused_path_as_on_the_eager_one(monkeypatch, bad):
    codec = get_codec("q4")
    x = torch.randn(1024, 128)
    x[700, 3] = bad
    spy = _Spy(monkeypatch)
    with pytest.raises(NonFiniteError) as fused:
        codec.encode(x)
    assert codec.runs_fused(x) and spy.calls == []  # the fused maximum found it, before any code was written
    with pytest.raises(NonFiniteError) as eager:
        _eager(lambda: codec.encode(x))
    assert str(fused.value) == str(eager.value)
    assert f"flat index {700 * 128 + 3}" in str(fused.value)


@pytest.mark.parametrize(
    "spec, shape, dtype",
    [
        ("q4", (1024, 128), torch.bfloat16),  # float32 only
        ("q4", (1 << 17,), torch.float32),  # one scale for a 1-D tensor
        ("q4", (255, 256), torch.float32),  # below MIN_VALUES
        ("q4", (1023, 128), torch.float32),  # the two planes of q4 would split a row
        ("q2", (1026, 128), torch.float32),  # the four planes of q2 would split a row
        ("q4", (1026, 129), torch.float32),  # a tail of codes beyond the last 64 (pack_bits packs it bit by bit)
        ("q4:group128", (1024, 128), torch.float32),
        ("q4:tensor", (1024, 128), torch.float32),
        ("q1", (1024, 128), torch.float32),
        ("q3", (1024, 128), torch.float32),
    ],
)
def test_the_eager_code_runs_where_the_fused_kernels_do_not_apply(monkeypatch, spec, shape, dtype):
    codec = get_codec(spec)
    x = torch.randn(shape).to(dtype)
    assert not codec.runs_fused(x)
    spy = _Spy(monkeypatch)
    payload = codec.encode(x)
    codec.decode(payload, x.shape, x.dtype)
    assert spy.calls == []


def test_the_fused_kernels_apply_at_the_smallest_qualifying_message():
    codec = get_codec("q4")
    assert codec.runs_fused(torch.zeros(fused_cpu.MIN_VALUES // 64, 64))
    assert not codec.runs_fused(torch.zeros(fused_cpu.MIN_VALUES // 64 - 2, 64))


def test_the_eager_block_turns_the_fused_kernels_off_and_back_on():
    codec, x = get_codec("q4"), torch.zeros(2048, 64)
    with fused_cpu.eager():
        assert not codec.runs_fused(x)
        with fused_cpu.eager():
            assert not codec.runs_fused(x)
        assert not codec.runs_fused(x)
    assert codec.runs_fused(x)


def test_the_kernels_stay_off_where_this_torch_rounds_its_multiply_adds_twice():
    """torch's plain CPU kernels (no fused multiply-add) give other codes at midpoints: the check at load sees it."""
    code = ("import warnings, torch\n"
            "from lightning_clapping.codecs import get_codec\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    fused = get_codec('q4').runs_fused(torch.zeros(1024, 128))\n"
            "print(fused, any('round the quantizer' in str(w.message) for w in caught))\n")
    out = {}
    for capability in ("default", None):
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        if capability:
            env["ATEN_CPU_CAPABILITY"] = capability
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out[capability] = proc.stdout.split()[-2:]
    assert out["default"] == ["False", "True"]  # eager, and a warning that says why
    assert out[None] == ["True", "False"]  # this machine's own kernels fuse them: the kernels run


def test_kernels_that_disagree_with_the_eager_code_or_fail_to_load_are_not_used(monkeypatch):
    monkeypatch.setattr(fused_cpu, "_kernels", None)
    original = _numba_kernels.decode_planes

    def off_by_one_ulp(p, s, a, bits, out):
        original(p, s, a, bits, out)
        out[...] = out * (1 + 2**-23)

    monkeypatch.setattr(_numba_kernels, "decode_planes", off_by_one_ulp)
    with pytest.warns(UserWarning, match="round the quantizer's multiply-adds otherwise"):
        assert fused_cpu._load() is None
    assert not get_codec("q4").runs_fused(torch.zeros(1024, 128))  # decided once: no second check, no warning
    monkeypatch.setattr(fused_cpu, "_kernels", None)
    monkeypatch.setattr(fused_cpu, "_matches_eager", _raise_cannot_cache)
    with pytest.warns(UserWarning, match="NUMBA_CACHE_DIR"):
        assert fused_cpu._load() is None


def _raise_cannot_cache(kernels):
    raise RuntimeError("cannot cache function '_encode4': no locator available")


def test_without_numba_the_quantizers_ask_for_it_once(monkeypatch):
    asked = []
    monkeypatch.setattr(fused_cpu, "_kernels", None)
    monkeypatch.setattr(fused_cpu, "available", lambda: asked.append(1) or False)
    codec, x = get_codec("q4"), torch.randn(1024, 128)
    for _ in range(3):
        codec.decode(codec.encode(x), x.shape, x.dtype)
    assert asked == [1]


def test_a_lazily_negated_view_is_encoded_eagerly():
    x = torch.randn(512, 256, dtype=torch.cfloat).conj().imag  # a float32 view with torch's negative bit set
    codec = get_codec("q4")
    assert x.is_neg() and not codec.runs_fused(x)
    assert torch.equal(codec.encode(x), codec.encode(x.resolve_neg()))
