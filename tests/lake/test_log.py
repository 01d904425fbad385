"""Following a table's commits from its log files gives the files delta-rs lists at each version."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pyarrow.fs as pafs
from deltalake.fs import DeltaStorageHandler

from sao.lake.config import WriterConfig
from sao.lake.log import Commit, commit_path, commits_after, parse_commit
from sao.lake.maintenance import compact
from sao.lake.synthetic import make_trajectories
from sao.lake.writer import TrajectoryWriter
from tests.lake.conftest import RUN, register_versions


def storage(lake) -> pafs.PyFileSystem:
    return pafs.PyFileSystem(DeltaStorageHandler(lake.table_uri("trajectories"), lake.storage_options))


def listed(lake, version: int) -> set[str]:
    """The data files delta-rs lists at ``version``."""
    return set(pa.table(lake.table("trajectories", version=version).get_add_actions(flatten=True))["path"].to_pylist())


def test_following_the_commits_gives_the_files_of_every_version(lake):
    register_versions(lake, "other-run")
    start = lake.version("trajectories")
    records = make_trajectories(9, seed=1, num_tokens=8)
    for part in (records[:3], [dataclasses.replace(r, run_id="other-run") for r in records[3:6]], records[6:]):
        with TrajectoryWriter(lake, WriterConfig(flush_rows=10_000, background_flush=False)) as writer:
            writer.add_many(part)
    compact(lake, ["trajectories"], run_id=RUN)
    newest = lake.version("trajectories")
    commits = commits_after(storage(lake), start)
    assert [c.version for c in commits] == list(range(start + 1, newest + 1))
    files = listed(lake, start)
    for commit in commits:
        files = (files - set(commit.removed)) | {path for path, _ in commit.added}
        assert files == listed(lake, commit.version), commit.version
    assert {partition["run_id"] for c in commits[:-1] for _, partition in c.added} == {RUN, "other-run"}
    assert len(commits[-1].removed) == 2 and len(commits[-1].added) == 1  # the run's two files, rewritten
    assert commits_after(storage(lake), newest) == []
    assert [c.version for c in commits_after(storage(lake), start, upto=start + 2)] == [start + 1, start + 2]


def test_a_commit_file_is_parsed_action_by_action_with_its_paths_unescaped():
    text = "\n".join([
        '{"commitInfo":{"operation":"OPTIMIZE"}}',
        '{"add":{"path":"run_id=a%20b/part-1.parquet","partitionValues":{"run_id":"a b"},"dataChange":false}}',
        '{"remove":{"path":"run_id=a%20b/part-0.parquet","dataChange":false}}',
        '{"add":{"path":"part-2.parquet","partitionValues":{}}}',
        "",
    ])
    assert parse_commit(7, text) == Commit(7, (("run_id=a b/part-1.parquet", {"run_id": "a b"}), ("part-2.parquet", {})),
                                     ("run_id=a b/part-0.parquet",))
    assert commit_path(12) == "_delta_log/00000000000000000012.json"
