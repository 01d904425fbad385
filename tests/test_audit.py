"""`sao lake check`: a clean run passes, and each kind of defect, built by hand, is found and named."""

from __future__ import annotations

import dataclasses
import datetime as dt
import shutil

import numpy as np
import pyarrow as pa
import pytest
from typer.testing import CliRunner

from sao.audit import FindingKind, check_run, length_bucket
from sao.cli import app
from sao.lake.commit import append_blind
from sao.lake.config import LakeConfig, WriterConfig
from sao.lake.issued import IssuedRollout, IssueLog, close_out_unresolved
from sao.lake.ledger import record_train_step, register_policy_version
from sao.lake.records import PolicyVersionRecord, TrainStepRecord, utc_now
from sao.lake.store import Lake
from sao.lake.synthetic import make_trajectories, make_trajectory
from sao.lake.writer import TrajectoryWriter
from sao.models.policy import load_policy
from sao.train.checkpoint import checkpoint_dir, weights_hash
from sao.train.config import TrainConfig, UpdateConfig
from sao.train.run_config import run_config_path, write_run_config
from schemas import train_steps, trajectories
from tests.lake.validate.test_rules import CASES

RUN = "run-c"
MANUAL = WriterConfig(flush_rows=10_000, background_flush=False)
runner = CliRunner()


@pytest.fixture(scope="module")
def policy_hash(policy_dir) -> str:
    return weights_hash(load_policy(policy_dir))


def register(lake: Lake, versions: int, uri: str, digest: str) -> None:
    for version in range(versions):
        register_policy_version(
            lake,
            PolicyVersionRecord(
                RUN, version, uri, digest, None if version == 0 else version - 1,
                None if version == 0 else version - 1,
            ),
        )  # fmt: skip


def issue(lake: Lake, ids: list[str]) -> None:
    log = IssueLog(lake, MANUAL, issuer_id="test-driver")
    log.add_many(IssuedRollout(RUN, i, f"task-{i}", "math_tool") for i in ids)
    log.flush()


def step(lake: Lake, number: int, before: int, ids: list[str]) -> None:
    now = utc_now()
    record_train_step(
        lake,
        TrainStepRecord(RUN, number, before, before + 1, lake.version("trajectories"), tuple(ids),
                        now, now),
    )  # fmt: skip


def forced_step(lake: Lake, number: int, before: int, ids: list[str]) -> None:
    """A train_steps row appended behind the ledger's back (what a buggy trainer could leave)."""
    now = utc_now()
    record = TrainStepRecord(RUN, number, before, before + 1, lake.version("trajectories"),
                             tuple(ids), now, now)  # fmt: skip
    row = record.to_row() | {"recorded_at": now, "schema_version": train_steps.SCHEMA_VERSION}
    append_blind(lake, train_steps.NAME, pa.Table.from_pylist([row], schema=train_steps.SCHEMA))


@dataclasses.dataclass
class Run:
    lake: Lake
    ids: list[str]  # stored, in ingest order
    bad_id: str  # quarantined


@pytest.fixture
def clean(tmp_path, policy_dir, policy_hash) -> Run:
    """Run ``run-c``: versions 0-2 (real policy directory), run_config.json with max_staleness 1,
    8 rollouts issued, 7 stored and 1 quarantined, two steps consuming the oldest 4 in order."""
    lake = Lake.open(LakeConfig(root=str(tmp_path / "lake")))
    checkpoint = checkpoint_dir(tmp_path / "ckpt", 0)
    shutil.copytree(policy_dir, checkpoint)
    register(lake, 3, str(checkpoint), policy_hash)
    write_run_config(TrainConfig(run_id=RUN, lake=LakeConfig(root=str(tmp_path / "lake")), checkpoint_root=str(tmp_path / "ckpt"),
                                 policy_path=str(policy_dir), max_staleness=1))
    records = make_trajectories(7, seed=3, run_id=RUN, num_tokens=20, policy_versions=(1,))
    bad = dataclasses.replace(CASES["logprob_positive"][0], run_id=RUN, trajectory_id="bad-0")
    ids = [r.trajectory_id for r in records]
    issue(lake, [*ids, bad.trajectory_id])
    with TrajectoryWriter(lake, MANUAL) as writer:
        writer.add_many([*records[:3], bad, *records[3:]])
    step(lake, 0, 1, ids[:2])
    step(lake, 1, 2, ids[2:4])
    return Run(lake, ids, bad.trajectory_id)


