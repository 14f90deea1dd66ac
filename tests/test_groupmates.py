"""What a peer accepts from its all-reduce groupmates, and whom it leaves out, as pure functions.
(On real averagers, with a hostile groupmate: tests/integration/test_averaging.py.)"""

import math

import pytest
import torch
from hivemind.compression import CompressionInfo, NoCompression
from hivemind.p2p import PeerID
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


def test_a_ban_lifted_lets_a_peer_back_and_a_fault_we_saw_ourselves_stands():
    left = LeftOut()
    left.ban("x")
    left.ban("h")
    left.fault("h", Fault.MISBEHAVED, round=3)  # and our own reducer caught h
    assert left.excludes("x", 4) and left.excludes("x", math.inf) and left.for_good() == ["h"]
    left.unban("x")
    left.unban("h")  # the swarm's reputation bans neither: what we saw h do still counts
    assert not left.excludes("x", 4) and left.excludes("h", 4) and left.for_good() == ["h"]


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
    # Holding no such group, or a malformed join: the round's retry goes without it, and no stall is counted.
    for fault in (Fault.ABSENT, Fault.MALFORMED_JOIN):
        assert left.fault("a", fault, round=40) == 40
        assert left.excludes("a", 40) and not left.excludes("a", 41)
    assert left.fault("a", Fault.STALLED, round=41) == 56  # its first stall: 16 rounds
    assert left.fault("s", Fault.ABSENT, round=22) == math.inf  # never shortens a longer exclusion


def test_an_absence_in_a_round_where_a_groupmate_misbehaved_is_explained_and_costs_no_retry():
    # An honest peer that had left "h" out (it misbehaved towards it before) declines a group that holds it:
    # it answers that it holds no such group. Where "h" misbehaves towards us in the same round, the retry
    # goes with that peer (and without "h"), whichever we learn first.
    left = LeftOut()
    assert left.fault("a", Fault.ABSENT, round=7) == 7 and left.excludes("a", 7)
    left.fault("h", Fault.MISBEHAVED, round=7)
    assert not left.excludes("a", 7) and left.excludes("h", 7)
    assert left.fault("b", Fault.ABSENT, round=7) == -1 and not left.excludes("b", 7)
    # Not in another round, and never shorter than what the peer had coming before.
    assert left.fault("a", Fault.ABSENT, round=8) == 8 and left.excludes("a", 8)
    left.fault("s", Fault.STALLED, round=9)
    left.fault("s", Fault.ABSENT, round=10)
    left.fault("h2", Fault.MISBEHAVED, round=10)
    assert left.excludes("s", 24)  # its stall's 16 rounds stand
    # A malformed join is not explained: the retry still goes without its sender.
    left.fault("m", Fault.MALFORMED_JOIN, round=10)
    assert left.excludes("m", 10)


def _group(*entries):
    from hivemind.averaging.group_info import GroupInfo
    from hivemind.p2p import PeerID
    from hivemind.utils import MSGPackSerializer as S

    ids = tuple(PeerID(bytes([i]) * 34) for i in range(len(entries)))
    return GroupInfo(b"g", ids, tuple(S.dumps(e) for e in entries)), ids


def test_a_group_cuts_the_vector_equally_whatever_bandwidth_its_leader_relays():
    from hivemind.averaging.load_balancing import load_balance_peers
    from hivemind.utils import MSGPackSerializer as S

    from p2ptrain.averaging import AveragingMode, checked_group

    node, client = AveragingMode.NODE.value, AveragingMode.CLIENT.value
    joined = S.dumps({"round": 3})
    # The leader (1) relays the other nodes, us (0) among them, with a bandwidth of 0 (found by a review):
    # hivemind would give it the whole vector to reduce, and its average would go unchecked.
    relayed = [[0.0, node, joined], [None, node, joined], [None, client, joined], [0.0, node, joined]]
    assert load_balance_peers(3000, [b if m == node else 0.0 for b, m, _ in relayed]) == (0, 3000, 0, 0)
    group, ids = _group(*relayed)
    checked = [S.loads(e) for e in checked_group(group, ids[0], AveragingMode.NODE, S).gathered]
    assert [c[:2] for c in checked] == [[None, node], [None, node], [None, client], [None, node]]
    assert [S.loads(c[2]) for c in checked] == [{"round": 3}] * 4
    assert load_balance_peers(3000, [b if m == node else 0.0 for b, m, _ in checked]) == (1000, 1000, 0, 1000)


def _swallowed(*fields: bytes) -> bytes:
    """A group id that holds ``fields`` as agreed_group would have hashed them after a shorter one."""
    out = fields[0]
    for f in fields[1:]:
        out += len(f).to_bytes(8, "big") + f
    return out


