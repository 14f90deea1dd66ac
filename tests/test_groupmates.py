"""What a peer accepts from its all-reduce groupmates, and whom it leaves out, as pure functions.
(On real averagers, with a hostile groupmate: tests/integration/test_averaging.py.)"""

import math

import torch
from hivemind.compression import CompressionInfo, NoCompression
from hivemind.proto import runtime_pb2

from p2ptrain.averaging import Fault, LeftOut, _decoded, part_problem
from p2ptrain.compression import make_codec


def test_a_part_must_have_exactly_the_expected_shape_dtype_and_finite_values():
    shape = torch.Size([4, 3])
    assert part_problem(torch.zeros(shape), shape) is None
    assert "shape (12,)" in part_problem(torch.zeros(12), shape)  # never broadcast or reshape
    assert "shape (1, 3)" in part_problem(torch.zeros(1, 3), shape)
    assert "dtype" in part_problem(torch.zeros(shape, dtype=torch.float64), shape)
    for bad in (float("nan"), float("inf"), -float("inf")):
        poisoned = torch.zeros(shape)
        poisoned[2, 1] = bad
        assert part_problem(poisoned, shape) == "non-finite values"
    assert part_problem(torch.zeros(shape), None) == "one part too many"
    assert "does not decode" in part_problem(None, shape)


def test_a_claimed_size_is_checked_before_decoding_and_garbage_does_not_decode():
    shape = torch.Size([8192])  # above the codecs' small-tensor threshold: the blockwise formats are used
    for name in ("none", "fp16", "int8", "int4"):
        x = torch.randn(shape)
        serialized = make_codec(name).compress(x, CompressionInfo.from_tensor(x))
        assert _decoded(serialized, shape).shape == shape, name
        assert _decoded(serialized, torch.Size([8191])) is None, name
    huge = runtime_pb2.Tensor(compression=runtime_pb2.NONE, size=[2**30], dtype="float32", buffer=b"\0" * 16)
    assert _decoded(huge, shape) is None  # refused without allocating 4 GB
    zeros = torch.zeros(shape)
    garbage = NoCompression().compress(zeros, CompressionInfo.from_tensor(zeros))
    garbage.buffer = garbage.buffer[:100]
    assert _decoded(garbage, shape) is None


def test_a_peer_that_misbehaves_is_left_out_for_the_rest_of_the_run():
    left = LeftOut()
    assert not left.excludes("h", 0)
    assert left.fault("h", Fault.MISBEHAVED, round=3) == math.inf
    assert left.excludes("h", 3) and left.excludes("h", 10**9)
    assert not left.excludes("other", 3)


def test_stalls_leave_a_peer_out_of_16_rounds_then_twice_as_many_counted_once_per_round():
    left = LeftOut()
    assert left.fault("s", Fault.STALLED, round=5) == 20  # the retry of round 5 goes without it, and 15 more
    assert left.fault("s", Fault.STALLED, round=5) == 20  # as sender and as reducer: one stall
    assert left.excludes("s", 5) and left.excludes("s", 20) and not left.excludes("s", 21)
    assert left.fault("s", Fault.STALLED, round=21) == 52
    assert left.fault("s", Fault.STALLED, round=53) == 116
    assert left.for_a_while(53) == ["s"] and left.for_a_while(116) == [] and left.for_good() == []
    # After a misbehaviour, a stall does not shorten the exclusion.
    left.fault("s", Fault.MISBEHAVED, round=20)
    assert left.fault("s", Fault.STALLED, round=21) == math.inf
    assert left.for_good() == ["s"] and left.for_a_while(21) == []
    left.for_round("v", 30)  # a verdict's: that round only
    assert left.for_a_while(30) == []