def test_a_clean_run_passes_and_counts_everything(clean):
    report = check_run(clean.lake, RUN)
    assert report.ok, report.lines()
    assert (report.issued, report.stored, report.quarantined) == (8, 7, 1)
    assert report.by_reason == {"stop": 7} and report.quarantined_by_rule == {"logprob_positive": 1}
    assert (report.steps, report.consumed, report.policy_versions) == (2, 4, 3)
    assert report.checkpoints_verified == 3 and report.max_staleness == 1
    assert report.backlog.count == 0 and report.backlog.eligible == 3
    assert report.lines()[-1] == "OK: every row accounted for"


def test_the_cli_exits_0_when_clean_1_with_findings_2_for_bad_arguments(clean):
    root = ["--lake", clean.lake.root]
    ok = runner.invoke(app, ["lake", "check", "--run", RUN, *root])
    assert ok.exit_code == 0, ok.output
    assert "issued rollouts: 8" in ok.stdout and "OK: every row accounted for" in ok.stdout
    issue(clean.lake, ["vanished"])
    bad = runner.invoke(app, ["lake", "check", "--run", RUN, "--no-checkpoints", *root])
    assert bad.exit_code == 1
    assert "FINDING lost: 1" in bad.stdout and "vanished" in bad.stdout
    unknown = runner.invoke(app, ["lake", "check", "--run", "nobody", *root])
    assert unknown.exit_code == 2 and "no row in any table" in unknown.stderr
    invalid = runner.invoke(app, ["lake", "check", "--run", "../etc", *root])
    assert invalid.exit_code == 2 and "not a valid run id" in invalid.stderr
    assert "Traceback" not in unknown.output + invalid.output


def test_a_lost_rollout_is_found(clean):
    issue(clean.lake, ["lost-1", "lost-2"])
    report = check_run(clean.lake, RUN, verify_checkpoints=False)
    (finding,) = report.findings
    assert finding.kind is FindingKind.LOST and finding.examples == ("lost-1", "lost-2")


def test_rollouts_in_flight_at_a_crash_are_closed_out_on_resume_and_reported_as_information(clean):
    issue(clean.lake, ["in-flight-1", "in-flight-2"])  # launched; the driver died before they were stored
    assert check_run(clean.lake, RUN, verify_checkpoints=False).kinds() == {FindingKind.LOST}
    relaunch = close_out_unresolved(clean.lake, RUN, "resumed-driver")
    assert [r.trajectory_id for r in relaunch] == ["in-flight-1", "in-flight-2"]
    assert all(r.event == "issued" and r.attempt == 0 for r in relaunch)  # the launches to repeat
    events = clean.lake.read("rollout_tasks", predicate="event = 'abandoned'").to_pylist()
    assert sorted(e["trajectory_id"] for e in events) == ["in-flight-1", "in-flight-2"]
    assert all(e["reason"].startswith("in flight when the run") and e["issuer_id"] == "resumed-driver"
               for e in events)
    report = check_run(clean.lake, RUN, verify_checkpoints=False)
    assert report.ok, report.lines()
    assert report.abandoned == 2 and report.issued == 10
    assert "issued rollouts: 10 (2 in flight at a crash, closed out on resume)" in report.lines()
    # A second resume that died before relaunching: the same launches are offered again, nothing new
    # is closed out; once a retry names them, they are done.
    assert [r.trajectory_id for r in close_out_unresolved(clean.lake, RUN, "again")] == ["in-flight-1", "in-flight-2"]
    assert len(clean.lake.read("rollout_tasks", predicate="event = 'abandoned'")) == 2
    log = IssueLog(clean.lake, MANUAL, issuer_id="resumed-driver")
    log.add_many([IssuedRollout(RUN, "retry-1", "task-in-flight-1", "math_tool", 1, "in-flight-1")])
    log.flush()
    assert [r.trajectory_id for r in close_out_unresolved(clean.lake, RUN, "again")] == ["in-flight-2", "retry-1"]


def test_a_closed_out_rollout_that_was_stored_after_all_is_a_finding(clean):
    log = IssueLog(clean.lake, MANUAL, issuer_id="resumed-driver")
    log.add_many([IssuedRollout(RUN, clean.ids[6], "task", "math_tool", event="abandoned", reason="test")])
    log.flush()
    report = check_run(clean.lake, RUN, verify_checkpoints=False)
    (finding,) = report.findings
    assert finding.kind is FindingKind.ABANDONED_RESOLVED and finding.examples == (clean.ids[6],)


