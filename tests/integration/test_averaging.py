"""The exact all-reduce on real hivemind DHTs and averagers (in this process's children)."""

from __future__ import annotations

import threading

import pytest
import torch

from p2ptrain.averaging import SwarmAverager
from p2ptrain.config import AveragingConfig, SwarmConfig
from p2ptrain.diloco import AveragingFailed
from p2ptrain.swarm import create_dht

pytestmark = pytest.mark.integration

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


@pytest.fixture
def swarm_of():
    made = []

    def make(n: int, **cfg):
        first = create_dht(SwarmConfig(host_maddrs=LOOPBACK))
        dhts = [first]
        maddrs = [str(a) for a in first.get_visible_maddrs()]
        dhts += [create_dht(SwarmConfig(initial_peers=maddrs, host_maddrs=LOOPBACK)) for _ in range(n - 1)]
        shapes = [torch.Size([1000]), torch.Size([7, 3]), torch.Size([1])]
        config = AveragingConfig(matchmaking_time_s=2.0, request_timeout_s=1.0, retries=0, **cfg)
        averagers = [
            SwarmAverager(
                d, run_id="t", shapes=shapes, cfg=config, client_mode=False, state_provider=lambda: ({}, [])
            )
            for d in dhts
        ]
        made.extend(averagers + dhts)
        return averagers, shapes

    yield make
    for item in made:
        item.shutdown()


def run_parallel(fns):
    results = [None] * len(fns)

    def call(i):
        try:
            results[i] = fns[i]()
        except Exception as e:  # collected and asserted on by the test
            results[i] = e

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_three_peers_get_bit_identical_weighted_average(swarm_of):
    averagers, shapes = swarm_of(3, compression="fp16")
    torch.manual_seed(0)
    inputs = [[torch.randn(s) * (i + 1) for s in shapes] for i in range(3)]
    weights = [1.0, 2.0, 5.0]
    results = run_parallel(
        [lambda a=a, x=x, w=w: a.average(x, weight=w, round=4) for a, x, w in zip(averagers, inputs, weights)]
    )
    for r in results:
        assert not isinstance(r, Exception), r
        assert r.group_size == 3 and r.bytes_sent > 0 and r.bytes_received > 0
    expected = [sum(w * x[k] for w, x in zip(weights, inputs)) / sum(weights) for k in range(len(shapes))]
    for k in range(len(shapes)):
        # fp16 on the wire: close to the true average...
        assert torch.allclose(results[0].tensors[k], expected[k], atol=1e-2, rtol=1e-2)
        # ...and exactly the same bytes on every peer.
        assert torch.equal(results[0].tensors[k], results[1].tensors[k])
        assert torch.equal(results[0].tensors[k], results[2].tensors[k])


def test_peers_of_different_rounds_never_average(swarm_of):
    averagers, shapes = swarm_of(2)
    x = [torch.ones(s) for s in shapes]
    results = run_parallel(
        [
            lambda: averagers[0].average(x, weight=1, round=1),
            lambda: averagers[1].average(x, weight=1, round=2),
        ]
    )
    assert all(isinstance(r, AveragingFailed) for r in results), results
