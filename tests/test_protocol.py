"""The round protocol's decisions, from tables of records: no network, no model, no clock."""

import time
from dataclasses import replace

import pytest

from p2ptrain import protocol
from p2ptrain.protocol import BarrierState, BehindState, DonorBackoff, LingerState, Me, Stranded, SwarmMemory
from p2ptrain.records import PeerState, ProgressRecord


def rec(peer, round=0, state="training", h="aa", group=2, samples=0, view="", serves=True):
    return ProgressRecord(
        peer_id=peer,
        round=round,
        state=state,
        params_hash=h,
        samples_round=0,
        samples_total=samples,
        samples_per_s=0.0,
        last_group_size=group,
        device="cpu",
        time=time.time(),
        view=view,
        serves=serves,
    )


def table(*records):
    return {r.peer_id: r for r in records}


def me(round=3, h="aa", group=2):
    return Me("me", round, h, group)


# --- credibility


def test_one_identity_ahead_is_not_believed_while_two_others_hold_params():
    ours = rec("b", 3, h="aa")
    lone = rec("h", 4, h="ee")  # one round ahead, alone
    far = rec("h", 9, h="ee")
    assert protocol.credible(table(ours, lone), my_round=3) == table(ours)
    assert protocol.credible(table(ours, far), my_round=3) == table(ours)
    # Two identities that report the same round and params are believed.
    pair = table(ours, rec("x", 4, h="ee"), rec("y", 4, h="ee"))
    assert protocol.credible(pair, my_round=3) == pair
    # Two that disagree on the params are not.
    split = table(ours, rec("x", 4, h="ee"), rec("y", 4, h="ef"))
    assert protocol.credible(split, my_round=3) == table(ours)


def test_one_peer_ahead_is_believed_when_it_is_the_only_other_holder():
    # A two-peer swarm, or restarted peers (loading: they hold no params) behind the one peer that went on.
    alone = table(rec("a", 7, h="ee"))
    assert protocol.credible(alone, my_round=3) == alone
    with_loaders = table(rec("a", 7, h="ee"), rec("b", 2, state="loading", h="11"))
    assert protocol.credible(with_loaders, my_round=3) == with_loaders


def test_at_a_runs_start_a_peer_loading_into_round_0_outvotes_one_claim_of_a_later_round():
    """As a run starts every peer loads into round 0 until its first inner phase, holding no params by its
    record: one insider that claimed round 1 was the only holder, so believed, and every honest peer asked it
    for its state for swarm.catch_up_timeout_s. A peer loading into round 0 holds the initial params."""
    loading = rec("b", 0, state="loading", h="00")
    starting = table(loading, rec("h", 1, h="ee"))
    assert protocol.credible(starting, my_round=0) == table(loading)
    # Later in a run, a peer loading (a newcomer, a restarted one) still holds nothing to outvote with.
    later = table(loading, rec("a", 4, h="ee"))
    assert protocol.credible(later, my_round=3) == later


def test_claims_at_or_behind_our_round_are_never_filtered():
    others = table(rec("a", 3, h="a1"), rec("b", 3, h="a2"), rec("c", 2, h="a3"))
    assert protocol.credible(others, my_round=3) == others


def test_memory_counts_only_credible_claims_ahead():
    memory = SwarmMemory(num_rounds=10)
    memory.observe(table(rec("b", 3), rec("h", 10, state="done", h="ee")), my_round=3)
    assert memory.highest_round == 3 and not memory.swarm_finished
    memory.observe(table(rec("b", 3), rec("h", 10, state="done", h="ee")))  # no round given: as read
    assert memory.highest_round == 10 and memory.swarm_finished


def test_a_claim_credible_in_an_early_reading_is_forgotten_once_the_swarm_outvotes_it():
    """An insider claims round 1 as the run starts; one honest peer reads it before any other record has
    arrived (the only holder: credible), then the other honest peer's record, loading into round 0. The claim
    was remembered, and its reader waited swarm.catch_up_timeout_s for a round nobody held."""
    memory = SwarmMemory(num_rounds=10)
    liar = rec("h", 1, h="ee")
    memory.observe(table(liar), my_round=0)
    assert memory.highest_round == 1  # believed, alone
    outvoted = table(liar, rec("b", 0, state="loading", h="00"))
    memory.observe(outvoted, my_round=0)
    assert memory.highest_round == -1
    decision = protocol.behind(
        me(round=0), memory.visible(outvoted, 0), memory, now=0.0, resting=(), timeout_s=10
    )
    assert decision.state == BehindState.NO
    # A peer that is gone keeps what it last showed (it may have crashed holding the swarm's newest state)...
    memory.observe(table(rec("a", 4, h="ff")), my_round=3)
    memory.observe({}, my_round=3)
    assert memory.highest_round == 4
    # ...unless it is distrusted (banned, refused): its claims go with it.
    memory.observe({}, my_round=3, distrusted=["a"])
    assert memory.highest_round == -1


