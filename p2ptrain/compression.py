"""Wire formats for pseudo-gradients: blockwise int8 and int4 with per-block scales, and error feedback.

hivemind 1.1.12's own 8-bit codecs fail to decode under numpy 2 and carry a 1 KiB codebook per
part; it has no 4-bit codec. These are ours, as ``hivemind.compression.CompressionBase``
subclasses, so they run inside hivemind's all-reduce (p2ptrain's runner dispatches decoding to
:func:`deserialize`).

Format of one part: ``buffer = block_size (uint32) | scales (float32, one per block) | codes``.
Each block of ``block_size`` values is scaled by its absolute maximum (absmax) to the code range
(±127 for int8, ±7 for int4, two codes per byte) and rounded to the nearest code. Scales are
float32, so huge and tiny magnitudes survive (float16 scales would overflow or flush to zero).
Decoding is ``code * scale`` in float32; the reduction happens in float32.

Bytes per value: int8 ``1 + 4 / block_size`` (0.254x of fp32 at the default 256), int4
``0.5 + 4 / block_size`` (0.129x).
"""

from __future__ import annotations

import math
import re
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from hivemind.compression import (
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    PerTensorCompression,
    SizeAdaptiveCompression,
    deserialize_torch_tensor,
)
from hivemind.proto import runtime_pb2

from p2ptrain.config import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE, AveragingConfig

# Our codecs' values of the wire enum. hivemind's own end at 5; proto3 keeps unknown values, and
# p2ptrain's runner decodes with :func:`deserialize`, which knows them.
INT8_BLOCKWISE = 64
INT4_BLOCKWISE = 65

DEFAULT_PART_SIZE_BYTES = 2**19  # hivemind's default part size in the all-reduce
PACKED_PARTS = 6
"""How many parts a packed layout cuts at least (while they stay over 4 KiB): a packed vector has no tensor
boundaries to spread its parts over reducers, and hivemind gives each part to one reducer whole, so fewer
parts than groupmates leaves some reducing nothing and the others the whole vector. gpt-micro's int8 vector
(0.85 MB) is 8 parts of 128 KiB (one of them the fp16 bucket); gpt-nano's (0.12 MB) 9 of 16 KiB; from 3 MiB
on, hivemind's 512 KiB. A group of a small model larger than its parts leaves the other reducers idle: one
of G > 8 peers on gpt-micro moves G / 8 times the balanced bytes through each busy reducer (of a vector
under 1 MB)."""


def packed_part_size(wire_bytes: float) -> int:
    """The part size of a packed layout of ``wire_bytes`` on the wire: hivemind's 512 KiB, halved (down to
    4 KiB) while that makes fewer than :data:`PACKED_PARTS` parts."""
    part = DEFAULT_PART_SIZE_BYTES
    while part > 2**12 and wire_bytes < PACKED_PARTS * part:
        part //= 2
    return part


# extract() decodes from read-only views of the message's bytes (no copy) and never writes to them.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)


