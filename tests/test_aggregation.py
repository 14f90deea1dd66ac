"""Robust aggregation: CenteredClip is the weighted mean for honest groups and bounds what one part can do."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.aggregation import centered_clip, coordinate_median, mean, weighted_mean


def honest_parts(n: int, size: int = 4096, spread: float = 0.5, seed: int = 0) -> list[torch.Tensor]:
    """Pseudo-gradients of ``n`` honest peers: one direction plus each peer's own noise."""
    gen = torch.Generator().manual_seed(seed)
    direction = torch.randn(size, generator=gen)
    return [direction + spread * torch.randn(size, generator=gen) for _ in range(n)]


def clip(parts, weights, **radii) -> torch.Tensor:
    return centered_clip(parts, weights, **radii).tensor


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_an_honest_group_gets_its_weighted_mean():
    parts = honest_parts(4)
    weights = [40.0, 40.0, 20.0, 40.0]
    # Exactly, up to float32 rounding: no part is beyond the radius, so the mean is the fixed point itself.
    assert rel(clip(parts, weights), weighted_mean(parts, weights)) < 1e-7


def fixed_point_residual(parts, weights, result, clip_radius=2.0) -> float:
    """How far ``result`` is from CenteredClip's equation sum_i w_i clip(x_i - v, tau) = 0, against tau."""
    xs = torch.stack([p.double() for p in parts])
    v = result.double()
    tau = clip_radius * float(coordinate_median(torch.linalg.vector_norm(xs - coordinate_median(xs), dim=1)))
    offsets = xs - v
    scale = torch.clamp(tau / torch.linalg.vector_norm(offsets, dim=1), max=1.0)
    w = torch.tensor(weights, dtype=torch.float64)
    return float(torch.linalg.vector_norm((w / w.sum() * scale) @ offsets)) / tau


