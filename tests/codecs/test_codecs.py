"""Codecs: what a payload holds, how exact the round trip is, and how the registry reads codec names."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_clapping import codecs
from lightning_clapping.codecs import registry
from lightning_clapping.codecs import (
    Codec,
    NonFiniteError,
    QuantCodec,
    check_finite,
    compression_ratio,
    get_codec,
    pack_bits,
    register_codec,
    unpack_bits,
)

CASTS = ["bf16", "fp16"] + [name for name in ("fp8", "fp8_e5m2") if name in codecs.available_codecs()]
QUANTIZERS = ["q1", "q1:sr", "q2", "q3", "q4", "q5", "q6", "q7", "q8", "q4:tensor", "q4:group128", "q3:group7:sr",
              "q8:sr", "q2:group64:sr", "q4:fp16", "q8:fp16", "q1:fp16", "q3:group7:fp16:sr", "q4:tensor:fp16"]
SPARSIFIERS = ["topk:0.1", "topk:1", "randk:0.1", "randk:0.5", "topk:0.1+q8", "randk:0.25+q4", "topk:1+q4:fp16",
               "topk:0.2+q4:group16:fp16:sr", "randk:0.5+q2:sr"]
LOWRANK = ["lowrank:4", "lowrank:1:it0", "lowrank:16:it2"]
LOSSY = CASTS + QUANTIZERS + SPARSIFIERS + LOWRANK
ALL = ["identity"] + LOSSY
SHAPES = [(), (0,), (1,), (7,), (63,), (64,), (65,), (3, 0), (5, 13), (2, 3, 129), (128, 64), (1000,)]


def _levels(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def _round_trip(spec, x, seed=0):
    codec = get_codec(spec)
    return codec.decode(codec.encode(x, seed=seed), x.shape, x.dtype, seed=seed)


# -- registry ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ALL + ["q2:sr:group64", "q4:sr:tensor"])
def test_a_codec_name_recreates_the_same_codec(spec):
    codec = get_codec(spec)
    again = get_codec(codec.name)
    assert again.name == codec.name and type(again) is type(codec)


def test_options_are_read_in_any_order_and_named_canonically():
    assert get_codec("q2:sr:group64").name == "q2:group64:sr"
    assert get_codec("q2:sr:fp16:group64").name == "q2:group64:fp16:sr"
    assert get_codec("topk:0.1+q4:sr:fp16").name == "topk:0.1+q4:fp16:sr"


def test_existing_quantizer_names_keep_float32_scales():
    assert get_codec("q4").scale_dtype == torch.float32 and get_codec("q4:fp16").scale_dtype == torch.float16
    assert get_codec("topk:0.1").values is None and get_codec("topk:0.1+q8").values.name == "q8"


def test_a_codec_instance_passes_through_get_codec():
    codec = QuantCodec(4)
    assert get_codec(codec) is codec


def test_an_unknown_codec_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown codec 'zstd'.*identity.*q4.*topk"):
        get_codec("zstd")


@pytest.mark.parametrize("spec", ["q0", "q9", "q16"])
def test_quantizer_widths_outside_one_to_eight_are_refused(spec):
    with pytest.raises(ValueError, match="1..8"):
        get_codec(spec)


@pytest.mark.parametrize("spec", ["topk:1.5", "topk:abc", "topk:0", "randk:-0.1", "topk", "randk:"])
def test_sparsifier_ratios_outside_zero_to_one_are_refused(spec):
    with pytest.raises(ValueError, match=r"ratio in \(0, 1\]"):
        get_codec(spec)


@pytest.mark.parametrize("spec", ["q4:group0", "q4:tensor:group8", "q4:foo", "q4:sr:sr", "q4:", "q4:fp16:fp16",
                                  "q4:bf16", "q4:fp32"])
def test_bad_quantizer_options_are_refused_with_the_allowed_ones(spec):
    with pytest.raises(ValueError, match="allowed.*'fp16'.*'sr'"):
        get_codec(spec)


@pytest.mark.parametrize(("spec", "message"), [
    ("topk:0.1+bf16", r"after '\+' comes a quantizer q1..q8"),
    ("randk:0.1+topk:0.1", r"after '\+' comes a quantizer q1..q8"),
    ("topk:0.1+q9", r"bad value quantizer in 'topk:0.1\+q9'.*1..8"),
    ("topk:0.1+q4:foo", r"bad value quantizer.*allowed"),
    ("randk:0.1+", r"bad value quantizer.*unknown codec"),
    ("topk:2+q8", r"ratio in \(0, 1\]"),
    ("topk", r"'topk:0.1\+q8'"),
])
def test_bad_sparse_value_quantizers_are_refused_saying_what_is_allowed(spec, message):
    with pytest.raises(ValueError, match=message):
        get_codec(spec)


@pytest.mark.parametrize("spec", ["identity:x", "bf16:3"])
def test_codecs_without_options_refuse_options(spec):
    with pytest.raises(ValueError, match="takes no options"):
        get_codec(spec)


def test_registering_a_taken_prefix_needs_replace():
    with pytest.raises(ValueError, match="already registered"):
        register_codec("q4", lambda options: QuantCodec(4))


def test_a_user_codec_registered_in_a_few_lines_works_through_get_codec(monkeypatch):
    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))

    class Negate(Codec):  # a lossless toy: sends -x as raw float32 bytes
        name = "negate"
        lossless = True

        def encode(self, x, *, seed=0):
            return (-x.detach().float()).reshape(-1).view(torch.uint8).clone()

        def decode(self, payload, shape, dtype, *, seed=0):
            return (-payload.view(torch.float32)).to(dtype).reshape(shape)

        def payload_nbytes(self, shape, dtype):
            return 4 * math.prod(shape)

    register_codec("negate", lambda options: Negate())
    x = torch.randn(4, 5)
    codec = get_codec("negate")
    assert torch.equal(_round_trip("negate", x), x)
    assert compression_ratio(codec, (4, 5)) == 1.0
    assert "negate" in codecs.available_codecs()


def test_a_codec_subclass_must_implement_encode_decode_and_payload_size():
    class Incomplete(Codec):
        def encode(self, x, *, seed=0):
            return x

    with pytest.raises(TypeError):
        Incomplete()


# -- payload size --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("spec", ALL)
def test_payload_nbytes_is_the_exact_encoded_length(spec, dtype):
    codec = get_codec(spec)
    for shape in SHAPES:
        x = torch.randn(shape).to(dtype)
        payload = codec.encode(x, seed=1)
        assert payload.numel() == codec.payload_nbytes(x.shape, dtype), shape


@pytest.mark.parametrize("spec", ALL)
def test_a_payload_is_a_contiguous_1d_uint8_tensor(spec):
    payload = get_codec(spec).encode(torch.randn(6, 10))
    assert payload.dtype == torch.uint8 and payload.dim() == 1 and payload.is_contiguous()


def test_q4_packs_two_values_per_byte_plus_float32_scales():
    assert get_codec("q4:tensor").encode(torch.randn(1024)).numel() == 512 + 4
    assert get_codec("q4").encode(torch.randn(16, 64)).numel() == 512 + 4 * 64  # one scale per channel
    assert get_codec("q4:group128").encode(torch.randn(1024)).numel() == 512 + 4 * 8


@pytest.mark.parametrize("bits", range(1, 9))
def test_quantizer_codes_take_ceil_n_bits_over_8_bytes(bits):
    n = 1001
    assert get_codec(f"q{bits}:tensor").encode(torch.randn(n)).numel() == 4 + math.ceil(n * bits / 8)


def test_topk_sends_fp16_values_and_ceil_log2_n_bit_indices():
    n, k = 1000, 100  # indices need ceil(log2(1000)) = 10 bits
    assert get_codec("topk:0.1").encode(torch.randn(n)).numel() == 2 * k + math.ceil(k * 10 / 8)


def test_randk_sends_only_fp16_values():
    assert get_codec("randk:0.1").encode(torch.randn(1000)).numel() == 2 * 100


def test_the_kept_count_uses_the_exact_ratio():
    # 0.3 * 10 is 3.0000000000000004 in floating point; the codec must still keep 3 values
    assert get_codec("topk:0.3").encode(torch.randn(10)).numel() == 2 * 3 + math.ceil(3 * 4 / 8)


def test_fp16_scales_take_two_bytes_each_plus_one_two_byte_exponent():
    assert get_codec("q4:fp16").encode(torch.randn(16, 64)).numel() == 512 + 2 + 2 * 64
    assert get_codec("q4:tensor:fp16").encode(torch.randn(1024)).numel() == 512 + 2 + 2
    assert get_codec("q8:group128:fp16").encode(torch.randn(1000)).numel() == 1000 + 2 + 2 * 8
    assert get_codec("q4:fp16").encode(torch.randn(0, 64)).numel() == 0


@pytest.mark.parametrize(("spec", "n", "expected"), [
    # k = 100 of 1000 values; indices take ceil(log2 1000) = 10 bits: ceil(100 * 10 / 8) = 125 bytes
    ("topk:0.1+q8", 1000, (4 + 100) + 125),  # one float32 scale + 100 one-byte codes
    ("topk:0.1+q4:group16:fp16", 1000, (2 + 2 * 7 + 50) + 125),  # 7 groups of kept values, fp16 scales
    ("randk:0.25+q4", 1000, 4 + 125),  # k = 250 four-bit codes, no indices
    ("randk:0.1+q2:sr", 999, 4 + 25),  # k = ceil(99.9) = 100
])
def test_sparse_quantized_payloads_are_the_quantizers_payload_of_the_kept_values_plus_indices(spec, n, expected):
    codec = get_codec(spec)
    assert codec.payload_nbytes((n,), torch.float32) == expected
    assert codec.encode(torch.randn(n), seed=1).numel() == expected


def test_compression_ratio_is_fp32_bytes_over_payload_bytes():
    assert compression_ratio("identity", (10,)) == 1.0
    assert compression_ratio("bf16", (10, 10)) == 2.0
    n, c = 8192 * 512, 512
    assert compression_ratio("q4", (8192, 512)) == pytest.approx(4 * n / (n / 2 + 4 * c))


# -- bit packing ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 22, 33])
def test_unpack_bits_inverts_pack_bits(bits):
    gen = torch.Generator().manual_seed(bits)
    for n in [0, 1, 7, 63, 64, 65, 1000]:
        codes = torch.randint(0, 2**bits, (n,), generator=gen, dtype=torch.int64)
        if bits <= 8:
            codes = codes.to(torch.uint8)
        assert torch.equal(unpack_bits(pack_bits(codes, bits), n, bits).long(), codes.long()), n


@pytest.mark.parametrize("bits", [1, 3, 4, 7, 22])
def test_pack_bits_uses_ceil_n_bits_over_8_bytes(bits):
    for n in [1, 9, 64, 100, 1000]:
        codes = torch.zeros(n, dtype=torch.uint8 if bits <= 8 else torch.int64)
        assert pack_bits(codes, bits).numel() == math.ceil(n * bits / 8)


def test_four_bit_codes_are_packed_in_two_planes():
    codes = torch.arange(64, dtype=torch.uint8) % 16
    packed = pack_bits(codes, 4)
    assert torch.equal(packed, codes[:32] | (codes[32:] << 4))


# -- quantizer accuracy --------------------------------------------------------------------------------------------


def _max_abs_per_value(x: torch.Tensor, codec: QuantCodec) -> torch.Tensor:
    """The max-abs scale that applies to each value of x, broadcast to x's shape."""
    if codec.scale == "channel" and x.dim() >= 2:
        return x.abs().amax(dim=tuple(range(x.dim() - 1)), keepdim=True).expand_as(x)
    flat = x.reshape(-1)
    if codec.scale == "tensor" or x.dim() < 2 and codec.scale == "channel":
        return flat.abs().max().expand_as(x)
    groups = flat.split(codec.group_size)
    return torch.cat([g.abs().max().expand(g.numel()) for g in groups]).view_as(x)