class BlockwiseQuantization(CompressionBase):
    """Blockwise absmax quantization to ``bits`` (8 or 4) with one float32 scale per block.

    Args:
        bits: 8 or 4.
        block_size: values per block (a multiple of 2).
        part_size_bytes: the all-reduce's part size; :meth:`estimate_compression_ratio` is chosen so that
            hivemind cuts tensors into parts of a whole number of blocks (then a part's blocks are the
            tensor's blocks, and error feedback computed on whole tensors is exactly what the wire drops).
    """

    def __init__(self, bits: int, block_size: int = 256, part_size_bytes: int = DEFAULT_PART_SIZE_BYTES):
        if bits not in (8, 4):
            raise ValueError(f"bits must be 8 or 4, got {bits}")
        if block_size < 2 or block_size % 2:
            raise ValueError(f"block_size must be an even number >= 2, got {block_size}")
        self.bits, self.block_size, self.part_size_bytes = bits, block_size, part_size_bytes
        self.qmax = 127 if bits == 8 else 7
        self.compression_type = INT8_BLOCKWISE if bits == 8 else INT4_BLOCKWISE

    def bytes_per_value(self) -> float:
        return self.bits / 8 + 4 / self.block_size

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        # hivemind cuts parts of int(part_size_bytes / (4 * ratio)) values: make that a whole number of blocks.
        # (+0.5 so that float rounding cannot land one value short of the whole number of blocks)
        blocks = max(1, round(self.part_size_bytes / self.bytes_per_value() / self.block_size))
        return self.part_size_bytes / (4 * (blocks * self.block_size + 0.5))

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False
    ) -> runtime_pb2.Tensor:
        x = tensor.detach().reshape(-1)
        if x.dtype != torch.float32:
            x = x.float()
        n, B = x.numel(), self.block_size
        num_blocks = max(1, math.ceil(n / B))
        if num_blocks * B != n:
            x = torch.nn.functional.pad(x, (0, num_blocks * B - n))
        blocks = x.view(num_blocks, B)
        low, high = torch.aminmax(blocks, dim=1)  # one pass; no full-size temporary for abs()
        scales = torch.maximum(high, low.neg_()).div_(self.qmax)
        inverse = torch.where(scales > 0, 1 / scales, torch.zeros_like(scales))  # all-zero blocks: codes 0
        # |x| * (1 / (absmax / qmax)) <= qmax * (1 + 2 ulp), which rounds to qmax at most: no clamp needed.
        codes = torch.mul(blocks, inverse[:, None]).round_().to(torch.int8).view(-1)
        if self.bits == 4:
            pairs = (codes.view(-1, 2) + 8).view(torch.uint8)  # -7..7 -> 1..15 in each nibble
            codes = pairs[:, 0] | (pairs[:, 1] << 4)
        header = struct.pack("<I", B)
        buffer = b"".join([header, scales.numpy().data.cast("B"), codes.numpy().data.cast("B")])
        return runtime_pb2.Tensor(
            buffer=buffer,
            size=list(tensor.shape),
            dtype=str(tensor.dtype).removeprefix("torch."),
            compression=self.compression_type,
            requires_grad=tensor.requires_grad,
        )

    def extract(self, serialized: runtime_pb2.Tensor) -> torch.Tensor:
        """Decode a part. Its block size, shape and bytes come from the sender: a block size other than a
        config's, or bytes other than exactly those of its shape, is refused (ValueError), so that a part
        never decodes to more values than its shape holds plus one block's padding."""
        buffer = serialized.buffer
        if len(buffer) < 4:
            raise ValueError("a blockwise part without its header")
        (B,) = struct.unpack_from("<I", buffer, 0)
        if not (MIN_BLOCK_SIZE <= B <= MAX_BLOCK_SIZE and B % 2 == 0):
            raise ValueError(f"a blockwise part of block size {B}: not one a config has")
        if serialized.dtype not in _BLOCKWISE_DTYPES:
            raise ValueError(
                f"a blockwise part of dtype {serialized.dtype[:40]!r}: not a float that is averaged"
            )
        n = math.prod(serialized.size)
        num_blocks = max(1, math.ceil(n / B))
        if len(buffer) != 4 + 4 * num_blocks + num_blocks * B * self.bits // 8:
            raise ValueError(f"a blockwise part of {len(buffer)} bytes for {n} values: not its size")
        # Views of the message's bytes, no copies (read-only, which is all we need).
        scales = torch.from_numpy(np.frombuffer(buffer, dtype=np.float32, count=num_blocks, offset=4))
        raw = np.frombuffer(buffer, dtype=np.int8, offset=4 + 4 * num_blocks)
        if self.bits == 4:
            packed = torch.from_numpy(raw).view(torch.uint8)
            codes = torch.stack([packed & 0x0F, packed >> 4], dim=1).view(torch.int8) - 8
        else:
            codes = torch.from_numpy(raw)
        values = codes.view(num_blocks, B).to(torch.float32).mul_(scales[:, None]).view(-1)[:n]
        dtype = getattr(torch, serialized.dtype) if serialized.dtype else torch.float32
        return values.view(*serialized.size).to(dtype)


_BLOCKWISE_DTYPES = ("float32", "float16", "bfloat16")

_OURS: dict[int, CompressionBase] = {}


_PLAIN_DTYPE = re.compile(r"[a-z]+[0-9]*")
"""A dtype by its plain name (float32, bfloat16): numpy also reads '(50000,)f4' as one value of 50,000 floats,
and hivemind's decoders hand the sender's dtype string to numpy before any shape is checked."""