@pytest.mark.parametrize("spread", [0.1, 0.5, 3.0])
@pytest.mark.parametrize("flip", [False, True], ids=["honest", "one_flips"])
def test_the_result_solves_centered_clips_equation(spread, flip):
    # Whether it takes the one-pass answer (nobody beyond the radius) or iterates to it (someone is).
    parts = honest_parts(5, spread=spread, seed=3)
    if flip:
        parts[4] = -3 * parts[4]
    weights = [1.0, 2.0, 1.0, 1.0, 3.0]
    assert fixed_point_residual(parts, weights, clip(parts, weights)) < 1e-5


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 16, 17, 24])
def test_coordinate_median_agrees_with_sorting(n):
    # Up to SORTING_NETWORK_MAX parts by a min/max network, beyond by torch's sort; ties included.
    gen = torch.Generator().manual_seed(n)
    parts = [torch.randint(-3, 4, (257,), generator=gen).float() * 0.5 for _ in range(n)]
    ordered = torch.stack(parts).double().sort(dim=0).values
    assert torch.equal(coordinate_median(parts), (ordered[(n - 1) // 2] + ordered[n // 2]) / 2)


@pytest.mark.parametrize("n", [1, 2])
def test_with_no_majority_it_is_the_mean(n):
    parts = honest_parts(n)
    parts[-1] = -10 * parts[-1]  # nobody can tell which of two is right
    assert rel(clip(parts, [1.0] * n), weighted_mean(parts, [1.0] * n)) < 1e-5


@pytest.mark.parametrize(
    "attack",
    [
        lambda x: -10 * x,  # the sign-flipper of the design notes
        lambda x: 1000 * x,
        lambda x: x + 100 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1)),
    ],
    ids=["sign_flip_x10", "x1000", "noise"],
)
def test_one_attacker_of_four_moves_the_result_by_at_most_the_honest_spread(attack):
    parts = honest_parts(4)
    honest = weighted_mean(parts[:3], [1.0] * 3)
    spread = max(rel(p, honest) for p in parts[:3])
    parts[3] = attack(parts[3])
    weights = [1.0] * 4
    assert rel(weighted_mean(parts, weights), honest) > 2 * spread  # the plain mean is taken
    assert rel(clip(parts, weights), honest) < spread  # CenteredClip is not


def test_a_smaller_radius_clips_harder():
    parts = honest_parts(4)
    honest = weighted_mean(parts[:3], [1.0] * 3)
    parts[3] = -10 * parts[3]
    errors = [rel(clip(parts, [1.0] * 4, clip_radius=r), honest) for r in (0.5, 2.0, 8.0)]
    assert errors == sorted(errors)


def test_a_claimed_weight_buys_influence_in_proportion_so_weights_are_capped():
    # Why averaging.py refuses a weight above max_weight: short of a majority of the weight, an attacker moves
    # the result in proportion to its share, and far less than it moves the mean.
    parts = honest_parts(4)
    honest = weighted_mean(parts[:3], [1.0] * 3)
    parts[3] = -10 * parts[3]
    clipped, plain = [], []
    for w in (0.5, 1.0, 2.0):
        clipped.append(rel(clip(parts, [1.0, 1.0, 1.0, w]), honest))
        plain.append(rel(weighted_mean(parts, [1.0, 1.0, 1.0, w]), honest))
    assert clipped == sorted(clipped)
    assert all(c < p / 5 for c, p in zip(clipped, plain))


def test_equal_majority_wins_outright_and_shapes_are_kept():
    same = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    out = clip([same, same.clone(), same * -50], [1.0, 1.0, 1.0])
    assert out.shape == (3, 4)
    assert torch.equal(out, same)


def test_it_is_deterministic():
    parts = honest_parts(5)
    parts[0] = parts[0] * 30
    a = clip(parts, [1.0] * 5)
    b = clip([p.clone() for p in parts], [1.0] * 5)
    assert torch.equal(a, b)


def test_coordinate_median_of_an_even_count_is_the_mean_of_the_middle_two():
    parts = [
        torch.tensor([1.0, 10.0]),
        torch.tensor([2.0, 20.0]),
        torch.tensor([4.0, 0.0]),
        torch.tensor([8.0, 5.0]),
    ]
    assert torch.equal(coordinate_median(parts), torch.tensor([3.0, 7.5]))


def test_bad_calls_are_refused_by_name():
    with pytest.raises(ValueError, match="nothing to aggregate"):
        clip([], [])
    with pytest.raises(ValueError, match="2 parts but 1 weights"):
        clip(honest_parts(2), [1.0])


def test_the_reducer_hands_every_sender_the_aggregate_of_every_senders_part():
    """hivemind's reducer protocol (parts in any order, one future per part), with our combining step."""
    import asyncio

    from p2ptrain.averaging import RobustPartReducer

    shapes = [torch.Size([1000]), torch.Size([5])]
    senders = [[x[:1000], x[1000:]] for x in honest_parts(4, size=1005)]
    senders[3] = [-10 * t for t in senders[3]]
    aggregate = lambda parts, weights: centered_clip(parts, weights, reject_radius=4.0)  # noqa: E731
    weights = [1.0, 2.0, 1.0, 1.0]

    async def send(reducer, i):
        return [await reducer.accumulate_part(i, k, senders[i][k], weight=weights[i]) for k in range(2)]

    reducer = None

    async def run():
        nonlocal reducer
        reducer = RobustPartReducer(shapes, len(senders), aggregate=aggregate)
        return await asyncio.gather(*(send(reducer, i) for i in reversed(range(4))))

    got = asyncio.run(run())
    for k in range(2):
        # The same tensor for every sender, whatever order the parts came in.
        expected = aggregate([s[k] for s in senders], weights).tensor
        assert all(torch.equal(got[i][k], expected) for i in range(4))
    assert reducer.parts_left_out == {3: 2}  # both parts of the sign-flipper, by its sender index


def test_the_runner_replaces_hiveminds_reducer_without_it_warning_that_it_received_nothing():
    """Every peer's log said "Reducer: received 0.0% of input tensors" every round: the reducer that
    hivemind's runner makes, replaced by ours and collected at once, warned as it finalized."""
    import asyncio
    import logging

    from hivemind.p2p import PeerID

    from p2ptrain.averaging import ExactAllReduceRunner, ExactAverager
    from p2ptrain.compression import make_codec

    me, other = PeerID(b"\x00\x24" + b"a" * 36), PeerID(b"\x00\x24" + b"b" * 36)
    warned: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warned.append(record.getMessage())

    class P2P:
        peer_id = me

    async def make():
        return ExactAllReduceRunner(
            p2p=P2P(),
            servicer_type=ExactAverager,
            prefix="run",
            group_id=b"group",
            tensors=[torch.zeros(10)],
            ordered_peer_ids=[me, other],
            peer_fractions=(0.5, 0.5),
            compression=make_codec("none"),
        )

    handler = Collect(level=logging.WARNING)
    logging.getLogger("hivemind.averaging.partition").addHandler(handler)
    try:
        runner = asyncio.run(make())
        assert warned == []
        runner.tensor_part_reducer.finished.set()  # never run here: it would rightly warn when collected
    finally:
        logging.getLogger("hivemind.averaging.partition").removeHandler(handler)


def test_a_part_far_beyond_the_spread_gets_no_weight_at_all():
    parts = honest_parts(4)
    honest = weighted_mean(parts[:3], [1.0] * 3)
    parts[3] = -10 * parts[3]
    clipped = clip(parts, [1.0] * 4)
    rejected = clip(parts, [1.0] * 4, reject_radius=4.0)
    torch.testing.assert_close(rejected, clip(parts[:3], [1.0] * 3))
    assert centered_clip(parts, [1.0] * 4, reject_radius=4.0).left_out == (3,)
    assert rel(rejected, honest) < rel(clipped, honest)
    # An honest group loses nobody.
    honest4 = honest_parts(4, seed=3)
    assert centered_clip(honest4, [1.0] * 4, reject_radius=4.0).left_out == ()
    torch.testing.assert_close(clip(honest4, [1.0] * 4, reject_radius=4.0), weighted_mean(honest4, [1.0] * 4))


@pytest.mark.parametrize("aggregate", [weighted_mean, clip], ids=["mean", "centered_clip"])
def test_values_near_float32s_limit_never_make_the_reducers_answer_non_finite(aggregate):
    # Summed or squared in float32 they would overflow, and the group would blame the (honest) reducer.
    parts = honest_parts(3)
    parts.append(torch.full_like(parts[0], 3e38))
    out = aggregate(parts, [240.0] * 4)
    assert out.dtype == torch.float32 and bool(torch.isfinite(out).all())


def test_the_reducer_goes_on_without_a_dropped_sender_and_never_hangs_on_a_failed_aggregate():
    import asyncio

    from p2ptrain.averaging import RobustPartReducer

    shapes = [torch.Size([10]), torch.Size([10])]
    parts = [[torch.full((10,), float(i + k)) for k in range(2)] for i in range(3)]

    async def dropped_after_one_part():
        reducer = RobustPartReducer(shapes, 3, aggregate=mean)

        async def sender(i):
            out = [await reducer.accumulate_part(i, 0, parts[i][0])]
            if i == 2:
                reducer.on_sender_failed(2)  # hivemind bans it: its part 1 never comes
                return out
            return out + [await reducer.accumulate_part(i, 1, parts[i][1])]

        return await asyncio.wait_for(asyncio.gather(*(sender(i) for i in range(3))), 10)

    got = asyncio.run(dropped_after_one_part())
    assert torch.equal(got[0][0], torch.full((10,), 1.0))  # (0 + 1 + 2) / 3
    assert torch.equal(got[0][1], torch.full((10,), 1.5))  # (1 + 2) / 2: without the dropped sender

    def broken(parts, weights):
        raise RuntimeError("out of memory")

    async def failing():
        reducer = RobustPartReducer(shapes[:1], 2, aggregate=broken)
        sends = (reducer.accumulate_part(i, 0, parts[i][0]) for i in range(2))
        return await asyncio.wait_for(asyncio.gather(*sends, return_exceptions=True), 10)

    assert all(isinstance(e, RuntimeError) for e in asyncio.run(failing()))