def test_an_unknown_issue_event_is_refused():
    with pytest.raises(ValueError, match="event must be one of"):
        IssuedRollout(RUN, "t", "task", "env", event="vanished")


def test_a_duplicate_row_and_a_duplicate_issue_are_found(clean):
    row = clean.lake.read("trajectories", predicate=f"trajectory_id = '{clean.ids[5]}'")
    append_blind(clean.lake, trajectories.NAME, row)  # bypasses the writer's exactly-once plan
    issue(clean.lake, [clean.ids[6]])
    report = check_run(clean.lake, RUN, verify_checkpoints=False)
    assert report.kinds() == {FindingKind.DUPLICATE_TRAJECTORY, FindingKind.DUPLICATE_ISSUE}


def test_a_stored_row_nobody_issued_is_found(clean):
    with TrajectoryWriter(clean.lake, MANUAL) as writer:
        writer.add_many(make_trajectories(1, seed=9, run_id=RUN, num_tokens=20, policy_versions=(2,)))
    assert check_run(clean.lake, RUN, verify_checkpoints=False).kinds() == {FindingKind.NOT_ISSUED}


def test_double_consumption_and_a_missing_consumed_id_are_found(clean):
    forced_step(clean.lake, 2, 2, [clean.ids[0], "never-stored"])
    report = check_run(clean.lake, RUN, verify_checkpoints=False)
    assert report.kinds() == {FindingKind.CONSUMED_TWICE, FindingKind.CONSUMED_MISSING}
    by_kind = {f.kind: f for f in report.findings}
    assert by_kind[FindingKind.CONSUMED_TWICE].examples == (clean.ids[0],)
    assert by_kind[FindingKind.CONSUMED_MISSING].examples == ("never-stored",)


def test_a_staleness_violation_is_found(clean):
    step(clean.lake, 2, 3, clean.ids[4:6])  # sampled by version 1, consumed at 3: staleness 2 > 1
    report = check_run(clean.lake, RUN, verify_checkpoints=False)
    (finding,) = report.findings
    assert finding.kind is FindingKind.CONSUMED_STALE and finding.count == 2
    assert "staleness 2" in finding.examples[0]
    assert check_run(clean.lake, RUN, max_staleness=2, verify_checkpoints=False).ok


def test_a_skipped_eligible_trajectory_is_found(clean):
    step(clean.lake, 2, 2, clean.ids[5:7])  # ids[4] arrived first and was eligible: skipped
    report = check_run(clean.lake, RUN, verify_checkpoints=False)
    (finding,) = report.findings
    assert finding.kind is FindingKind.SKIPPED and finding.examples == (clean.ids[4],)


def test_without_a_staleness_bound_skips_are_not_judged(clean, tmp_path):
    # No run configuration and no --max-staleness: every row would count as eligible at every step,
    # so rows a trainer rightly passed over (stale, cut short) would be reported as skipped.
    run_config_path(tmp_path / "ckpt").unlink()
    step(clean.lake, 2, 2, clean.ids[5:7])  # with the bound 1 (above), ids[4] is a skip
    report = check_run(clean.lake, RUN, verify_checkpoints=False)
    assert report.ok, report.lines()
    assert any("skipped rows and the stale backlog are not checked" in note for note in report.notes)
    assert check_run(clean.lake, RUN, max_staleness=1, verify_checkpoints=False).kinds() == {FindingKind.SKIPPED}


def test_a_vacuum_is_not_a_deletion(clean):
    from sao.lake.maintenance import compact, vacuum

    for seed in (11, 12):  # two small files no recorded step read, which compaction then replaces
        more = make_trajectories(2, seed=seed, run_id=RUN, num_tokens=20, policy_versions=(2,))
        issue(clean.lake, [r.trajectory_id for r in more])
        with TrajectoryWriter(clean.lake, MANUAL) as writer:
            writer.add_many(more)
    compact(clean.lake, ["trajectories"])
    assert vacuum(clean.lake, ["trajectories"], retention_hours=0, force=True)[0].removed  # logs VACUUM START / END
    assert {e["operation"] for e in clean.lake.table("trajectories").history()} >= {"VACUUM START", "VACUUM END"}
    report = check_run(clean.lake, RUN, verify_checkpoints=False)
    assert report.ok, report.lines()