def test_a_reading_mid_outer_step_is_unsettled_and_a_settled_one_is_not():
    newcomer = me(round=0)
    # a published its step into round 4, b is still averaging round 3: neither is credible alone.
    split = table(rec("a", 4, h="bb"), rec("b", 3, state="averaging", h="aa"))
    assert protocol.unsettled(newcomer, split)
    assert not protocol.unsettled(newcomer, table(rec("a", 4, h="bb"), rec("b", 4, h="bb")))  # both stepped
    assert not protocol.unsettled(newcomer, table(rec("a", 3, h="aa"), rec("b", 3, state="averaging")))
    assert not protocol.unsettled(newcomer, table(rec("a", 4, h="bb")))  # the only other holder
    assert not protocol.unsettled(me(round=4), split)  # nobody past us
    assert not protocol.unsettled(newcomer, {})


# --- catching up


def test_nobody_ahead_no_catch_up():
    assert protocol.catch_up(me(), table(rec("a", 3), rec("b", 2))) is None


def test_catch_up_targets_the_highest_held_round_and_its_canonical_holders_most_samples_first():
    others = table(
        rec("a", 5, h="cc", samples=10),
        rec("b", 5, h="cc", samples=30),
        rec("c", 5, h="dd", samples=99),  # the minority hash: not a donor
        rec("d", 4, h="bb"),
        rec("e", 9, state="loading", h="99"),  # a newcomer's claim holds no params
        rec("f", 9, state="left", h="99"),  # gone
    )
    plan = protocol.catch_up(me(), others)
    assert plan.round == 5 and plan.params_hash == "cc" and plan.donors == ["b", "a"]


def test_done_peers_serve_the_final_state():
    plan = protocol.catch_up(me(round=7), table(rec("a", 8, state="done", h="ff")))
    assert plan.round == 8 and plan.donors == ["a"]


def test_resting_donors_are_left_out_but_counted():
    plan = protocol.catch_up(me(), table(rec("a", 5, samples=2), rec("b", 5, samples=1)), resting={"a"})
    assert plan.donors == ["b"] and plan.resting == 1


def test_donor_backoff_doubles_up_to_a_cap_and_forgets_on_success():
    b = DonorBackoff(base_s=1.0, max_s=5.0)
    b.failed("a", now=0.0)
    assert b.resting(0.5) == {"a"} and b.resting(1.0) == set()
    b.failed("a", now=1.0)  # 2 s
    b.failed("a", now=3.0)  # 4 s
    b.failed("a", now=7.0)  # 8 s, capped at 5
    assert b.next_try(7.0) == 12.0 and b.resting(11.9) == {"a"}
    b.succeeded("a")
    assert b.resting(7.0) == set()


# --- a peer left behind


def behind(me_, others, memory, now, timeout_s=10, resting=()):
    memory.observe(others)
    return protocol.behind(me_, others, memory, now=now, resting=resting, timeout_s=timeout_s)


def test_behind_loads_from_live_holders_and_is_not_behind_once_level():
    memory = SwarmMemory(num_rounds=10)
    decision = behind(me(round=3), table(rec("a", 5)), memory, now=0.0)
    assert decision.state == BehindState.LOAD and decision.plan.donors == ["a"]
    assert behind(me(round=5), table(rec("a", 5)), memory, now=1.0).state == BehindState.NO
    assert memory.behind_since is None


def test_a_peer_one_round_behind_whose_holders_vanished_waits_then_goes_on():
    memory = SwarmMemory(num_rounds=10)
    behind(me(round=4), table(rec("a", 5)), memory, now=0.0)  # seen ahead; then it crashed
    assert behind(me(round=4), {}, memory, now=1.0).state == BehindState.WAIT
    assert behind(me(round=4), {}, memory, now=9.9).state == BehindState.WAIT
    assert behind(me(round=4), {}, memory, now=10.0).state == BehindState.GO_ON