@pytest.mark.parametrize("spec", ["q2", "q3", "q4", "q5", "q6", "q7", "q8", "q4:tensor", "q4:group100", "q3:group7"])
def test_round_to_nearest_errs_by_at_most_half_a_step(spec):
    codec = get_codec(spec)
    x = torch.randn(37, 300, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 300)
    bound = _max_abs_per_value(x, codec) / (2 * codec.levels)
    error = (_round_trip(codec, x) - x).abs()
    assert bool((error <= bound * (1 + 1e-5)).all()), float((error / bound).max())


def test_one_bit_sends_the_sign_times_the_mean_magnitude_per_channel():
    x = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))
    expected = torch.where(x >= 0, 1.0, -1.0) * x.abs().mean(0)
    torch.testing.assert_close(_round_trip("q1", x), expected)


@pytest.mark.parametrize("spec", ["q4:tensor:sr", "q2:group16:sr", "q8:sr", "q1:sr", "q3:sr", "q4:tensor:fp16:sr"])
def test_stochastic_rounding_is_unbiased(spec):
    codec = get_codec(spec)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, generator=gen)
    x[0, 0] = 3.0  # pins the max-abs scale of every group that contains it
    trials = 2000
    mean = torch.stack([_round_trip(codec, x, seed=s) for s in range(trials)]).mean(0)
    # Each decode is x plus independent zero-mean noise within one step (variance <= step^2 / 4), so the mean over
    # `trials` decodes lies within 6 standard errors of x; round-to-nearest would miss by up to half a step.
    step = _max_abs_per_value(x, codec) / (codec.levels if codec.bits > 1 else 0.5)
    assert bool(((mean - x).abs() <= 6 * step / (2 * math.sqrt(trials))).all())