@pytest.mark.parametrize("passed_over", [True, False])
def test_an_end_the_run_passes_over_is_never_eligible_so_never_skipped(clean, tmp_path, policy_dir, passed_over):
    """A stored ``error`` end between consumed rows: with the run's default ``skip_reasons`` the trainer
    passes over it by design (a note, no finding); a run that trains on such ends has skipped it."""
    if not passed_over:
        run_config_path(tmp_path / "ckpt").unlink()
        write_run_config(TrainConfig(run_id=RUN, lake=LakeConfig(root=str(tmp_path / "lake")),
                                     checkpoint_root=str(tmp_path / "ckpt"), policy_path=str(policy_dir),
                                     max_staleness=1, update=UpdateConfig(skip_reasons=[])))
    (cut,) = make_trajectories(1, seed=9, run_id=RUN, num_tokens=20, policy_versions=(1,))
    cut = dataclasses.replace(cut, termination_reason="error", error="RuntimeError: replica died")
    issue(clean.lake, [cut.trajectory_id])
    with TrajectoryWriter(clean.lake, MANUAL) as writer:
        writer.add_many([cut])
    later = make_trajectories(2, seed=10, run_id=RUN, num_tokens=20, policy_versions=(2,))
    issue(clean.lake, [r.trajectory_id for r in later])
    with TrajectoryWriter(clean.lake, MANUAL) as writer:
        writer.add_many(later)
    step(clean.lake, 2, 2, [*clean.ids[4:7], *(r.trajectory_id for r in later)])
    report = check_run(clean.lake, RUN, verify_checkpoints=False)
    if passed_over:
        assert report.ok, report.lines()
        assert any("1 stored trajectories end in cancelled, error" in note for note in report.notes)
        assert report.backlog.count == 0
    else:
        (finding,) = report.findings
        assert finding.kind is FindingKind.SKIPPED and finding.examples == (cut.trajectory_id,)


def test_deleting_trajectories_is_found(clean):
    clean.lake.table("trajectories").delete(f"trajectory_id = '{clean.ids[6]}'")
    report = check_run(clean.lake, RUN, verify_checkpoints=False)
    assert report.kinds() == {FindingKind.DELETED, FindingKind.LOST}


def test_a_missing_checkpoint_and_a_wrong_hash_are_found(clean, tmp_path, policy_dir):
    register_policy_version(clean.lake, PolicyVersionRecord(RUN, 3, str(tmp_path / "gone"), "x", 2, 2))
    register_policy_version(clean.lake, PolicyVersionRecord(RUN, 4, str(policy_dir), "sha-wrong", 3, 3))
    report = check_run(clean.lake, RUN)
    assert report.kinds() == {FindingKind.CHECKPOINT_MISSING, FindingKind.CHECKPOINT_HASH}
    by_kind = {f.kind: f for f in report.findings}
    assert by_kind[FindingKind.CHECKPOINT_MISSING].examples[0].startswith("v3 at ")
    assert by_kind[FindingKind.CHECKPOINT_HASH].examples[0].startswith("v4 at ")
    assert report.checkpoints_verified == 4


def test_an_incomplete_checkpoint_is_missing(clean, tmp_path, policy_dir):
    version_dir = tmp_path / "ckpt" / "v000003"
    shutil.copytree(policy_dir, version_dir / "policy")  # a save interrupted before COMPLETE
    register_policy_version(clean.lake, PolicyVersionRecord(RUN, 3, str(version_dir), "x", 2, 2))
    (finding,) = check_run(clean.lake, RUN).findings
    assert finding.kind is FindingKind.CHECKPOINT_MISSING and "incomplete" in finding.examples[0]


def test_the_stale_backlog_is_counted_by_length(tmp_path):
    lake = Lake.open(LakeConfig(root=str(tmp_path / "lake")))
    register(lake, 6, "mem://none", "h")
    rng = np.random.default_rng(0)
    old = [make_trajectory(rng, run_id=RUN, num_tokens=n, policy_versions=(0,)) for n in (40, 100, 3000, 120)]
    fresh = [make_trajectory(rng, run_id=RUN, num_tokens=30, policy_versions=(4,)) for _ in range(2)]
    with TrajectoryWriter(lake, MANUAL) as writer:
        writer.add_many(old + fresh)
    report = check_run(lake, RUN, max_staleness=2, verify_checkpoints=False)
    assert report.ok, report.lines()
    backlog = report.backlog
    assert (backlog.trainer_version, backlog.count, backlog.eligible) == (5, 4, 2)
    assert backlog.by_length == {"33-64": 1, "65-128": 2, "2049-4096": 1}
    assert "stale backlog at version 5: 4 kept, not trained on" in "\n".join(report.lines())