def test_a_peer_that_cannot_get_the_state_from_live_holders_gives_up_on_them_after_the_timeout():
    memory = SwarmMemory(num_rounds=10)
    others = table(rec("a", 5))
    assert behind(me(round=4), others, memory, now=0.0).state == BehindState.LOAD
    assert behind(me(round=4), others, memory, now=5.0, resting={"a"}).state == BehindState.WAIT
    decision = behind(me(round=4), others, memory, now=10.0)
    assert decision.state == BehindState.GO_ON and decision.ahead == ["a"]
    memory.give_up_on(decision.ahead, my_round=4)
    visible = memory.visible(others, my_round=4)
    assert visible == {} and behind(me(round=4), visible, memory, now=11.0).state == BehindState.NO
    # once it is no longer ahead of us, it counts again
    assert list(memory.visible(table(rec("a", 5)), my_round=5)) == ["a"]


def test_a_peer_further_behind_never_trains_alone_from_its_old_round():
    memory = SwarmMemory(num_rounds=10)
    behind(me(round=0), table(rec("a", 5)), memory, now=0.0)  # a newcomer; its only donor dies
    assert behind(me(round=0), {}, memory, now=5.0).state == BehindState.WAIT
    decision = behind(me(round=0), {}, memory, now=10.0)
    assert decision.state == BehindState.STRANDED and decision.why == Stranded.TOO_FAR_BEHIND


def test_a_finished_swarm_strands_a_peer_at_once_when_nobody_serves_the_final_state():
    memory = SwarmMemory(num_rounds=6)
    decision = behind(me(round=5), table(rec("a", 6, state="left", h="ff")), memory, now=0.0)
    assert memory.swarm_finished
    assert decision.state == BehindState.STRANDED and decision.why == Stranded.SWARM_FINISHED
    # while a finished peer is alive, load its final state
    assert behind(me(round=5), table(rec("b", 6, state="done")), memory, now=1.0).state == BehindState.LOAD


def test_memory_survives_a_restart_and_ignores_malformed_parts():
    memory = SwarmMemory(num_rounds=6)
    memory.observe(table(rec("a", 6, state="done", h="ff", group=3)))
    restored = SwarmMemory(num_rounds=6)
    restored.restore(memory.to_dict())
    assert restored.swarm_finished and restored.highest_round == 6
    assert restored.final_votes() == memory.final_votes()
    restored.restore({"highest_round": "x", "final_votes": {"b": "junk"}, "swarm_finished": 1})
    assert restored.highest_round == 6 and len(restored.final_votes()) == 1
    # Votes whose parts are of the wrong kind were a ValueError that stopped the peer at start.
    bad = {"c": ["cc", "x"], "d": ["dd", None], "e": [None, 2], "f": ["ff", True], "g": ["aa", -1]}
    restored.restore({"final_votes": bad})
    assert len(restored.final_votes()) == 1
    # Whether a finished peer served its params is kept too (a client-mode one did not)...
    client = SwarmMemory(num_rounds=6)
    client.observe(table(rec("c", 6, state="done", h="ee", serves=False)))
    again = SwarmMemory(num_rounds=6)
    again.restore(client.to_dict())
    assert again.final_votes() == client.final_votes() and not again.final_votes()[0].serves
    # ...and a checkpoint from before it was recorded still restores, as a peer that serves.
    again.restore({"final_votes": {"d": ["dd", 2]}})
    assert len(again.final_votes()) == 2


def test_a_peer_that_never_saw_anyone_ahead_is_not_behind():
    memory = SwarmMemory(num_rounds=6)
    others = table(rec("a", 2), rec("b", 9, state="loading"))
    assert behind(me(round=2), others, memory, now=0.0).state == BehindState.NO
    assert memory.behind_since is None


# --- a round


def test_roster_is_the_sorted_ids_of_the_peers_training_our_round():
    others = table(rec("b", 3), rec("d", 3, state="averaging"), rec("a", 2), rec("c", 3, state="loading"))
    assert protocol.roster(me(), others) == (3, 4)  # b, c, d, me
    assert protocol.roster(me(), table(rec("x", 3, state="done"), rec("y", 3, state="left"))) == (0, 1)
    assert protocol.roster(me(), table(rec("x", 3, state="paused"))) == (0, 1), (
        "a paused peer trains no shard"
    )


