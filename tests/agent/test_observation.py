"""Observation: Kineto's final rename, never its .tmp; never starved by a big verification."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from gpulens.capture.agent.observation import Observer
from gpulens.capture.agent.verification import Expectation, verify_trace
from tests.agent.conftest import kineto_like_trace


@pytest.fixture
async def observer():
    o = Observer(interval_s=0.05)
    o.start()
    yield o
    await o.stop()


async def test_the_tmp_file_is_ignored_until_the_rename(tmp_path, observer):
    final = tmp_path / "rank-0_37.json"
    tmp = tmp_path / "rank-0_37.json.tmp"
    waiter = asyncio.create_task(observer.wait_for(str(final), 10))
    tmp.write_text('{"traceEvents": [')  # Kineto streaming into the .tmp
    for _ in range(10):
        observer.scan_once()
        await asyncio.sleep(0.05)
    assert not waiter.done()
    tmp.write_text('{"traceEvents": []}')
    os.rename(tmp, final)
    found = await waiter
    assert found.path == str(final) and found.size == final.stat().st_size


async def test_files_are_bound_by_their_exact_name(tmp_path, observer):
    """A file for another pid (a child Kineto matched through its ancestors) is not ours."""
    (tmp_path / "rank-0_99.json").write_text("{}")
    (tmp_path / "rank-1_37.json").write_text("{}")
    assert await observer.wait_for(str(tmp_path / "rank-0_37.json"), 0.5) is None
    (tmp_path / "rank-0_37.json").write_text("{}")
    assert (await observer.wait_for(str(tmp_path / "rank-0_37.json"), 5)).path.endswith("rank-0_37.json")


async def test_a_file_already_there_is_found_at_once(tmp_path, observer):
    (tmp_path / "x_1.json").write_text("{}")
    assert await observer.wait_for(str(tmp_path / "x_1.json"), 5) is not None


async def test_a_missing_folder_is_just_nothing_yet(tmp_path, observer):
    assert await observer.wait_for(str(tmp_path / "nope" / "x_1.json"), 0.3) is None


async def test_observation_is_not_starved_by_a_big_verification(tmp_path, observer):
    """The agent's arrangement: verification in a process pool, observation on the loop. A small
    file renamed into place while a big one verifies is observed before that verification ends."""
    now = time.time()
    big = kineto_like_trace(tmp_path / "big_1.json", pid=1, start=now, events_per_cat=150_000)
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(pool, abs, 1)  # worker up
        verifying = loop.run_in_executor(pool, verify_trace, str(big),
                                         Expectation(("cpu_op",), now - 60, now + 60, 1000, pid=1))
        small = tmp_path / "small_2.json"
        waiter = asyncio.create_task(observer.wait_for(str(small), 60))
        small.with_name(small.name + ".tmp").write_text("{}")
        os.rename(small.with_name(small.name + ".tmp"), small)
        found = await asyncio.wait_for(waiter, 60)
        assert found is not None
        assert not verifying.done(), "the big file verified first: make it bigger"
        assert (await verifying).event_count > 150_000
    finally:
        pool.shutdown()
