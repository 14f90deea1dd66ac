"""Codecs: error bounds, edge cases, sizes, and exact error feedback."""

import math

import pytest
import torch
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import CompressionInfo, Float16Compression, NoCompression

from p2ptrain.compression import (
    INT4_BLOCKWISE,
    INT8_BLOCKWISE,
    BlockwiseQuantization,
    ErrorFeedback,
    deserialize,
    make_codec,
    roundtrip,
)

CODES = {8: 127, 4: 7}


def blockwise_bound(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """Half a quantization step of each value's block: the most round-to-nearest can be off by."""
    flat = x.float().reshape(-1)
    pad = (-flat.numel()) % block
    absmax = torch.nn.functional.pad(flat, (0, pad)).view(-1, block).abs().amax(1)
    return (absmax / CODES[bits] / 2).repeat_interleave(block)[: flat.numel()].view(x.shape)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [64, 256])
def test_roundtrip_error_is_within_half_a_step_per_block(bits, block):
    torch.manual_seed(0)
    x = torch.randn(10_001) * torch.logspace(-3, 3, 10_001)  # magnitudes vary across blocks
    y = roundtrip(BlockwiseQuantization(bits, block), x)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert ((x - y).abs() <= blockwise_bound(x, bits, block) * (1 + 1e-5) + 1e-30).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_edge_cases(bits):
    codec = BlockwiseQuantization(bits)
    one = torch.tensor([3.5])
    assert torch.equal(roundtrip(codec, one), one)  # a lone value is its own absmax: exact
    zeros = torch.zeros(1000)
    assert torch.equal(roundtrip(codec, zeros), zeros)
    for scale in (1e30, 1e-30):
        x = torch.randn(4096) * scale
        y = roundtrip(codec, x)
        assert torch.isfinite(y).all()
        assert ((x - y).abs() <= blockwise_bound(x, bits, 256) * (1 + 1e-5)).all()
    x = torch.randn(3, 5, 7)
    assert roundtrip(codec, x).shape == (3, 5, 7)


@pytest.mark.parametrize("bits", [8, 4])
def test_bfloat16_input(bits):
    x = torch.randn(2048).to(torch.bfloat16)
    y = roundtrip(BlockwiseQuantization(bits), x)
    assert y.dtype == torch.bfloat16
    bound = blockwise_bound(x, bits, 256) + x.float().abs() * 2**-8  # plus bf16's own rounding of the output
    assert ((x.float() - y.float()).abs() <= bound * 1.01).all()


def test_wire_sizes_against_fp32():
    x = torch.randn(1 << 20)
    fp32 = x.numel() * 4
    int8 = len(BlockwiseQuantization(8).compress(x, CompressionInfo.from_tensor(x)).buffer)
    int4 = len(BlockwiseQuantization(4).compress(x, CompressionInfo.from_tensor(x)).buffer)
    assert int8 / fp32 <= 0.26 and int4 / fp32 <= 0.14
    assert math.isclose(int8 / fp32, (1 + 4 / 256) / 4, rel_tol=1e-3)


def test_small_tensors_go_as_fp16_and_big_ones_quantized():
    codec = make_codec("int8", small_tensor_numel=4096)
    small, big = torch.randn(512), torch.randn(8192)
    assert (
        codec.compress(small, CompressionInfo.from_tensor(small)).compression
        == Float16Compression.compression_type
    )
    assert codec.compress(big, CompressionInfo.from_tensor(big)).compression == INT8_BLOCKWISE
    assert make_codec("int4").compress(big, CompressionInfo.from_tensor(big)).compression == INT4_BLOCKWISE
    assert isinstance(make_codec("none"), NoCompression)


def test_deserialize_handles_hivemind_formats_too():
    x = torch.randn(100)
    assert torch.equal(deserialize(NoCompression().compress(x, CompressionInfo.from_tensor(x))), x)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_requantizing_across_hivemind_parts_is_lossless(name):
    """Error feedback sends values already on the grid; hivemind's part split must not move the blocks."""
    codec = make_codec(name)
    x = torch.randn(3_000_000)  # several parts at hivemind's default 512 KiB part size
    on_grid = roundtrip(codec, x)
    container = TensorPartContainer([on_grid], peer_fractions=(1.0,), compression=codec)
    parts = container.get_raw_input_parts(0)
    assert len(parts) >= 2
    for part in parts:
        assert part.numel() % 256 == 0 or part is parts[-1]
        assert torch.equal(roundtrip(codec, part), part)


def test_error_feedback_sends_on_grid_and_keeps_the_rest():
    codec = make_codec("int4", small_tensor_numel=1)
    ef = ErrorFeedback(codec, [torch.Size([4096])])
    torch.manual_seed(0)
    sent_total, true_total = torch.zeros(4096), torch.zeros(4096)
    for _ in range(20):
        delta = torch.randn(4096)
        sent = ef.prepare([delta])[0]
        assert torch.equal(roundtrip(codec, sent), sent)  # on the codec's grid: the wire drops nothing more
        ef.commit()
        sent_total += sent
        true_total += delta
    # What was sent plus what is still held is exactly what was meant to be sent.
    assert torch.allclose(sent_total + ef.residuals[0], true_total, atol=1e-4)
    assert ef.residuals[0].abs().max() < 1.0  # bounded, not accumulating


def test_error_feedback_discard_keeps_the_previous_residual():
    ef = ErrorFeedback(make_codec("int4", small_tensor_numel=1), [torch.Size([1024])])
    ef.prepare([torch.randn(1024)])
    ef.commit()
    before = ef.residuals[0].clone()
    ef.prepare([torch.randn(1024)])
    ef.discard()
    assert torch.equal(ef.residuals[0], before)