def test_the_roster_counts_the_peers_still_averaging_the_round_before_ours_they_step_into_it_next():
    """Peers that just averaged round 2 together: whoever starts round 3 first must not see itself alone
    (rank 0 of 1 and rank 0 of 3 train the same windows)."""
    others = table(rec("a", 2, state="averaging"), rec("z", 2, state="averaging"))
    assert protocol.roster(me(), others) == (1, 3)  # a, me, z
    assert protocol.roster(me(), table(rec("a", 2), rec("z", 1, state="averaging"))) == (0, 1), (
        "a peer still training an older round, or two rounds behind, is not about to train ours"
    )


def test_next_roster_counts_everyone_who_will_train_the_next_round():
    """outer.overlap: we train round 4 while our round 3 is averaged; so do the others, each as soon as it
    has passed its barrier of round 3."""
    others = table(
        rec("b", 4),  # its round-3 sync has landed: training round 4
        rec("d", 3, state="averaging"),  # averaging round 3, as we are: training round 4
        rec("c", 3, state="training"),  # still in round 3 past our barrier (left out of it): comes into 4
        rec("f", 2, state="averaging"),  # training round 3 while its round-2 sync lands
        rec("a", 4, state="loading"),
        rec("e", 4, state="paused"),
        rec("g", 2),  # two rounds behind: catching up, not about to train round 4 with us
        rec("h", 3, state="done"),
    )
    assert protocol.next_roster(me(), others) == (5, 6)  # a, b, c, d, f, me


def test_peers_starting_the_next_round_at_different_moments_agree_on_its_roster():
    """The overlap bug it pins: the first of three peers to finish round 3 counted only itself and those
    averaging, and trained rank 0 of a world of 1, the windows of the others' rank 0."""
    first = protocol.next_roster(
        Me("a", 3, "aa", 2), table(rec("b", 3, state="training"), rec("c", 3, state="training"))
    )
    second = protocol.next_roster(
        Me("b", 3, "aa", 2), table(rec("a", 3, state="averaging"), rec("c", 3, state="training"))
    )
    last = protocol.next_roster(
        Me("c", 3, "aa", 2), table(rec("a", 3, state="averaging"), rec("b", 3, state="averaging"))
    )
    assert (first, second, last) == ((0, 3), (1, 3), (2, 3))


@pytest.mark.parametrize(
    "others, expected, waiting",
    [
        (table(rec("a", 3, "averaging"), rec("b", 3, "averaging")), BarrierState.GO, []),
        (table(rec("a", 3, "averaging"), rec("b", 3, "training")), BarrierState.WAIT, ["b"]),
        (
            table(rec("a", 3, "averaging"), rec("b", 3, "loading")),
            BarrierState.WAIT,
            ["b"],
        ),  # loading into it
        (table(rec("a", 3, "averaging"), rec("b", 3, "done"), rec("c", 3, "left")), BarrierState.GO, []),
        (table(rec("a", 3, "training"), rec("b", 4, "training")), BarrierState.STALE, []),
        (table(rec("a", 3, "averaging"), rec("b", 9, "loading")), BarrierState.GO, []),
        # one round behind, in its inner phase or sync: it will step into ours or load it, then train it
        (table(rec("a", 3, "averaging"), rec("b", 2, "averaging")), BarrierState.WAIT, ["b"]),
        (table(rec("a", 3, "averaging"), rec("b", 2, "training")), BarrierState.WAIT, ["b"]),
        (table(rec("a", 3, "averaging"), rec("b", 2, "loading")), BarrierState.WAIT, ["b"]),
        (table(rec("a", 3, "averaging"), rec("b", 1, "training"), rec("c", 2, "done")), BarrierState.GO, []),
        # paused by its schedule, in our round or one behind: nobody waits for it
        (table(rec("a", 3, "averaging"), rec("b", 3, "paused"), rec("c", 2, "paused")), BarrierState.GO, []),
        ({}, BarrierState.GO, []),
    ],
)
def test_barrier(others, expected, waiting):
    decision = protocol.barrier(me(), others, now=0.0, deadline=10.0)
    assert decision.state == expected and decision.waiting_for == waiting


def test_a_finished_swarm_makes_a_round_before_the_last_stale_even_when_its_peers_are_gone():
    assert (
        protocol.barrier(me(), {}, now=0, deadline=9, swarm_finished=True, num_rounds=4).state
        == BarrierState.STALE
    )
    assert (
        protocol.barrier(me(), {}, now=0, deadline=9, swarm_finished=False, num_rounds=4).state
        == BarrierState.GO
    )
    assert not protocol.may_step_alone(me(), {}, swarm_finished=True)