def test_members_told_different_groups_average_under_different_ids():
    """The id a group is averaged under commits to its leader's id, its members in order and what each joined
    with: members a leader told different groups hold different ids (and say so to each other)."""
    from hivemind.averaging.group_info import GroupInfo

    from p2ptrain.averaging import AveragingMode, agreed_group

    node, client = AveragingMode.NODE.value, AveragingMode.CLIENT.value
    group, ids = _group([None, node, b"a"], [None, node, b"b"], [None, node, b"c"])
    told = agreed_group(group)
    assert told.peer_ids == group.peer_ids and told.gathered == group.gathered
    assert agreed_group(GroupInfo(b"g", ids, group.gathered)).group_id == told.group_id  # deterministic
    lies = [
        GroupInfo(b"h", ids, group.gathered),  # another leader's id
        GroupInfo(b"g", ids[1:] + ids[:1], group.gathered[1:] + group.gathered[:1]),  # another order
        GroupInfo(b"g", ids[:2], group.gathered[:2]),  # a member left out
        _group([None, node, b"a"], [None, client, b"b"], [None, node, b"c"])[0],  # a member demoted
        # Where one field ends and the next begins counts too: a longer leader's id that swallows a byte of
        # the first member's id, or (found by a review) the whole first member, for one member fewer.
        GroupInfo(b"g" + ids[0].to_bytes()[:1], (PeerID(ids[0].to_bytes()[1:]),) + ids[1:], group.gathered),
        GroupInfo(_swallowed(b"g", ids[0].to_bytes(), group.gathered[0]), ids[1:], group.gathered[1:]),
    ]
    assert len({told.group_id} | {agreed_group(lie).group_id for lie in lies}) == 1 + len(lies)


def test_a_leader_that_demotes_us_or_relays_malformed_joins_is_refused():
    import pytest
    from hivemind.averaging.allreduce import AllreduceException
    from hivemind.utils import MSGPackSerializer as S

    from p2ptrain.averaging import AveragingMode, MalformedJoin, checked_group

    node, client = AveragingMode.NODE.value, AveragingMode.CLIENT.value
    ok = S.dumps({"round": 1})
    group, ids = _group([None, client, ok], [None, node, ok])  # we (0) joined as a node
    with pytest.raises(AllreduceException, match="reports us in mode CLIENT, not NODE"):
        checked_group(group, ids[0], AveragingMode.NODE, S)
    for bad in (["fast", node, ok], [None, 7, ok], [None, node, "text"], "junk", [None, node]):
        group, ids = _group([None, node, ok], bad)
        with pytest.raises(MalformedJoin, match=f"{ids[1]} joined the group with malformed data") as e:
            checked_group(group, ids[0], AveragingMode.NODE, S)
        assert e.value.peer == ids[1]  # whom the retry goes without
    group, ids = _group([None, client, ok], [None, client, ok])
    with pytest.raises(AllreduceException, match="every member of the group is a client"):
        checked_group(group, ids[0], AveragingMode.CLIENT, S)


def test_what_a_groupmate_says_about_itself_reaches_the_trainer_flat():
    import pickle

    from hivemind.utils import MSGPackSerializer as S

    from p2ptrain.averaging import AveragingMode, checked_group

    node = AveragingMode.NODE.value
    nested = b"\x91" * 1000 + b"\x00"  # msgpack: 1000 nested lists, which no pipe can pickle
    rounds = [{"round": [1]}, {"round": True}, {"round": 2, "peer": "someone else", "extra": [1] * 9}]
    entries = [[None, node, S.dumps(r)] for r in rounds] + [[None, node, nested], [None, node, b"\xc1"]]
    group, ids = _group(*entries)
    checked = checked_group(group, ids[0], AveragingMode.NODE, S)
    flat = [S.loads(S.loads(e)[2]) for e in checked.gathered]
    assert flat == [{}, {}, {"round": 2}, {}, {}]
    pickle.dumps(flat)


def test_a_message_announced_longer_than_the_limit_is_not_read():
    import asyncio

    import pytest
    from hivemind.p2p import P2P

    from p2ptrain.averaging import MAX_MESSAGE_BYTES

    async def read(length: int, body: bytes) -> bytes:
        reader = asyncio.StreamReader()
        reader.feed_data(length.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body)
        reader.feed_eof()
        return await P2P.receive_raw_data(reader)

    assert asyncio.run(read(5, b"hello")) == b"hello"
    with pytest.raises(asyncio.IncompleteReadError):  # ends as a closed stream does, without reading on
        asyncio.run(read(MAX_MESSAGE_BYTES + 1, b"x" * 1000))


def test_the_barriers_leader_rotates_with_the_round_whatever_ids_a_peer_makes():
    """Under the lowest id, one identity ground to sort first would lead (and could void) every group of the
    run; under a hash of the round and the id, every peer leads about one round in N."""
    from collections import Counter

    from p2ptrain.averaging import barrier_leader

    peers = [f"QmA{i:02d}" for i in range(4)]
    led = Counter(barrier_leader(peers, r) for r in range(400))
    assert set(led) == set(peers) and min(led.values()) > 60, led  # about 100 each
    assert barrier_leader(list(reversed(peers)), 7) == barrier_leader(peers, 7)  # every member names the same
    ground = "Qm0"  # sorts before every other id
    assert Counter(barrier_leader([*peers, ground], r) for r in range(400))[ground] < 120
    assert all(barrier_leader([*peers, ground], r, rotating=False) == ground for r in range(5))