def test_length_buckets_are_the_trainers():
    """The trainer's edges (16, 32, ..., 4096; its kept-fraction metrics use them), inclusive above."""
    assert [length_bucket(n) for n in (0, 1, 16, 17, 64, 65, 128, 2048, 2049, 4096, 4097)] == [
        "0", "1-16", "1-16", "17-32", "33-64", "65-128", "65-128", "1025-2048", "2049-4096", "2049-4096", ">4096",
    ]  # fmt: skip


def test_issue_log_batches_and_flushes(tmp_path):
    lake = Lake.open(LakeConfig(root=str(tmp_path / "lake")))
    log = IssueLog(lake, WriterConfig(flush_rows=3, flush_seconds=60, background_flush=False))
    stamp = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    log.add_many(IssuedRollout(RUN, f"t{i}", "task", "env", issued_at=stamp) for i in range(2))
    assert log.buffered == 2 and lake.read("rollout_tasks").num_rows == 0
    log.add_many([IssuedRollout(RUN, "t2", "task", "env", attempt=1, retry_of="t0")])
    assert log.buffered == 0 and log.written == 3
    rows = lake.read("rollout_tasks").sort_by("trajectory_id").to_pylist()
    assert [r["retry_of"] for r in rows] == [None, None, "t0"] and rows[0]["issued_at"] == stamp


def test_issue_log_commits_before_a_record_only_the_launches_it_still_holds(tmp_path):
    """A trajectory commit asks for its records' launches: the buffer is committed if it holds one of
    them (or the ids are unknown), and otherwise left to its own flush."""
    lake = Lake.open(LakeConfig(root=str(tmp_path / "lake")))
    log = IssueLog(lake, WriterConfig(flush_rows=10, flush_seconds=60, background_flush=False))
    log.add_many(IssuedRollout(RUN, f"t{i}", "task", "env") for i in range(2))
    assert log.flush_for({"elsewhere"}) == 0 and log.buffered == 2
    assert log.flush_for({"t1", "elsewhere"}) == 2 and lake.read("rollout_tasks").num_rows == 2
    log.add_many([IssuedRollout(RUN, "t2", "task", "env")])
    assert log.flush_for(None) == 1 and log.flush_for(None) == 0
    assert lake.read("rollout_tasks").num_rows == 3


def test_the_parts_of_a_split_episode_are_accounted_for_under_its_issued_id(tmp_path):
    """An agent that rewrote its history: one issued rollout, stored as parts 0 and 1 (``<id>.1``); the
    report counts the split, finds nothing; a later part whose first part is missing is a finding."""
    lake = Lake.open(LakeConfig(root=str(tmp_path / "lake")))
    register(lake, 2, "mem://v", "h")
    first, second, orphan = make_trajectories(3, seed=5, run_id=RUN, num_tokens=12, policy_versions=(1,))
    parts = [dataclasses.replace(first, trajectory_id="ep", episode_id="ep", episode_part=0),
             dataclasses.replace(second, trajectory_id="ep.1", episode_id="ep", episode_part=1)]
    issue(lake, ["ep"])
    with TrajectoryWriter(lake, MANUAL) as writer:
        writer.add_many(parts)
    report = check_run(lake, RUN, max_staleness=1, verify_checkpoints=False)
    assert report.ok, report.lines()
    assert (report.issued, report.stored, report.episode_splits) == (1, 2, 1)
    assert "1 of them later parts of agent episodes split" in report.lines()[2]

    lost = dataclasses.replace(orphan, trajectory_id="gone.1", episode_id="gone", episode_part=1)
    with TrajectoryWriter(lake, MANUAL) as writer:
        writer.add_many([lost])
    report = check_run(lake, RUN, max_staleness=1, verify_checkpoints=False)
    assert [f.kind for f in report.findings] == [FindingKind.NOT_ISSUED]
    assert "gone.1" in str(report.findings[0]) and "episode was never issued" in str(report.findings[0])