def test_a_peer_waited_out_once_is_not_waited_for_again_but_joins_when_ready():
    others = table(rec("a", 3, state="training"), rec("b", 3, state="averaging"))
    d = protocol.barrier(me(), others, now=0, deadline=10, not_waited={"a"})
    assert d.state == BarrierState.GO and [r.peer_id for r in d.ready] == ["b"]
    ready = table(rec("a", 3, state="averaging"), rec("b", 3, state="averaging"))
    d = protocol.barrier(me(), ready, now=0, deadline=10, not_waited={"a"})
    assert [r.peer_id for r in d.ready] == ["a", "b"]
    memory = SwarmMemory(num_rounds=100)
    memory.waited_out_on(["a", "c"], round=3)
    memory.averaged_with(["a", "me"])
    assert memory.waited_out(3) == {"c"} and memory.waited_out(18) == {"c"}
    assert memory.waited_out(19) == set()  # waited for again, 16 rounds later


def test_a_peer_whose_params_nobody_else_holds_is_lone():
    # Two others or more hold params, none of them ours (our round and hash): we stepped alone.
    assert protocol.lone(me(3, "aa"), table(rec("a", 3, h="bb"), rec("b", 1, h="cc")))
    assert protocol.lone(
        me(3, "aa"), table(rec("a", 2, h="aa"), rec("b", 4, h="aa"))
    )  # same hash, other rounds
    assert not protocol.lone(me(3, "aa"), table(rec("a", 3, h="aa"), rec("b", 1, h="cc")))  # a holds ours
    # One other holder believes our claim (protocol.credible): it can load our state. Loading peers hold none.
    assert not protocol.lone(me(3, "aa"), table(rec("a", 1, h="bb"), rec("b", 1, "loading", h="bb")))
    assert not protocol.lone(me(3, "aa"), {})
    # Paused or finished peers train no rounds: a volunteer's peers paused at older rounds make nobody lone.
    idle = table(rec("a", 1, "paused", h="bb"), rec("b", 9, "done", h="cc"), rec("c", 2, h="dd"))
    assert not protocol.lone(me(3, "aa"), idle)


def test_a_lone_peer_waits_for_every_peer_behind_it_and_only_a_lone_one_does():
    # After a split each peer stepped alone, some further than others: nobody can load the state of a peer
    # ahead (one identity), so those behind come to its round by training, and it waits for them.
    scattered = table(rec("a", 1, "training", h="bb"), rec("b", 0, "averaging", h="cc"))
    d = protocol.barrier(me(3, "aa"), scattered, now=0, deadline=10)
    assert d.state == BarrierState.WAIT and d.waiting_for == ["a", "b"]
    # Not a peer that loads someone's state (it does not train up to ours), nor a paused one.
    idle = table(rec("l", 0, "loading", h=""), rec("p", 0, "paused", h="ee"))
    d = protocol.barrier(me(3, "aa"), {**scattered, **idle}, now=0, deadline=10)
    assert d.waiting_for == ["a", "b"]
    # A peer whose groupmate holds its params waits only for its own round and the one before (the others
    # behind load that state: it is credible).
    held = {**scattered, "g": rec("g", 3, "averaging", h="aa")}
    d = protocol.barrier(me(3, "aa"), held, now=0, deadline=10)
    assert d.state == BarrierState.GO and [r.peer_id for r in d.ready] == ["g"]
    # Nor one further behind than LONE_WAITS_BEHIND rounds (meeting it would cost as many rounds of waiting).
    at = 30
    far = table(rec("a", at - 2, h="bb"), rec("f", at - protocol.LONE_WAITS_BEHIND - 1, h="ee"))
    assert protocol.barrier(me(at, "aa"), far, now=0, deadline=10).waiting_for == ["a"]
    # A peer waited out (hung: its record has not moved since) is not waited for, lone or not.
    d = protocol.barrier(me(3, "aa"), scattered, now=0, deadline=10, not_waited={"b"})
    assert d.waiting_for == ["a"]