def test_a_no_group_notice_names_its_round_and_is_no_groups_id():
    """A client that a leader accepted and sent no group tells its round's members so under this id: it must
    give back its round (a late notice of another round leaves nobody out), and never be taken for a group's
    id (those are 32-byte hashes), nor a group's id for a notice."""
    import hashlib

    from p2ptrain.averaging import no_group_notice, notice_round

    for round_ in (0, 5, 2**40, -1):
        assert notice_round(no_group_notice(round_)) == round_
    assert no_group_notice(5) != no_group_notice(6)
    assert notice_round(hashlib.sha256(b"a group").digest()) is None
    assert notice_round(no_group_notice(5) + b"\x00") is None


def test_a_step_that_ended_without_a_group_answers_a_waiting_groupmates_part_at_once(monkeypatch):
    """A leader's group reached us as our matchmaking gave up: the other members' parts must learn at once
    that no group of ours is coming (BAD_GROUP_ID: they go on without us), not after half a sender's timeout
    (15 s with the defaults), which hivemind waits because it marks the end of a step only when a group
    registers."""
    import asyncio
    import contextlib

    from hivemind.averaging import DecentralizedAverager

    from p2ptrain.averaging import ExactAverager

    async def gave_up(self, *, step, future_for_init):
        self._pending_groups_registered.clear()  # as hivemind does at each attempt's start
        raise TimeoutError("matchmaking gave up")

    monkeypatch.setattr(DecentralizedAverager, "_step", gave_up)
    averager = ExactAverager.__new__(ExactAverager)
    averager._guard_matchmaking = lambda: None
    averager._running_groups = {}
    averager._parent_pid = -1  # no process of ours to shut down when it is collected

    async def main() -> bool:
        averager._pending_groups_registered = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await averager._step(step=None, future_for_init=None)
        deadline = asyncio.get_running_loop().time() + 15
        return await asyncio.wait_for(averager._holds_group(b"theirs", deadline), 5)

    assert asyncio.run(main()) is False


def test_a_step_given_up_at_its_deadline_does_not_mark_the_newer_steps_group_as_gone(monkeypatch):
    """The trainer may give a step up at its deadline and begin the next one before the old one has ended:
    the old step's end must not tell the new group's parts that no group of ours is coming."""
    import asyncio

    from hivemind.averaging import DecentralizedAverager

    from p2ptrain.averaging import ExactAverager

    async def held(self, *, step, future_for_init):
        self._pending_groups_registered.clear()
        await step.wait()

    monkeypatch.setattr(DecentralizedAverager, "_step", held)
    averager = ExactAverager.__new__(ExactAverager)
    averager._guard_matchmaking = lambda: None
    averager._parent_pid = -1  # no process of ours to shut down when it is collected

    async def main() -> tuple[bool, bool]:
        averager._pending_groups_registered = asyncio.Event()
        old, new = asyncio.Event(), asyncio.Event()
        given_up = asyncio.create_task(averager._step(step=old, future_for_init=None))
        await asyncio.sleep(0)
        newer = asyncio.create_task(averager._step(step=new, future_for_init=None))
        await asyncio.sleep(0)
        old.set()
        await given_up
        while_newer_runs = averager._pending_groups_registered.is_set()
        new.set()
        await newer
        return while_newer_runs, averager._pending_groups_registered.is_set()

    assert asyncio.run(main()) == (False, True)


def test_a_donated_tensor_is_only_ever_float32_values_as_they_are():
    """A donor's bytes are capped (max_state_bytes), not what they decode to: a codec (int4: 8x) or a wider
    dtype (complex128: 2x more) would make many times the cap in memory before any shape is checked."""
    from hivemind.compression import CompressionInfo as Info

    from p2ptrain.averaging import _state_tensor

    donor = PeerID.from_base58("QmXnnyufdzAWL5CqZ2RnSNgPbvCc1ALT73s6epPrRnZ1Xy")
    x = torch.randn(64, 8)
    plain = NoCompression().compress(x, Info.from_tensor(x))
    assert torch.equal(_state_tensor(plain, donor), x)
    quantized = make_codec("int4").compress(x, Info.from_tensor(x))
    wide = NoCompression().compress(x.double(), Info.from_tensor(x.double()))
    short = runtime_pb2.Tensor()
    short.CopyFrom(plain)
    short.size[:] = [64, 800]  # 100x the values its bytes hold
    for crafted in (quantized, wide):
        with pytest.raises(ValueError, match="not float32 values as they are"):
            _state_tensor(crafted, donor)
    with pytest.raises(ValueError, match="truncated tensor"):  # a donor that left mid-stream
        _state_tensor(short, donor)
    longer = runtime_pb2.Tensor()
    longer.CopyFrom(plain)
    longer.buffer += bytes(4 << 20)
    with pytest.raises(ValueError, match="more bytes than its shape holds"):
        _state_tensor(longer, donor)