def deserialize(serialized: runtime_pb2.Tensor) -> torch.Tensor:
    """Decode a tensor part of any wire format: ours (int8/int4 blockwise) or hivemind's.

    Raises:
        ValueError: a dtype that is no plain name (a part that would decode to many times its size).
    """
    if not _PLAIN_DTYPE.fullmatch(serialized.dtype):
        raise ValueError(f"dtype {serialized.dtype[:40]!r} is not a plain dtype's name")
    codec = _OURS.get(serialized.compression)
    if codec is None:
        return deserialize_torch_tensor(serialized)
    return codec.extract(serialized).requires_grad_(serialized.requires_grad)


# extract() reads block size and shape from the message, so one decoder per format serves every config.
_OURS[INT8_BLOCKWISE] = BlockwiseQuantization(8)
_OURS[INT4_BLOCKWISE] = BlockwiseQuantization(4)


def make_codec(
    name: str,
    *,
    block_size: int = 256,
    small_tensor_numel: int = 4096,
    part_size_bytes: int = DEFAULT_PART_SIZE_BYTES,
) -> CompressionBase:
    """The codec for ``averaging.compression``. Tensors under ``small_tensor_numel`` values (biases,
    norms) go as float16 with int8/int4: a block's scale would cost more than it saves there."""
    if name == "none":
        return NoCompression()
    if name == "fp16":
        return Float16Compression()
    if name in ("int8", "int4"):
        quantizer = BlockwiseQuantization(8 if name == "int8" else 4, block_size, part_size_bytes)
        return SizeAdaptiveCompression(small_tensor_numel, less=Float16Compression(), greater_equal=quantizer)
    raise ValueError(f"unknown compression {name!r}")


def codec_for(cfg: AveragingConfig) -> CompressionBase:
    """The per-tensor codec of an ``averaging`` config section: what error feedback rounds each tensor with,
    and the wire codec tensor by tensor (:func:`layout_for`). Deterministic, so the residual is exactly what
    the wire drops whichever object encodes it, packed or not."""
    return make_codec(cfg.compression, block_size=cfg.block_size, small_tensor_numel=cfg.small_tensor_numel)


def wire_parts(
    tensors: Sequence[torch.Tensor], codec: CompressionBase, part_size_bytes: int = DEFAULT_PART_SIZE_BYTES
) -> list[tuple[torch.Tensor, CompressionInfo]]:
    """The parts hivemind's all-reduce cuts ``tensors`` into, in order, each with its compression info: each
    tensor is split into runs of ``part_size_bytes`` on the wire (``TensorPartContainer``'s cut, which does not
    depend on the group: only which reducer gets which part does)."""
    parts = []
    for key, tensor in enumerate(tensors):
        info = CompressionInfo.from_tensor(tensor, key=key)
        size = int(part_size_bytes / (tensor.element_size() * codec.estimate_compression_ratio(info)))
        for index, part in enumerate(tensor.detach().reshape(-1).split(size)):
            parts.append((part, info.get_part(index, size)))
    return parts


def roundtrip(
    codec: CompressionBase, tensor: torch.Tensor, info: CompressionInfo | None = None
) -> torch.Tensor:
    """What the peers receive when ``tensor`` is sent with ``codec``."""
    info = info or CompressionInfo.from_tensor(tensor)
    return deserialize(codec.compress(tensor, info, allow_inplace=False)).to(tensor.dtype)