def test_a_lone_peer_whose_barrier_found_nobody_ready_waits_on():
    scattered = table(rec("a", 1, "training", h="bb"), rec("b", 0, "averaging", h="cc"))
    timed_out = protocol.barrier(me(3, "aa"), scattered, now=10, deadline=10)
    assert timed_out.state == BarrierState.GO and timed_out.timed_out and not timed_out.ready
    assert protocol.waits_on(me(3, "aa"), scattered, timed_out)
    # Then, timeout after timeout, as long as one of them came a round closer since the last: a record
    # that only pretends to train (its samples move, its round does not) holds us no longer.
    since = {pid: r.round for pid, r in scattered.items()}
    assert not protocol.waits_on(me(3, "aa"), scattered, timed_out, since)
    busy = {**scattered, "a": scattered["a"].copy(update={"samples_round": 16})}
    assert not protocol.waits_on(me(3, "aa"), busy, timed_out, since)
    closer = {**scattered, "b": scattered["b"].copy(update={"round": 1})}
    assert protocol.waits_on(me(3, "aa"), closer, timed_out, since)
    # Someone was ready: go with it. Not lone: step alone (the others behind can load our state).
    with_one = {**scattered, "r": rec("r", 3, "averaging", h="dd")}
    assert not protocol.waits_on(
        me(3, "aa"), with_one, protocol.barrier(me(3, "aa"), with_one, now=10, deadline=10)
    )
    held = table(rec("a", 3, "training", h="aa"), rec("b", 3, "training", h="aa"))
    assert not protocol.waits_on(me(3, "aa"), held, protocol.barrier(me(3, "aa"), held, now=10, deadline=10))
    assert not protocol.waits_on(
        me(3, "aa"), scattered, protocol.barrier(me(3, "aa"), scattered, now=0, deadline=10)
    )


def test_a_peer_waited_out_when_nobody_was_ready_is_waited_for_again_once_it_moves():
    # A barrier that found nobody ready cannot tell hung peers from being cut off from them. A split timed
    # out every barrier at once: had each peer skipped every other for 16 rounds, each averaged alone.
    memory = SwarmMemory(num_rounds=100)
    stuck = table(rec("a", 3, "training"), rec("b", 2, "training"), rec("c", 2, "training"))
    seen = {pid: protocol.progress_of(r) for pid, r in stuck.items()}
    memory.waited_out_on(["a", "b", "c"], round=3, nobody_ready=seen)
    memory.observe(stuck, my_round=4)
    assert memory.waited_out(4) == {"a", "b", "c"}  # as they were: hung, or we are still cut off
    trains = stuck["c"].copy(update={"samples_round": 8})  # its heartbeat: it trains, slowly
    memory.observe(table(rec("a", 3, "averaging"), stuck["b"], trains), my_round=4)
    assert memory.waited_out(4) == {"b"}  # a finished its round, c trains: they move
    memory.observe(table(rec("a", 5, "training"), rec("b", 2, "training")), my_round=5)
    assert memory.waited_out(5) == {"b"}
    # Waited out beside a peer that was ready: a slow or hung peer, whatever it does next.
    memory.waited_out_on(["a"], round=5)
    memory.observe(table(rec("a", 6, "averaging")), my_round=5)
    assert memory.waited_out(5) == {"a", "b"}
    # A later mark of the usual kind replaces a cut-off one, and averaging with a peer clears both.
    memory.waited_out_on(["b"], round=6)
    memory.observe(table(rec("b", 7, "averaging")), my_round=7)
    assert memory.waited_out(7) == {"a", "b"}
    memory.averaged_with(["a", "b"])
    assert memory.waited_out(7) == set()


def test_barrier_deadline_goes_with_whoever_is_ready():
    others = table(rec("a", 3, "averaging"), rec("b", 3, "training"))
    decision = protocol.barrier(me(), others, now=10.0, deadline=10.0)
    assert decision.state == BarrierState.GO and decision.timed_out
    assert [r.peer_id for r in decision.ready] == ["a"] and decision.waiting_for == ["b"]


def ready(peer, *group, round=3):
    """A record of ``peer`` past its barrier of ``round``, saying it goes with ``group`` (empty: not said yet)."""
    return rec(peer, round, "averaging").copy(update={"group": sorted(group)})


def test_a_peer_one_barrier_found_ready_and_another_did_not_is_in_both_groups():
    # "l" turned ready between a's barrier and b's (b did not wait for it: paused a moment before, or timed
    # out on in an earlier round). a saw it; b did not. Alone, each would name its own leader.
    mine = ["a", "me"]  # we are b
    others = table(ready("a", "a", "l", "me"), ready("l", "a", "l", "me"))
    settled = protocol.settle("me", 3, mine, others, timed_out=False)
    assert settled.done and settled.group == ["a", "l", "me"]
    # Ours named it from the start: the same group.
    assert protocol.settle("me", 3, ["a", "l", "me"], others, timed_out=False).group == ["a", "l", "me"]
    # Transitively: a names c, c names l.
    chain = table(
        ready("a", "a", "c", "me"), ready("c", "a", "c", "l", "me"), ready("l", "a", "c", "l", "me")
    )
    assert protocol.settle("me", 3, ["a", "me"], chain, timed_out=False).group == ["a", "c", "l", "me"]