@pytest.mark.parametrize("spec", ["q4:sr", "q1:sr", "randk:0.1"])
def test_randomized_codecs_repeat_for_a_seed_and_differ_across_seeds(spec):
    codec = get_codec(spec)
    x = torch.randn(64, 64)
    assert torch.equal(_round_trip(codec, x, seed=7), _round_trip(codec, x, seed=7))
    assert not torch.equal(_round_trip(codec, x, seed=7), _round_trip(codec, x, seed=8))


@pytest.mark.parametrize("spec", ALL)
def test_encoding_is_deterministic_for_a_seed(spec):
    codec = get_codec(spec)
    x = torch.randn(33, 17)
    assert torch.equal(codec.encode(x, seed=3), codec.encode(x, seed=3))


# -- edge cases ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ALL)
def test_an_all_zero_tensor_decodes_to_exact_zeros(spec):
    x = torch.zeros(17, 65)
    assert torch.equal(_round_trip(spec, x), x)


@pytest.mark.parametrize("spec", ["q2", "q3", "q4", "q5", "q6", "q7", "q8", "q4:tensor", "q4:group96", "q4:sr", "q2:group96:sr"])
def test_a_constant_per_scale_tensor_decodes_exactly(spec):
    # 512 random channel constants: decoding must hit each scale exactly, not within a rounding error of it
    constants = (torch.rand(512, generator=torch.Generator().manual_seed(1)) - 0.5) * 10.0 ** torch.arange(-4, 4).repeat(64)
    if "tensor" in spec or "group" in spec:
        x = constants.repeat_interleave(96).view(-1, 96) if "group" in spec else torch.full((4, 64), float(constants[0]))
    else:
        x = constants.expand(16, 512).clone()
    assert torch.equal(_round_trip(spec, x), x)


