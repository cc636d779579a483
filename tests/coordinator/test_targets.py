"""expand(): pods -> one target per worker, with every gap an explicit not_registered target."""

from gpulens.capture.coordinator.targets import PodFacts, expand


def pod(name, base, lws=4, registered=None, url="http://a", node="n1"):
    return PodFacts(pod=name, node=node, local_world_size=lws, base_rank=base, agent_url=url,
                    registered_local_ranks=None if registered is None else frozenset(registered))


def test_a_pod_with_four_workers_is_four_targets_named_by_global_rank():
    targets, warnings = expand([pod("p1", 4)], world_size=8)
    mine = [t for t in targets if t.pod == "p1"]
    assert [(t.target_id, t.rank, t.local_rank) for t in mine] == [
        ("rank-4", 4, 0), ("rank-5", 5, 1), ("rank-6", 6, 2), ("rank-7", 7, 3)]
    assert all(t.registered for t in mine)


def test_a_worker_without_registration_is_a_not_registered_target_not_an_absence():
    targets, _ = expand([pod("p0", 0, registered={0, 1, 3})], world_size=4)
    assert len(targets) == 4
    missing = [t for t in targets if not t.registered]
    assert [(t.rank, t.pod) for t in missing] == [(2, "p0")]
    assert "registration" in missing[0].note


def test_ranks_no_pod_holds_are_not_registered_when_the_world_size_is_known():
    targets, _ = expand([pod("p0", 0, lws=2)], world_size=4)
    assert [(t.rank, t.registered, t.pod) for t in targets] == [(0, True, "p0"), (1, True, "p0"), (2, False, ""), (3, False, "")]


def test_a_pod_without_a_base_rank_gets_the_free_ranks_and_is_never_dispatched():
    targets, warnings = expand([pod("p0", 0, lws=2), pod("p1", None, lws=2)], world_size=4)
    p1 = [t for t in targets if t.pod == "p1"]
    assert [t.rank for t in p1] == [2, 3] and not any(t.registered for t in p1)
    assert "inferred" in p1[0].note and any("no base rank" in w for w in warnings)


def test_an_unscheduled_pod_has_no_agent_and_its_workers_are_not_registered():
    targets, _ = expand([pod("p0", 0, lws=2, url=None, node="")])
    assert [t.registered for t in targets] == [False, False]
    assert "not scheduled" in targets[0].note


def test_a_rank_claimed_twice_keeps_one_target_and_says_so():
    targets, warnings = expand([pod("a", 0, lws=2), pod("b", 1, lws=2)])
    assert [t.rank for t in targets] == [0, 1, 2]
    assert [t.pod for t in targets] == ["a", "a", "b"]
    assert any("claimed by both" in w for w in warnings)


def test_dispatchable_excludes_exactly_the_unregistered():
    from gpulens.capture.coordinator.targets import Snapshot
    targets, _ = expand([pod("p0", 0, lws=3, registered={1})])
    snap = Snapshot(targets, 3)
    assert [t.rank for t in snap.dispatchable] == [1]
