"""Local discovery: registration files (as the hook writes them) -> the frozen snapshot."""

import pytest

from gpulens.capture.coordinator import AgentUrls, DiscoveryError, LocalDiscovery

from .conftest import record, write_job, write_record


def discovery(registry, **kw):
    return LocalDiscovery(registry, job_id=kw.get("job", "train"), attempt=kw.get("attempt", 0),
                          namespace=kw.get("namespace", "ml"), agents=AgentUrls(template="http://{node}:9451"))


async def test_two_pods_of_two_workers_are_four_targets_on_their_nodes_agents(tmp_path):
    write_job(tmp_path, pods={"train-0": ("node-a", 0), "train-1": ("node-b", 2)}, local_world_size=2)
    snap = await discovery(tmp_path).snapshot()
    assert [(t.target_id, t.pod, t.agent_url) for t in snap.targets] == [
        ("rank-0", "train-0", "http://node-a:9451"), ("rank-1", "train-0", "http://node-a:9451"),
        ("rank-2", "train-1", "http://node-b:9451"), ("rank-3", "train-1", "http://node-b:9451")]
    assert snap.world_size == 4 and all(t.registered for t in snap.targets)


async def test_a_missing_worker_and_a_missing_pod_are_not_registered(tmp_path):
    # pod train-1 (ranks 2, 3) never registered at all; rank 1 of train-0 never registered
    for rank in (0,):
        write_record(tmp_path, record(rank=rank, local_rank=rank, world_size=4, local_world_size=2))
    snap = await discovery(tmp_path).snapshot()
    assert [(t.rank, t.registered) for t in snap.targets] == [(0, True), (1, False), (2, False), (3, False)]
    assert [t.rank for t in snap.dispatchable] == [0]


async def test_other_jobs_attempts_and_namespaces_are_not_targets(tmp_path):
    write_job(tmp_path, pods={"train-0": ("node-a", 0)}, local_world_size=2)
    write_job(tmp_path, pods={"x-0": ("node-a", 0)}, local_world_size=2, job="other")
    write_job(tmp_path, pods={"old-0": ("node-a", 0)}, local_world_size=2, attempt=1)
    write_job(tmp_path, pods={"ns-0": ("node-a", 0)}, local_world_size=2, namespace="elsewhere")
    snap = await discovery(tmp_path).snapshot()
    assert {t.pod for t in snap.targets} == {"train-0"}


async def test_bad_files_are_reported_and_do_not_stop_discovery(tmp_path):
    write_job(tmp_path, pods={"train-0": ("node-a", 0)}, local_world_size=2)
    (tmp_path / "garbage.json").write_text("{not json")
    (tmp_path / "wrong.json").write_text('{"schema_version": 1, "job_id": "train"}')
    snap = await discovery(tmp_path).snapshot()
    assert len(snap.targets) == 2
    assert any("garbage.json" in w for w in snap.warnings) and any("wrong.json" in w for w in snap.warnings)


async def test_no_records_means_the_capture_cannot_run(tmp_path):
    with pytest.raises(DiscoveryError, match="no registration records"):
        await discovery(tmp_path).snapshot()
    with pytest.raises(DiscoveryError):
        await discovery(tmp_path / "does-not-exist").snapshot()


async def test_a_restarted_worker_counts_once_with_its_newest_process(tmp_path):
    write_record(tmp_path, record(rank=0, local_rank=0, world_size=1, local_world_size=1, pid=100, start_time=10.0))
    write_record(tmp_path, record(rank=0, local_rank=0, world_size=1, local_world_size=1, pid=200, start_time=20.0))
    snap = await discovery(tmp_path).snapshot()
    assert [t.target_id for t in snap.targets] == ["rank-0"]