@pytest.mark.parametrize("spec", ["q2", "q3", "q4", "q8", "q4:group32", "q4:sr", "q2:tensor:sr", "q4:fp16",
                                  "q8:fp16:sr", "topk:0.5+q4", "randk:0.5+q8"])
def test_zeros_stay_zeros_through_quantizers_of_two_bits_and_more(spec):
    x = torch.randn(64, 32)
    x[x.abs() < 0.5] = 0.0
    decoded = _round_trip(spec, x)
    assert bool((decoded[x == 0] == 0).all())


# -- fp16 scales ---------------------------------------------------------------------------------------------------


def _sent_fp16_scales(codec: QuantCodec, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mantissas, scales) a fp16-scale payload holds: scale = mantissa * 2**exponent, as float64."""
    n_scales = codec._layout(x.shape)[0]
    payload = codec.encode(x)
    exponent = int(payload[:2].view(torch.int16))
    mantissas = payload[2 : 2 + 2 * n_scales].view(torch.float16)
    return mantissas, mantissas.double() * 2.0**exponent


def _channel_max_abs(x: torch.Tensor) -> torch.Tensor:
    return x.abs().amax(0).double()


def test_fp16_scales_are_the_max_abs_rounded_up_to_fp16_precision():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 200, generator=gen) * 10.0 ** torch.linspace(-4, 4, 200)  # all within 2**28 of the largest
    codec = get_codec("q4:fp16")
    mantissas, sent = _sent_fp16_scales(codec, x)
    peak = _channel_max_abs(x)
    below = torch.nextafter(mantissas, torch.tensor(0.0, dtype=torch.float16)).double() * (sent / mantissas.double())
    assert bool((sent >= peak).all()) and bool((below < peak).all())  # the smallest such value not below the max-abs
    assert bool((sent <= peak * (1 + 2.0**-10)).all())
    decoded = _round_trip(codec, x)
    assert bool(((decoded - x).abs() <= sent.float() / (2 * codec.levels) * (1 + 1e-5)).all())
    assert torch.equal(decoded.abs().amax(0), sent.float())  # the top code decodes to the sent scale exactly


@pytest.mark.parametrize("peak", [1e-45, 3e-42, 1e-39, 1e-30, 1.0, 1e30, 3.4e38])
def test_both_ends_use_the_same_fp16_scales_at_every_float32_magnitude(peak):
    gen = torch.Generator().manual_seed(5)
    x = torch.rand(6, 64, generator=gen) * torch.logspace(0, -6, 64) * peak  # channel scales from peak down 1e6
    x[0] = x.abs().amax(0)  # each channel's max-abs sits in row 0, with a positive sign
    codec = get_codec("q4:fp16")
    _, sent = _sent_fp16_scales(codec, x)
    assert torch.equal(sent.float().double(), sent)  # the sent scales are float32 values
    # the top code decodes to the scale exactly: the receiver rebuilt the sender's scales, even below 2**-126
    assert torch.equal(_round_trip(codec, x)[0], sent.float())


@pytest.mark.parametrize("spec", ["q4:fp16", "q8:group96:fp16", "q4:fp16:sr", "q2:tensor:fp16"])
def test_constants_with_fp16_precision_decode_exactly_under_fp16_scales(spec):
    gen = torch.Generator().manual_seed(1)
    constants = (torch.rand(512, generator=gen) - 0.5) * 10.0 ** torch.arange(-4, 4).repeat(64)
    constants = constants.half().float()  # 11 significant bits: an fp16 mantissa times a power of two
    if "group" in spec:
        x = constants.repeat_interleave(96).view(-1, 96)
    elif "tensor" in spec:
        x = torch.full((4, 64), float(constants[0]))
    else:
        x = constants.expand(16, 512).clone()
    assert torch.equal(_round_trip(spec, x), x)


@pytest.mark.parametrize("peaks", [[7e4, 1e5, 3e6, 1e9, 1e12], [1e30, 1e35, 3e38, 3.4e38, 3.4028234663852886e38]],
                         ids=["beyond-fp16", "up-to-float32-max"])
@pytest.mark.parametrize("spec", ["q4:fp16", "q8:fp16", "q1:fp16", "q4:tensor:fp16:sr", "q3:group5:fp16"])
def test_fp16_scales_beyond_fp16_range_are_sent_finite_and_decode_within_the_bound(spec, peaks):
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(2))
    x = x / x.abs().amax(0) * torch.tensor(peaks)  # each channel's max-abs is its peak (fp16 overflows from 65520)
    x[0, -1], x[1, -1] = peaks[-1], -peaks[-1]  # up to the largest float32 value, both signs
    assert not bool(torch.isfinite(x.abs().amax(0).half()).any())  # plain fp16 scales would all be inf
    codec = get_codec(spec)
    mantissas, _ = _sent_fp16_scales(codec, x)
    assert bool(torch.isfinite(mantissas).all())
    decoded = _round_trip(codec, x, seed=1)
    assert bool(torch.isfinite(decoded).all())
    if codec.bits > 1:
        # float32's largest value cannot be rounded up: its scale rounds down, by less than 2**-11 of it
        step = _max_abs_per_value(x, codec).double() * (1 + 2.0**-10) / codec.levels
        bound = step if codec.stochastic else step / 2
        assert bool(((decoded.double() - x.double()).abs() <= bound).all())
        low = peaks[-1] * (1 - 2.0**-11)
        assert float(decoded[0, -1]) >= low and float(decoded[1, -1]) <= -low


@pytest.mark.parametrize("spec", ["q4:fp16", "q8:fp16:sr", "q4:group5:fp16", "q1:fp16"])
def test_fp16_scales_of_a_message_of_subnormal_values_keep_their_grid(spec):
    # plain fp16 would flush these scales to zero and every value with them; the shared exponent keeps them
    codec = get_codec(spec)
    x = _tiny_channels(with_normal=False, dtype=torch.float32)
    assert not bool(x.abs().amax(0).half().any())
    decoded = _round_trip(codec, x, seed=3)
    assert bool(torch.isfinite(decoded).all()) and bool((decoded[x == 0] == 0).all())
    if codec.bits > 1:
        step = _max_abs_per_value(x, codec) * (1 + 2.0**-10) / codec.levels
        bound = (step if codec.stochastic else step / 2) * (1 + 1e-5) + 2.0**-148
        assert bool(((decoded - x).abs() <= bound).all()), float(((decoded - x).abs() / bound).max())
        assert bool((decoded * x >= 0).all())
    assert bool((decoded != 0).any())


def test_fp16_scales_far_below_the_largest_one_still_bound_the_error_and_never_become_zero():
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(4)) * torch.tensor([1e30, 1.0, 1e-20, 0.0])
    codec = get_codec("q4:fp16")
    mantissas, sent = _sent_fp16_scales(codec, x)
    assert bool((sent[:3] > 0).all()) and float(sent[3]) == 0.0  # non-zero stays non-zero, zero stays zero
    decoded = _round_trip(codec, x)
    assert bool(((decoded.double() - x.double()).abs() <= sent.float().double() / (2 * codec.levels) * (1 + 1e-5)).all())
    assert bool((decoded[:, 3] == 0).all())


# -- sparsifiers with quantized values -----------------------------------------------------------------------------


@pytest.mark.parametrize("spec, bits", [("topk:0.1+q8", 8), ("topk:0.1+q4", 4), ("topk:0.05+q4:fp16", 4)])
def test_topk_with_quantized_values_keeps_the_largest_and_errs_by_half_a_step_of_their_max(spec, bits):
    gen = torch.Generator().manual_seed(0)
    n = 5000
    x = (torch.randperm(n, generator=gen).float() + 1) / n * torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    codec = get_codec(spec)
    k = codec.count(n)
    kept = x.abs().topk(k).indices
    decoded = _round_trip(codec, x, seed=2)
    assert bool(torch.isin(decoded.nonzero().view(-1), kept).all())  # nothing outside the top k
    bound = x[kept].abs().max() * (1 + 2.0**-10 if "fp16" in spec else 1) / (2 * _levels(bits))
    assert bool(((decoded[kept] - x[kept]).abs() <= bound * (1 + 1e-5)).all())
    assert float((decoded - x)[kept].abs().max()) > 0  # the values were quantized, not sent as fp16


@pytest.mark.parametrize("spec, bits", [("randk:0.25+q4", 4), ("randk:0.1+q8:group32", 8)])
def test_randk_with_quantized_values_sends_the_seeded_positions_within_half_a_step(spec, bits):
    codec = get_codec(spec)
    gen = torch.Generator().manual_seed(1)
    x = (1 + torch.rand(40, 50, generator=gen)) * torch.where(torch.rand(40, 50, generator=gen) < 0.5, -1.0, 1.0)
    # magnitudes in [1, 2): no kept value is within half a step of zero
    decoded = codec.decode(codec.encode(x, seed=11), x.shape, x.dtype, seed=11)
    positions = codec.positions(x.numel(), 11)
    assert torch.equal(decoded.view(-1).nonzero().view(-1), positions)
    kept = x.view(-1)[positions]
    scale = kept.abs().max() if "group" not in spec else _max_abs_per_value(kept, codec.values)
    assert bool(((decoded.view(-1)[positions] - kept).abs() <= scale / (2 * _levels(bits)) * (1 + 1e-5)).all())


def _tiny_channels(with_normal: bool, dtype: torch.dtype) -> torch.Tensor:
    """Channels (columns) that are zero, subnormal (float32 subnormals start below 1.2e-38) and, optionally, tiny.

    In float64, 1.9e-45 has a float32 scale of 1.4e-45, below the value: its code lies beyond the top one."""
    gen = torch.Generator().manual_seed(0)
    signs = torch.randint(0, 2, (6, 4), generator=gen, dtype=dtype) * 2.0 - 1.0
    x = torch.tensor([0.0, 1e-40, -1e-39, 1.9e-45], dtype=dtype).expand(6, 4)
    x = torch.cat([x, signs * torch.rand(6, 4, generator=gen, dtype=dtype) * torch.tensor([1e-45, 1e-41, 1e-39, 1e-38], dtype=dtype)], 1)
    if with_normal:
        x = torch.cat([x, signs[:, :2] * torch.rand(6, 2, generator=gen, dtype=dtype) * torch.tensor([1e-37, 1e-30], dtype=dtype)], 1)
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_normal", [False, True])
@pytest.mark.parametrize("spec", [f"q{b}{scale}{sr}" for b in range(1, 9) for scale in ("", ":tensor", ":group5")
                                  for sr in ("", ":sr")])
def test_zero_subnormal_and_tiny_channels_keep_their_sign_and_error_bound(spec, with_normal, dtype):
    # Below a scale of ~1e-37 the inverse scale overflowed float32 and the codes wrapped: every value came back
    # with the magnitude of its scale and a negative sign, zeros included.
    codec = get_codec(spec)
    x = _tiny_channels(with_normal, dtype)
    decoded = _round_trip(codec, x, seed=3)
    assert bool(torch.isfinite(decoded).all())
    scale = _max_abs_per_value(x, codec)
    if codec.bits == 1:  # the sign times a scale no larger than the max-abs; q1:sr may flip a sign by design
        assert bool((decoded.abs() <= scale.float().to(dtype)).all())  # scales are sent as float32
        assert codec.stochastic or bool((decoded * x >= 0).all())
    else:
        step = scale / codec.levels
        bound = (step if codec.stochastic else step / 2) * (1 + 1e-5) + 2.0**-148
        assert bool(((decoded - x).abs() <= bound).all()), float(((decoded - x).abs() / bound).max())
        assert bool((decoded * x >= 0).all()) and bool((decoded[x == 0] == 0).all())
    if codec.scale == "channel" and dtype == torch.float32:  # constant channels come back exactly, as at any scale
        assert torch.equal(decoded[:, :4], x[:, :4])


@pytest.mark.parametrize("spec", ["topk:0.1", "randk:0.1"])
def test_sparsifiers_decode_unsent_positions_to_zero(spec):
    x = torch.randn(100, 50) + 10.0  # no input value is zero
    decoded = _round_trip(spec, x)
    assert int((decoded != 0).sum()) == 500


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("spec", ALL)
def test_decode_gives_back_the_shape_and_dtype_for_empty_scalar_and_plain_tensors(spec, dtype):
    for shape in [(), (0,), (3, 0), (1,), (4, 5, 6)]:
        x = torch.randn(shape).to(dtype)
        decoded = _round_trip(spec, x)
        assert decoded.shape == x.shape and decoded.dtype == dtype, shape


@pytest.mark.parametrize("spec", ["identity", "bf16", "q8", "topk:1"])
def test_a_zero_dim_tensor_round_trips_to_about_its_value(spec):
    x = torch.tensor(-2.5)
    assert float(_round_trip(spec, x)) == pytest.approx(-2.5, rel=1e-2)


@pytest.mark.parametrize("spec", ["identity", "bf16", "q4", "q4:group64", "topk:0.1", "randk:0.1"])
def test_decode_accepts_a_payload_slice_at_an_odd_byte_offset(spec):
    codec = get_codec(spec)
    x = torch.randn(40, 24)
    payload = codec.encode(x, seed=2)
    buffer = torch.zeros(payload.numel() + 1, dtype=torch.uint8)
    buffer[1:] = payload
    assert torch.equal(codec.decode(buffer[1:], x.shape, x.dtype, seed=2), codec.decode(payload, x.shape, x.dtype, seed=2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", ALL)
def test_decode_into_a_given_buffer_matches_decode(spec, dtype):
    codec = get_codec(spec)
    x = torch.randn(24, 40).to(dtype)
    payload = codec.encode(x, seed=4)
    expected = codec.decode(payload, x.shape, dtype, seed=4)
    for out in (torch.full_like(x, 7.0), torch.full((40, 24), 7.0, dtype=dtype).t()):  # contiguous or not
        assert codec.decode_into(payload, out, seed=4) is out
        assert torch.equal(out, expected)


@pytest.mark.parametrize("spec", ["q4", "q4:fp16", "q3:group7:sr"])
def test_a_quantizer_encodes_into_a_slice_of_a_larger_buffer_and_refuses_a_wrong_size(spec):
    codec = get_codec(spec)
    x = torch.randn(10, 12)
    n = codec.payload_nbytes(x.shape, x.dtype)
    buffer = torch.zeros(8 + n + 3, dtype=torch.uint8)
    assert torch.equal(codec.encode_into(x, buffer[8 : 8 + n], seed=5), codec.encode(x, seed=5))
    assert not bool(buffer[:8].any()) and not bool(buffer[8 + n :].any())  # nothing written outside the slice
    with pytest.raises(ValueError, match=f"needs {n} uint8 bytes"):
        codec.encode_into(x, buffer[8 : 8 + n - 1])


@pytest.mark.parametrize("spec", ["identity", "q4", "topk:0.1", "randk:0.1", "bf16"])
def test_decode_refuses_a_payload_of_the_wrong_length(spec):
    codec = get_codec(spec)
    payload = codec.encode(torch.randn(10, 10))
    with pytest.raises(ValueError, match="bytes, expected"):
        codec.decode(payload[:-1], torch.Size([10, 10]), torch.float32)


@pytest.mark.parametrize("spec", ["identity", "bf16"])
def test_payloads_and_decoded_tensors_do_not_share_the_callers_memory(spec):
    codec = get_codec(spec)
    x = torch.randn(8, 8).bfloat16()
    payload = codec.encode(x)
    decoded = codec.decode(payload, x.shape, x.dtype)
    assert payload.data_ptr() != x.data_ptr() and decoded.data_ptr() != payload.data_ptr()


# -- non-finite input ----------------------------------------------------------------------------------------------


def test_check_finite_accepts_finite_and_empty_tensors():
    check_finite(torch.randn(5, 5))
    check_finite(torch.empty(0))


def test_check_finite_reports_what_is_wrong_and_where():
    x = torch.zeros(10)
    x[3], x[5], x[6] = float("nan"), float("inf"), float("-inf")
    with pytest.raises(NonFiniteError, match=r"1 NaN, 1 \+inf, 1 -inf among 10 values.*index 3"):
        check_finite(x)


def test_a_non_finite_error_is_a_value_error():
    assert issubclass(NonFiniteError, ValueError)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("spec", LOSSY)
def test_lossy_codecs_refuse_non_finite_input(spec, bad):
    x = torch.randn(16, 16)
    x[7, 3] = bad
    with pytest.raises(NonFiniteError):
        get_codec(spec).encode(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("spec", ["q4", "q8:tensor", "q2:group5"])
def test_quantizers_refuse_a_nan_with_its_sign_bit_set(spec, dtype):
    # The max-abs is taken on the bits of |x| read as integers: a NaN must still come out on top when its sign bit
    # is set (as integers, such bits are negative).
    x = torch.randn(16, 16).to(dtype)
    ints = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
            torch.bfloat16: torch.int16}[dtype]
    negative_nan = (torch.tensor(float("nan"), dtype=dtype).view(ints) | torch.iinfo(ints).min).view(dtype)
    assert bool(torch.signbit(negative_nan))
    x[7, 3] = negative_nan
    assert bool(torch.signbit(x[7, 3])) and bool(torch.isnan(x[7, 3]))
    with pytest.raises(NonFiniteError):
        get_codec(spec).encode(x)


@pytest.mark.parametrize("spec", ["q4", "q8:tensor", "q2:group5", "q4:fp16"])
def test_a_float64_input_beyond_float32_s_range_is_refused_with_the_reason(spec):
    x = torch.randn(16, 16, dtype=torch.float64)
    x[7, 3] = 1e39  # finite in float64; no float32 scale holds it
    with pytest.raises(ValueError, match="exceed what its float32 scales can hold.*'identity'"):
        get_codec(spec).encode(x)


def test_identity_carries_non_finite_values_bit_exactly():
    x = torch.tensor([float("nan"), float("inf"), -0.0, 1.0])
    assert torch.equal(_round_trip("identity", x).view(torch.int32), x.view(torch.int32))


# -- casts ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", CASTS)
def test_a_cast_decodes_to_the_torch_cast_of_the_input(spec):
    target = get_codec(spec).target
    x = torch.randn(64, 16)
    assert torch.equal(_round_trip(spec, x), x.to(target).float())


@pytest.mark.parametrize("spec", CASTS)
def test_casts_saturate_values_beyond_the_target_range(spec):
    top = torch.finfo(get_codec(spec).target).max
    biggest = torch.finfo(torch.float32).max  # beyond even bfloat16's largest finite value
    x = torch.tensor([biggest, -biggest, 1.0])
    assert _round_trip(spec, x).tolist() == [top, -top, 1.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool])
def test_identity_is_lossless_for_any_dtype(dtype):
    x = (torch.randn(3, 7) * 100).to(dtype)
    assert torch.equal(_round_trip("identity", x), x)


# -- sparsifiers ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1000, 100_000])  # small inputs run topk directly, large ones pre-filter by a sample
def test_topk_keeps_exactly_the_largest_magnitudes(n):
    gen = torch.Generator().manual_seed(0)
    magnitudes = (torch.randperm(n, generator=gen).float() + 1) / n  # distinct, so the top k are unambiguous
    x = magnitudes * torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    k = n // 10
    decoded = _round_trip("topk:0.1", x)
    expected = x.abs().topk(k).indices.sort().values
    assert torch.equal(decoded.nonzero().view(-1), expected)
    assert torch.equal(decoded[expected], x[expected].half().float())


def test_randk_receiver_draws_the_senders_positions_and_values_are_not_rescaled():
    codec = get_codec("randk:0.05")
    x = torch.randn(2000) + 5.0
    decoded = codec.decode(codec.encode(x, seed=11), x.shape, x.dtype, seed=11)
    positions = codec.positions(2000, 11)
    assert torch.equal(decoded.nonzero().view(-1), positions)
    assert torch.equal(decoded[positions], x[positions].half().float())


@pytest.mark.parametrize("n, k", [(50, 5), (50, 40), (200_000, 3000)])
def test_randk_positions_are_k_distinct_sorted_indices(n, k):
    positions = get_codec(f"randk:{k}/{n}").positions(n, seed=5)
    assert positions.numel() == k and bool((positions[1:] > positions[:-1]).all())
    assert 0 <= int(positions[0]) and int(positions[-1]) < n


@pytest.mark.parametrize("n, k", [(20, 3), (20, 15)])
def test_randk_draws_every_position_equally_often(n, k):
    codec = get_codec(f"randk:{k}/{n}")
    trials = 3000
    counts = torch.zeros(n)
    for seed in range(trials):
        counts[codec.positions(n, seed)] += 1
    p = k / n
    # each count is Binomial(trials, p): allow 5 standard deviations
    assert float((counts - trials * p).abs().max()) <= 5 * math.sqrt(trials * p * (1 - p))


def test_lowrank_under_error_feedback_sends_what_one_message_leaves_out_in_later_ones():
    # a full-rank target, rank 4 per message: one message keeps a small part of it, and feeding the error back
    # (as ef21 / Clapping-FC do with a reused batch) sends the rest within a few more messages
    codec = codecs.get_codec("lowrank:4")
    target = torch.randn(128, 64, generator=torch.Generator().manual_seed(0))
    buffer = torch.zeros_like(target)
    errors = []
    for step in range(20):
        diff = target - buffer
        buffer += codec.decode(codec.encode(diff, seed=step), diff.shape, diff.dtype, seed=step)
        errors.append(float((target - buffer).norm() / target.norm()))
    assert errors[0] > 0.7, errors[0]  # one message: most of a full-rank matrix is lost (direct compression)
    assert errors[-1] < 0.01, errors  # 20 x rank 4 > 64 columns: all of it sent, to fp16 precision
    assert all(b <= a + 1e-6 for a, b in zip(errors, errors[1:])), errors