def test_the_group_waits_for_every_member_to_say_whom_it_goes_with():
    # a has not said yet: it may name a peer we did not see ready.
    others = table(ready("a"), ready("l", "a", "l", "me"))
    settled = protocol.settle("me", 3, ["a", "me"], others, timed_out=False)
    assert not settled.done and settled.waiting_for == ["a"]
    # A peer named by a member that is not ready yet (our records lag behind the member's) is waited for.
    lagging = table(ready("a", "a", "l", "me"), rec("l", 3, "training"))
    settled = protocol.settle("me", 3, ["a", "me"], lagging, timed_out=False)
    assert not settled.done and settled.waiting_for == ["l"]
    # Out of time: a member that is ready and never said stays in (someone saw it ready); one that never got
    # ready is left out, and so is one that cannot get ready in our round (past it, gone), without a wait.
    settled = protocol.settle("me", 3, ["a", "me"], others, timed_out=True)
    assert settled.done and settled.group == ["a", "me"] and settled.waiting_for == ["a"]
    settled = protocol.settle("me", 3, ["a", "me"], lagging, timed_out=True)
    assert settled.done and settled.group == ["a", "me"]
    for gone in (rec("l", 4, "training"), rec("l", 3, "left")):
        settled = protocol.settle(
            "me", 3, ["a", "me"], table(ready("a", "a", "l", "me"), gone), timed_out=False
        )
        assert settled.done and settled.group == ["a", "me"] and settled.waiting_for == []
    # One we waited for in vain lately costs no second wait: in, unheard.
    settled = protocol.settle("me", 3, ["a", "me"], others, timed_out=False, not_waited={"a"})
    assert settled.done and settled.group == ["a", "me"]
    # A group said for another round (a record that moved on) is not this round's.
    moved = table(ready("a", "a", "l", "me", round=2), ready("l", "a", "l", "me"))
    assert protocol.settle("me", 3, ["a", "me"], moved, timed_out=True).group == ["me"]


def test_a_peer_that_turned_ready_after_everyone_passed_names_a_larger_group_alone():
    # Nobody saw "l" ready: everyone else settles without it (only its own attempt may fail).
    others = table(ready("a", "a", "me"), ready("l", "a", "l", "me"))
    assert protocol.settle("me", 3, ["a", "me"], others, timed_out=False).group == ["a", "me"]
    assert protocol.settle(
        "l", 3, ["a", "l", "me"], table(ready("a", "a", "me"), ready("me", "a", "me")), timed_out=False
    ).group == ["a", "l", "me"]


def test_unsaid_peers_are_not_waited_for_again_for_a_while():
    memory = SwarmMemory(num_rounds=100)
    memory.unsaid_on(["h"], 5)
    assert memory.unsaid(5) == {"h"} and memory.unsaid(5 + SwarmMemory.WAITED_OUT_ROUNDS - 1) == {"h"}
    assert memory.unsaid(5 + SwarmMemory.WAITED_OUT_ROUNDS) == set()


def test_rebase_onto_the_majority_then_the_larger_group_then_the_smaller_hash():
    assert protocol.rebase_donors(me(h="aa"), [rec("a", h="aa"), rec("b", h="bb")]) is None
    assert protocol.rebase_donors(me(h="cc"), [rec("a", h="bb"), rec("b", h="bb")]) == ["a", "b"]
    assert protocol.rebase_donors(me(h="aa", group=1), [rec("a", h="bb", group=3)]) == ["a"]
    assert protocol.rebase_donors(me(h="bb", group=2), [rec("a", h="aa", group=2)]) == ["a"]
    assert protocol.rebase_donors(me(h="aa"), []) is None
    # Holders that serve are asked first (a client-mode one would only time out).
    holders = [rec("a", h="bb", serves=False), rec("b", h="bb"), rec("c", h="bb")]
    assert protocol.rebase_donors(me(h="cc"), holders) == ["b", "c", "a"]


def test_step_alone_only_while_nobody_is_past_our_round():
    assert protocol.may_step_alone(me(), table(rec("a", 3), rec("b", 2)))
    assert not protocol.may_step_alone(me(), table(rec("a", 4)))
    assert not protocol.may_step_alone(me(), table(rec("a", 4, state="done")))
    assert protocol.may_step_alone(me(), table(rec("a", 4, state="loading")))