class ErrorFeedback:
    """Keep what quantization dropped and send it next round (error feedback, as in EF-SGD / 1-bit Adam).

    ``prepare(delta)`` returns ``Q(delta + residual)`` (already on the codec's grid, so the all-reduce
    sends it without further loss) and holds the new residual; ``commit()`` keeps it once the average
    succeeded, ``discard()`` drops it when nothing was sent.
    """

    def __init__(self, codec: CompressionBase, shapes: Sequence[torch.Size]):
        self.codec = codec
        self.residuals = [torch.zeros(shape, dtype=torch.float32) for shape in shapes]
        self._infos = [CompressionInfo.from_tensor(r, key=i) for i, r in enumerate(self.residuals)]
        self._pending: list[torch.Tensor] | None = None

    def prepare(self, delta: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        corrected = [d + r for d, r in zip(delta, self.residuals)]
        quantized = [roundtrip(self.codec, c, info) for c, info in zip(corrected, self._infos)]
        self._pending = [c - q for c, q in zip(corrected, quantized)]
        return quantized

    def commit(self) -> None:
        if self._pending is not None:
            self.residuals, self._pending = self._pending, None

    def discard(self) -> None:
        self._pending = None


@dataclass(frozen=True)
class Layout:
    """Where a pseudo-gradient's tensors go on the wire (:func:`layout_for`).

    Per tensor (``averaging.packed`` false, as before 2026-12-03) every tensor is its own wire tensor, sent
    with the per-tensor codec. Packed, the tensors are laid end to end in a few flat wire tensors (buckets),
    because hivemind's all-reduce pays per part (a stream, a message, a task, a reducer's bookkeeping): 52
    tensors of gpt-micro are 52 parts or more, two buckets are 8. Under int8 / int4 the small tensors
    (fewer than ``averaging.small_tensor_numel`` values) make one fp16 bucket and the rest one quantized
    bucket in which each tensor starts at a multiple of ``averaging.block_size``, zero padded: a block never
    holds two tensors, padding zeros never raise a block's absmax, and parts are whole blocks, so every value
    is encoded exactly as per tensor, and error feedback (which rounds per tensor) still keeps exactly what
    the wire drops.
    """

    shapes: tuple[torch.Size, ...]
    """The pseudo-gradient's tensors."""
    places: tuple[tuple[int, int], ...]
    """Each tensor's wire tensor and offset in it (values)."""
    wire_shapes: tuple[torch.Size, ...]
    """The wire tensors, as the averager holds them."""
    codec: CompressionBase
    """The wire codec (hivemind's parts carry the wire tensor's index as their key)."""
    part_size_bytes: int
    """The all-reduce's part size: hivemind's cut, which :func:`p2ptrain.verify.wire` seals."""

    def pack(
        self, tensors: Sequence[torch.Tensor], out: Sequence[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """The wire tensors holding ``tensors`` (float32), written into ``out`` when given. Padding is zeroed
        every time: whatever a groupmate put there last round must not move a block's absmax."""
        flats = (
            [torch.zeros(s, dtype=torch.float32) for s in self.wire_shapes]
            if out is None
            else [o.zero_() for o in out]
        )
        for t, (b, offset) in zip(tensors, self.places, strict=True):
            n = t.numel()
            flats[b].view(-1)[offset : offset + n].copy_(t.detach().reshape(-1))
        return flats

    def unpack(self, flats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors that ``pack`` laid into ``flats`` (copies; padding is dropped)."""
        return [
            flats[b].reshape(-1)[offset : offset + math.prod(shape)].view(shape).clone()
            for shape, (b, offset) in zip(self.shapes, self.places, strict=True)
        ]


def layout_for(shapes: Sequence[torch.Size], cfg: AveragingConfig) -> Layout:
    """The wire layout of an ``averaging`` config section for tensors of ``shapes``: a pure function of
    agreed fields, so every peer of a run cuts the same parts."""
    shapes = tuple(torch.Size(s) for s in shapes)
    if not cfg.packed:
        return Layout(
            shapes, tuple((i, 0) for i in range(len(shapes))), shapes, codec_for(cfg), DEFAULT_PART_SIZE_BYTES
        )
    small = [i for i, s in enumerate(shapes) if math.prod(s) < cfg.small_tensor_numel]
    large = [i for i, s in enumerate(shapes) if math.prod(s) >= cfg.small_tensor_numel]
    quantized = cfg.compression in ("int8", "int4")
    # Under int8 / int4: the small tensors in an fp16 bucket, the others each on a block of the quantized one.
    groups = [(small, 1), (large, cfg.block_size)] if quantized else [(list(range(len(shapes))), 1)]
    groups = [g for g in groups if g[0]] or [([], 1)]
    places: list[tuple[int, int]] = [(0, 0)] * len(shapes)
    sizes = []
    for b, (members, align) in enumerate(groups):
        offset = 0
        for i in members:
            places[i] = (b, offset)
            offset += -(-math.prod(shapes[i]) // align) * align
        sizes.append(max(offset, 1))
    if quantized:
        bits = 8 if cfg.compression == "int8" else 4
        per_value = bits / 8 + 4 / cfg.block_size
        part = packed_part_size(sum(sizes) * per_value)
        quantizer = BlockwiseQuantization(bits, cfg.block_size, part)
        codecs = [Float16Compression() if members is small else quantizer for members, _ in groups]
    else:
        part = packed_part_size(sum(sizes) * (2 if cfg.compression == "fp16" else 4))
        codecs = [codec_for(cfg)]
    return Layout(
        shapes, tuple(places), tuple(torch.Size([n]) for n in sizes), PerTensorCompression(codecs), part
    )
