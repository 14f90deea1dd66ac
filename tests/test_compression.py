"""Codecs: error bounds, edge cases, sizes, and exact error feedback."""

import math

import pytest
import torch
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import CompressionInfo, Float16Compression, NoCompression

from p2ptrain.compression import (
    DEFAULT_PART_SIZE_BYTES,
    INT4_BLOCKWISE,
    INT8_BLOCKWISE,
    BlockwiseQuantization,
    ErrorFeedback,
    deserialize,
    layout_for,
    make_codec,
    packed_part_size,
    roundtrip,
    wire_parts,
)
from p2ptrain.config import AveragingConfig

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


def test_a_part_whose_dtype_is_no_plain_name_is_refused_before_it_decodes():
    # numpy reads '(50000,)f4' as one value of 50,000 floats: an 8 KiB fp16 part would decode to 1.6 GB.
    part = Float16Compression().compress(torch.ones(4096), CompressionInfo.from_tensor(torch.ones(4096)))
    assert deserialize(part).shape == (4096,)
    for dtype in ("(50000,)f4", "float32,float32", "<f4", ""):
        part.dtype = dtype
        with pytest.raises(ValueError, match="is not a plain dtype's name"):
            deserialize(part)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_blockwise_part_whose_bytes_are_not_those_of_its_shape_is_refused_before_it_decodes(bits):
    """A sender picks the block size and the bytes: bytes past its shape's, a block size no config has (one of
    2^21 pads a small part to 2M values), a wider dtype or a short buffer are refused; the padding a block
    adds is at most one block of a size a config may set."""
    import struct

    codec = BlockwiseQuantization(bits, block_size=256)
    x = torch.randn(1000)
    part = codec.compress(x, CompressionInfo.from_tensor(x))
    assert deserialize(part).shape == (1000,)
    wrong = {}
    for label, change in [
        ("16 MiB more", lambda p: setattr(p, "buffer", p.buffer + bytes(1 << 24))),
        ("block size 3", lambda p: setattr(p, "buffer", struct.pack("<I", 3) + p.buffer[4:])),
        ("block size 2^21", lambda p: setattr(p, "buffer", struct.pack("<I", 1 << 21) + p.buffer[4:])),
        ("complex128", lambda p: setattr(p, "dtype", "complex128")),
        ("a byte short", lambda p: setattr(p, "buffer", p.buffer[:-1])),
        ("no header", lambda p: setattr(p, "buffer", b"\x01")),
    ]:
        changed = type(part)()
        changed.CopyFrom(part)
        change(changed)
        wrong[label] = changed
    for label, changed in wrong.items():
        with pytest.raises(ValueError, match="a blockwise part"):
            deserialize(changed)
            pytest.fail(label)


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


# Tensor packing (averaging.packed): the same values on the wire in far fewer parts.

SHAPES = [
    torch.Size([300, 7]),  # 2100 values: small, fp16 under int8/int4
    torch.Size([5000]),  # large, not a whole number of blocks
    torch.Size([3]),
    torch.Size([64, 129]),  # large, 8256 values
    torch.Size([40000]),
]


def _received(layout, wire_tensors):
    """What a groupmate decodes from ``wire_tensors``, cut and keyed as hivemind cuts and keys them."""
    decoded = [
        roundtrip(layout.codec, p, info)
        for p, info in wire_parts(wire_tensors, layout.codec, layout.part_size_bytes)
    ]
    out, start = [], 0
    for t in wire_tensors:
        flat = torch.cat(decoded)[start : start + t.numel()]
        out.append(flat.view(t.shape))
        start += t.numel()
    return out


@pytest.mark.parametrize("name", ["none", "fp16", "int8", "int4"])
def test_packed_wire_carries_exactly_the_per_tensor_values(name):
    torch.manual_seed(0)
    tensors = [torch.randn(s) * (i + 1) for i, s in enumerate(SHAPES)]
    per_tensor = layout_for(SHAPES, AveragingConfig(compression=name, packed=False))
    packed = layout_for(SHAPES, AveragingConfig(compression=name, packed=True))
    assert len(packed.wire_shapes) == (1 if name in ("none", "fp16") else 2)
    expected = _received(per_tensor, per_tensor.pack(tensors))
    got = packed.unpack(_received(packed, packed.pack(tensors)))
    for g, e, t in zip(got, expected, tensors, strict=True):
        assert g.shape == t.shape
        assert torch.equal(g, e)


def test_per_tensor_layout_is_the_identity():
    layout = layout_for(SHAPES, AveragingConfig(packed=False))
    assert layout.wire_shapes == tuple(SHAPES)
    assert layout.part_size_bytes == DEFAULT_PART_SIZE_BYTES
    tensors = [torch.randn(s) for s in SHAPES]
    assert all(torch.equal(a, b) for a, b in zip(layout.pack(tensors), tensors, strict=True))


def test_packed_large_tensors_start_on_a_block_and_padding_is_zeroed():
    cfg = AveragingConfig(compression="int8", block_size=256)
    layout = layout_for(SHAPES, cfg)
    small, large = layout.wire_shapes
    assert small.numel() == 2100 + 3  # fp16 needs no alignment
    for shape, (bucket, offset) in zip(SHAPES, layout.places, strict=True):
        assert bucket == (0 if shape.numel() < cfg.small_tensor_numel else 1)
        assert bucket == 0 or offset % 256 == 0
    # A groupmate's average left garbage in the buffers: pack must not let it raise a block's absmax.
    out = [torch.full(s, 1e6) for s in layout.wire_shapes]
    tensors = [torch.ones(s) for s in SHAPES]
    flats = layout.pack(tensors, out=out)
    assert flats[0] is out[0] and flats[1] is out[1]
    assert flats[1].sum().item() == 5000 + 64 * 129 + 40000
    assert flats[0].sum().item() == 2100 + 3


def test_packing_gpt_micro_cuts_a_few_parts_whole_blocks_each():
    from p2ptrain.config import ExperimentConfig
    from p2ptrain.models import build_model

    cfg = ExperimentConfig()
    shapes = [p.shape for p in build_model(cfg.model.name, cfg.model.context_length).parameters()]
    per_tensor = layout_for(shapes, cfg.averaging.model_copy(update={"packed": False}))
    packed = layout_for(shapes, cfg.averaging)
    metas = [torch.zeros(s) for s in packed.wire_shapes]
    parts = wire_parts(metas, packed.codec, packed.part_size_bytes)
    assert len(parts) < len(wire_parts([torch.zeros(s) for s in shapes], per_tensor.codec)) / 4
    assert 6 <= len(parts) <= 12  # enough parts to give every reducer of a group of 6 some
    # hivemind's own cut agrees with ours, and a quantized part is whole blocks (but for the last).
    container = TensorPartContainer(
        metas, peer_fractions=(1.0,), compression=packed.codec, part_size_bytes=packed.part_size_bytes
    )
    theirs = container.get_raw_input_parts(0)
    assert [p.numel() for p in theirs] == [p.numel() for p, _ in parts]
    for part, info in parts:
        if info.key == 1 and part is not parts[-1][0]:
            assert part.numel() % cfg.averaging.block_size == 0


def test_packed_part_size_cuts_enough_parts_for_a_small_model_and_hiveminds_for_a_large_one():
    assert packed_part_size(0.85e6) == 2**17  # gpt-micro under int8
    assert packed_part_size(0.12e6) == 2**14  # gpt-nano
    assert packed_part_size(3e6) == 2**18
    assert packed_part_size(5e6) == DEFAULT_PART_SIZE_BYTES  # hivemind's, from 3 MB on
    assert packed_part_size(10) == 2**12