def test_after_failed_attempts_search_again_only_for_groupmates_still_averaging_our_round():
    group = ["a", "b", "c", "d", "me"]
    others = table(
        rec("a", 3, state="averaging"),  # held up in an attempt of its own
        rec("b", 3, state="training"),  # not averaging (yet): not in an attempt
        rec("c", 2, state="averaging"),  # another round's
        rec("x", 3, state="averaging"),  # not in our group
    )  # d: no record (gone)
    assert protocol.still_averaging(me(), others, group) == ["a"]
    # Someone is past our round: its state exists, and we load it rather than search.
    assert protocol.still_averaging(me(), table(rec("a", 3, state="averaging"), rec("e", 4)), group) == []
    # Two clients cannot average with each other.
    client = rec("a", 3, state="averaging", serves=False)
    assert protocol.still_averaging(me(), table(client), group) == ["a"]
    assert protocol.still_averaging(replace(me(), serves=False), table(client), group) == []


# --- the end


def finished(*records, num_rounds=4):
    memory = SwarmMemory(num_rounds=num_rounds)
    memory.observe(table(*records))
    return memory


def test_a_finished_peer_stays_while_anyone_is_behind_loading_or_holds_other_params():
    done = rec("a", 4, "done", h="ff")
    assert protocol.linger(me(4, "ff"), table(done), finished(done)).state == LingerState.LEAVE
    assert protocol.linger(me(4, "ff"), {}, finished()).state == LingerState.LEAVE
    for other in (rec("b", 3, "training"), rec("b", 0, "loading"), rec("b", 4, "averaging")):
        decision = protocol.linger(me(4, "ff"), table(done, other), finished(done))
        assert decision.state == LingerState.STAY and decision.waiting_for == ["b"]
    # b finished with other params: we hold the canonical ones (larger group), and b must get them from us.
    b = rec("b", 4, "done", h="00", group=1)
    decision = protocol.linger(me(4, "ff", group=3), table(b), finished(b))
    assert decision.state == LingerState.STAY
    # a peer that left is nobody to wait for
    assert protocol.linger(me(4, "ff"), table(rec("c", 2, "left")), finished()).state == LingerState.LEAVE


def test_a_finished_peer_with_other_params_adopts_the_canonical_ones():
    a, b = rec("a", 4, "done", h="11"), rec("b", 4, "done", h="11")
    decision = protocol.linger(me(4, "ff"), table(a, b), finished(a, b))
    assert decision.state == LingerState.ADOPT and decision.donors == ["a", "b"]
    assert not protocol.final_verdict(me(4, "ff"), finished(a, b))
    assert protocol.final_params_hash(me(4, "ff"), finished(a, b)) == "11"


def test_final_states_of_peers_that_left_still_count():
    gone = rec("a", 4, "left", h="11", group=3)
    memory = finished(gone)
    decision = protocol.linger(me(4, "ff", group=1), {}, memory)
    assert decision.state == LingerState.ADOPT and decision.donors == []  # nobody left to get them from
    assert not protocol.final_verdict(me(4, "ff", group=1), memory)
    assert protocol.final_verdict(me(4, "11", group=1), memory)


def test_state_enum_values_are_the_wire_strings():
    assert [s.value for s in PeerState] == ["loading", "training", "averaging", "paused", "done", "left"]
    assert rec("a").wire()["state"] == "training"


def test_one_peer_of_a_group_evaluates_a_round_and_each_in_turn():
    group = ["p3", "p1", "p2"]
    for me in group:
        others = [p for p in group if p != me]
        assert {protocol.evaluator(me, others, r) for r in range(3)} == set(group)  # each in turn
        assert [protocol.evaluator(me, others, r) for r in range(6)] == ["p1", "p2", "p3"] * 2  # all agree
    assert protocol.evaluator("p9", [], 7) == "p9"  # stepped alone: its params are its own to evaluate


def test_with_eval_every_only_every_kth_round_is_evaluated_and_the_group_still_takes_turns():
    group = ["p3", "p1", "p2"]
    for me in group:
        others = [p for p in group if p != me]
        turns = [protocol.evaluator(me, others, r, every=3) for r in range(9)]
        assert turns == [None, None, "p1", None, None, "p2", None, None, "p3"]  # after rounds 2, 5, 8
    assert [protocol.evaluator("p9", [], r, every=2) for r in range(4)] == [None, "p9", None, "p9"]
