"""The run audit: every issued rollout, stored row, consumed id and checkpoint of one run accounted for.

It sits above the lake and the trainer: it reads the lake's tables, asks the checkpoint module
(:func:`sao.train.checkpoint.verify_registered`) about each registered version and the stored run
configuration (:func:`sao.train.run_config.stored_run_config`) about the staleness bound and the ends the
trainer passes over (``UpdateConfig.skip_reasons``); it knows neither layout.

:func:`check_run` (``sao lake check --run R``) reads the run's rows of every table and reports, as
:class:`Finding` objects, each way in which the run lost, doubled or misused data:

Issued rollouts (``rollout_tasks``, written by the driver's :class:`~sao.lake.issued.IssueLog`):
    ``lost``                 issued, but neither a ``trajectories`` row nor a ``quarantine`` row exists;
    ``stored_and_quarantined`` issued once, ended both stored and quarantined;
    ``duplicate_issue``      one ``trajectory_id`` issued twice;
    ``not_issued``           stored, but never issued (only when the run has an issue log); the later
                             parts of a split agent episode are issued under their ``episode_id``;
    ``abandoned_resolved``   closed out as abandoned on a resume, yet stored or quarantined as well.
    A launch that was in flight when the run's driver process died, and that the resume closed out as
    ``abandoned`` (:func:`sao.lake.issued.close_out_unresolved`), is information, not a finding: the
    report counts it as "in flight at a crash, closed out on resume".
Stored rows and consumption (``trajectories``, ``train_steps``):
    ``duplicate_trajectory`` one ``trajectory_id`` stored twice in the run;
    ``deleted``              a commit removed or rewrote trajectory rows (only appends and compaction
                             are expected: stale rows are kept, never deleted);
    ``consumed_twice``       an id listed by two steps, or twice by one;
    ``consumed_missing``     a consumed id absent from ``trajectories``;
    ``consumed_stale``       consumed beyond ``max_staleness`` at its step (``policy_version_before -
                             min_policy_version``), or consumed without an action token;
    ``skipped``              never consumed, although a step took a later-arriving row of the run while
                             it was eligible (the reader hands rows out oldest ``ingest_seq`` first, so an
                             eligible older row must have been taken first); a row whose end the run's
                             ``skip_reasons`` names is never eligible.
A what-if replay (``sao replay --set``) is a run whose steps read another run's trajectories
(``train_steps.data_run_id``): its consumption is checked against that run's stored rows, and
    ``what_if_data``         a step that did not read what the parent's step of the same number read
                             (other ids, or another snapshot);
issued rollouts, skips and the stale backlog are the parent's to account for (``--run <parent>``).
Checkpoints (``policy_versions``):
    ``checkpoint_missing``   the checkpoint a row names is absent or incomplete (a policy that retention
                             pruned on purpose is a note, not a finding);
    ``checkpoint_hash``      the weights there hash to something else than the row says.

Beside findings, the report carries counts (issued, stored by termination reason, quarantined by rule,
consumed) and the **stale backlog**: unconsumed rows with an action token that are beyond
``max_staleness`` at the run's newest policy version. They are kept and never trained on; the report
counts them by completion-length bucket, so a backlog that is biased towards long (slow) rollouts is
visible.

Where ``max_staleness`` comes from: the ``max_staleness`` argument, else the run configuration the
trainer stored beside its checkpoints (found through the ``policy_versions`` rows). Without either,
staleness is not checked and the report says so. Completion lengths are bucketed by the trainer's
:data:`sao.train.step.LENGTH_BUCKETS`, the edges of its ``actor/kept_frac/length_*`` metrics.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import itertools
from collections import Counter
from collections.abc import Iterable, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from sao.lake.reader import read_trajectories
from sao.lake.store import Lake, LakeError, is_valid_run_id, sql_literal
from sao.train.checkpoint import RegisteredState, verify_registered
from sao.train.run_config import RunConfigError, stored_run_config
from sao.train.step import LENGTH_BUCKETS
from schemas import policy_versions, quarantine, rollout_tasks, train_steps, trajectories

__all__ = [
    "CheckReport",
    "Finding",
    "FindingKind",
    "StaleBacklog",
    "UnknownRunError",
    "check_run",
    "length_bucket",
    "stale_backlog",
]

_APPEND_OPERATIONS = frozenset({"CREATE TABLE", "WRITE", "OPTIMIZE", "ADD COLUMN", "SET TBLPROPERTIES",
                                "VACUUM START", "VACUUM END"})
"""Delta operations that never remove a trajectory (a vacuum deletes files no snapshot still needs,
never a row of one): anything else in the log is reported."""

_EXAMPLES = 5


class UnknownRunError(LakeError):
    """No table of the lake holds a row of the run."""


class FindingKind(enum.StrEnum):
    """What a finding says went wrong (see the module docstring)."""

    LOST = "lost"
    STORED_AND_QUARANTINED = "stored_and_quarantined"
    DUPLICATE_ISSUE = "duplicate_issue"
    NOT_ISSUED = "not_issued"
    ABANDONED_RESOLVED = "abandoned_resolved"
    DUPLICATE_TRAJECTORY = "duplicate_trajectory"
    DELETED = "deleted"
    CONSUMED_TWICE = "consumed_twice"
    CONSUMED_MISSING = "consumed_missing"
    CONSUMED_STALE = "consumed_stale"
    SKIPPED = "skipped"
    WHAT_IF_DATA = "what_if_data"
    CHECKPOINT_MISSING = "checkpoint_missing"
    CHECKPOINT_HASH = "checkpoint_hash"


@dataclasses.dataclass(frozen=True)
class Finding:
    """One defect: its kind, how many ids / steps / versions it covers, examples, and an explanation."""

    kind: FindingKind
    count: int
    examples: tuple[str, ...]
    message: str

    def __str__(self) -> str:
        shown = ", ".join(self.examples)
        return f"{self.kind}: {self.count} -- {self.message}" + (f" (e.g. {shown})" if shown else "")


@dataclasses.dataclass(frozen=True)
class StaleBacklog:
    """Unconsumed rows beyond ``max_staleness`` at ``trainer_version``: kept, not trained on.

    Attributes:
        trainer_version: the run's newest registered policy version.
        max_staleness: the bound applied.
        count: stale rows.
        by_length: completion-length bucket (``"65-128"``, ...) -> rows, in bucket order.
        eligible: unconsumed rows still within the bound (what a resumed trainer would take).
    """

    trainer_version: int
    max_staleness: int
    count: int
    by_length: dict[str, int]
    eligible: int


@dataclasses.dataclass(frozen=True)
class CheckReport:
    """The reconciliation of one run (:func:`check_run`); ``ok`` when there is no finding."""

    run_id: str
    issued: int | None
    stored: int
    episode_splits: int  # stored parts after the first of split agent episodes (history rewrites)
    abandoned: int
    by_reason: dict[str, int]
    quarantined: int
    quarantined_by_rule: dict[str, int]
    steps: int
    consumed: int
    policy_versions: int
    checkpoints_verified: int
    max_staleness: int | None
    backlog: StaleBacklog | None
    findings: tuple[Finding, ...]
    notes: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.findings

    def kinds(self) -> set[FindingKind]:
        return {f.kind for f in self.findings}

    def lines(self) -> list[str]:
        """The report as text (``sao lake check`` prints it)."""
        issued = "no issue log" if self.issued is None else str(self.issued)
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.by_reason.items())) or "-"
        rules = ", ".join(f"{k} {v}" for k, v in sorted(self.quarantined_by_rule.items())) or "-"
        out = [
            f"run {self.run_id}",
            f"issued rollouts: {issued}" + (f" ({self.abandoned} in flight at a crash, closed out on resume)"
                                             if self.abandoned else ""),
            f"stored trajectories: {self.stored} ({reasons})" + (
                f"; {self.episode_splits} of them later parts of agent episodes split where the agent rewrote "
                "its history" if self.episode_splits else ""),
            f"quarantined deliveries: {self.quarantined} ({rules})",
            f"steps: {self.steps}, consumed trajectories: {self.consumed}",
            f"policy versions: {self.policy_versions}, checkpoints verified: {self.checkpoints_verified}",
            "max_staleness: " + ("unknown (not checked)" if self.max_staleness is None else str(self.max_staleness)),
        ]
        if self.backlog is not None:
            b = self.backlog
            buckets = ", ".join(f"{k}: {v}" for k, v in b.by_length.items()) or "-"
            out.append(
                f"stale backlog at version {b.trainer_version}: {b.count} kept, not trained on "
                f"(by completion length: {buckets}); {b.eligible} unconsumed within the bound"
            )
        out += [f"note: {note}" for note in self.notes]
        out += [f"FINDING {finding}" for finding in self.findings] or ["OK: every row accounted for"]
        return out


def length_bucket(length: int) -> str:
    """The :data:`LENGTH_BUCKETS` label of a completion of ``length`` tokens (``"0"``, ``"1-16"``,
    ``"17-32"``, ..., ``">4096"``)."""
    if length <= 0:
        return "0"
    low = 1
    for edge in LENGTH_BUCKETS:
        if length <= edge:
            return f"{low}-{edge}"
        low = edge + 1
    return f">{LENGTH_BUCKETS[-1]}"


def _bucket_order() -> list[str]:
    labels, low = ["0"], 1
    for edge in LENGTH_BUCKETS:
        labels.append(f"{low}-{edge}")
        low = edge + 1
    return [*labels, f">{LENGTH_BUCKETS[-1]}"]


def _finding(kind: FindingKind, ids: Iterable[object], message: str) -> Finding | None:
    ids = list(ids)
    if not ids:
        return None
    return Finding(kind, len(ids), tuple(str(i) for i in ids[:_EXAMPLES]), message)


def _repeated(values: Iterable[str]) -> list[str]:
    return sorted(v for v, n in Counter(values).items() if n > 1)


def check_run(
    lake: Lake, run_id: str, *, max_staleness: int | None = None, verify_checkpoints: bool = True
) -> CheckReport:
    """Reconcile run ``run_id`` (see the module docstring); never modifies the lake.

    Args:
        max_staleness: the bound to check consumption against (default: the run's stored config).
        verify_checkpoints: load every registered version's policy and compare its weights hash.

    Raises:
        ValueError: ``run_id`` is not a valid run id.
        UnknownRunError: no table holds a row of the run.
    """
    if not is_valid_run_id(run_id):
        raise ValueError(f"run_id {run_id!r} is not a valid run id")
    stored = lake.read_run(trajectories.NAME, run_id,
        ["trajectory_id", "termination_reason", "min_policy_version", "ingest_seq", "episode_id", "episode_part"],
    )  # fmt: skip
    events = lake.read_run(rollout_tasks.NAME, run_id, ["trajectory_id", "event"])
    is_abandoned = pc.equal(events["event"], rollout_tasks.ABANDONED).fill_null(False)
    issued = events.filter(pc.invert(is_abandoned))
    abandoned = events.filter(is_abandoned)["trajectory_id"].to_pylist()
    bad = _quarantined(lake, run_id, set(issued["trajectory_id"].to_pylist()))
    steps = lake.read_run(train_steps.NAME, run_id,
        ["step", "policy_version_before", "trajectory_ids", "trajectories_version", "data_run_id"],
    )  # fmt: skip
    versions = lake.read_run(policy_versions.NAME, run_id, ["version", "checkpoint_uri", "weights_hash"]
    )
    if not any(t.num_rows for t in (stored, bad, issued, steps, versions)):
        raise UnknownRunError(f"run {run_id!r} has no row in any table of the lake at {lake.root}")
    notes: list[str] = []
    findings: list[Finding | None] = []
    stored_ids = stored["trajectory_id"].to_pylist()
    findings.append(_finding(FindingKind.DUPLICATE_TRAJECTORY, _repeated(stored_ids),
                             "stored more than once in the run"))  # fmt: skip
    findings.append(_deleted_rows(lake))
    later_parts = pc.greater(stored["episode_part"], 0).fill_null(False)
    episodes = set(stored.filter(pc.invert(later_parts))["trajectory_id"].to_pylist())
    parts_of = dict(zip(stored.filter(later_parts)["trajectory_id"].to_pylist(),
                        stored.filter(later_parts)["episode_id"].to_pylist(), strict=True))
    findings += _account_issued(issued["trajectory_id"].to_pylist(), episodes, bad, set(abandoned), notes)
    issued_ids = set(issued["trajectory_id"].to_pylist())
    if issued_ids:  # a later part is issued under its episode's id, as its first part is
        orphans = sorted(tid for tid, episode in parts_of.items() if episode not in issued_ids | episodes)
        findings.append(_finding(FindingKind.NOT_ISSUED, orphans,
                                 "a later part of a split episode whose episode was never issued"))
    stored_limit, passed_over = _stored_settings(versions, notes)
    limit = max_staleness if max_staleness is not None else stored_limit
    by_reason = Counter(stored["termination_reason"].to_pylist())
    if passed_over:
        stored_over = sum(by_reason[r] for r in passed_over)
        if stored_over:
            notes.append(f"{stored_over} stored trajectories end in {', '.join(passed_over)}: kept, and passed over by "
                         "the trainer as the run's skip_reasons say (not counted as skipped or as backlog)")
    parents = sorted({r for r in steps["data_run_id"].to_pylist() if r is not None and r != run_id})
    if parents:  # a what-if replay: it consumed its parent's rows
        notes.append(f"a what-if replay of run {', '.join(parents)}: its steps read that run's trajectories; "
                     "issued rollouts, skips and the stale backlog are accounted for by checking that run")
        read = lake.read_run(trajectories.NAME, parents[0], ["trajectory_id", "termination_reason",
                                                               "min_policy_version", "ingest_seq"])
        findings += _check_consumption(read, steps, limit, skips=False, passed_over=passed_over)
        findings.append(_check_what_if_steps(lake, parents, steps))
    else:
        findings += _check_consumption(stored, steps, limit, passed_over=passed_over)
    verified = 0
    if verify_checkpoints:
        checkpoint_findings, verified = _check_checkpoints(versions, notes)
        findings += checkpoint_findings
    else:
        notes.append("checkpoints not verified (--no-checkpoints)")
    consumed = pc.list_flatten(steps["trajectory_ids"]).to_pylist()
    newest = None if versions.num_rows == 0 else int(pc.max(versions["version"]).as_py())
    backlog = None
    if limit is not None and newest is not None and not parents:
        backlog = stale_backlog(lake, run_id, stored, set(consumed), newest, limit, passed_over)
    return CheckReport(
        run_id=run_id,
        issued=issued.num_rows if issued.num_rows else None,
        stored=len(stored_ids),
        episode_splits=len(parts_of),
        abandoned=len(set(abandoned)),
        by_reason=dict(by_reason),
        quarantined=bad.num_rows,
        quarantined_by_rule=dict(Counter(bad["reason"].to_pylist())),
        steps=steps.num_rows,
        consumed=len(consumed),
        policy_versions=versions.num_rows,
        checkpoints_verified=verified,
        max_staleness=limit,
        backlog=backlog,
        findings=tuple(f for f in findings if f is not None),
        notes=tuple(notes),
    )


def _quarantined(lake: Lake, run_id: str, issued: set[str]) -> pa.Table:
    """The run's quarantine rows, and those whose run could not be read (a missing or mistyped
    ``run_id``) but whose ``record_id`` the run issued."""
    rows = lake.read(quarantine.NAME, columns=["run_id", "record_id", "reason"],
                     predicate=f"run_id = {sql_literal(run_id)} OR run_id IS NULL")  # fmt: skip
    ours = pc.equal(rows["run_id"], run_id).fill_null(False)
    claimed = pc.and_(rows["run_id"].is_null(), pc.is_in(rows["record_id"], pa.array(sorted(issued), pa.string())))
    return rows.filter(pc.or_(ours, claimed.fill_null(False)))


def _deleted_rows(lake: Lake) -> Finding | None:
    removing = [
        f"version {entry.get('version')}: {entry.get('operation')}"
        for entry in lake.table(trajectories.NAME).history()
        if entry.get("operation") not in _APPEND_OPERATIONS
    ]
    return _finding(FindingKind.DELETED, removing,
                    "commits of the trajectories table that can remove rows (only appends and "
                    "compaction are expected; stale rows must be kept)")  # fmt: skip


def _account_issued(
    issued: list[str], stored: set[str], bad: pa.Table, abandoned: set[str], notes: list[str]
) -> list[Finding | None]:
    quarantined = [i for i in bad["record_id"].to_pylist() if i is not None]
    redelivered = _repeated(quarantined)
    if redelivered:
        notes.append(f"{len(redelivered)} quarantined ids were delivered (and rejected) more than once")
    if not issued:
        notes.append("no issue log (rollout_tasks) for this run: issued rollouts cannot be accounted "
                     "for, only what was stored")  # fmt: skip
        return []
    issued_set, rejected = set(issued), set(quarantined)
    return [
        _finding(FindingKind.DUPLICATE_ISSUE, _repeated(issued), "issued twice under one id"),
        _finding(FindingKind.LOST, sorted(issued_set - stored - rejected - abandoned),
                 "issued, but neither stored in trajectories nor quarantined, nor closed out on resume"),
        _finding(FindingKind.ABANDONED_RESOLVED, sorted(abandoned & (stored | rejected)),
                 "closed out as abandoned on resume, but stored or quarantined too"),
        _finding(FindingKind.STORED_AND_QUARANTINED, sorted(issued_set & stored & rejected),
                 "issued once, but both stored and quarantined"),
        _finding(FindingKind.NOT_ISSUED, sorted(stored - issued_set),
                 "stored, but the run's issue log never issued it"),
    ]  # fmt: skip


def _check_what_if_steps(lake: Lake, parents: list[str], steps: pa.Table) -> Finding | None:
    """Each what-if step read the snapshot and ids of its parent's step of the same number."""
    if len(parents) > 1:
        return _finding(FindingKind.WHAT_IF_DATA, parents, "the run's steps read more than one other run")
    recorded = {r["step"]: r for r in lake.read_run(train_steps.NAME, parents[0],
                                                ["step", "trajectory_ids", "trajectories_version"]).to_pylist()}
    differ = []
    for row in sorted(steps.to_pylist(), key=lambda r: r["step"]):
        parent = recorded.get(row["step"])
        if parent is None:
            differ.append(f"step {row['step']} (the parent has no such step)")
        elif (parent["trajectory_ids"], parent["trajectories_version"]) != (row["trajectory_ids"],
                                                                           row["trajectories_version"]):
            differ.append(f"step {row['step']} (other ids or snapshot than {parents[0]!r}'s)")
    return _finding(FindingKind.WHAT_IF_DATA, differ, "what-if steps that did not read their parent's data")


def _check_consumption(stored: pa.Table, steps: pa.Table, limit: int | None, *,
                       skips: bool = True, passed_over: Sequence[str] = ()) -> list[Finding | None]:
    listed = stored.to_pylist()
    rows = {r["trajectory_id"]: (r["min_policy_version"], r["ingest_seq"]) for r in listed}
    never_eligible = {r["trajectory_id"] for r in listed if r["termination_reason"] in passed_over}
    consumed: list[str] = []
    missing, stale = [], []
    steps_by_version: list[tuple[int, int]] = []
    for step in sorted(steps.to_pylist(), key=lambda r: r["step"]):
        ids = step["trajectory_ids"]
        consumed += ids
        before = step["policy_version_before"]
        for trajectory_id in ids:
            if trajectory_id not in rows:
                missing.append(trajectory_id)
                continue
            oldest = rows[trajectory_id][0]
            if oldest is None or (limit is not None and before - oldest > limit):
                lag = "no action token" if oldest is None else f"staleness {before - oldest}"
                stale.append(f"{trajectory_id} at step {step['step']} ({lag})")
        seqs = [rows[i][1] for i in ids if i in rows]
        if seqs:
            steps_by_version.append((before, max(seqs)))
    taken = set(consumed)
    # For each row: did a step at which it was eligible (before <= oldest + limit) take a row that
    # arrived after it? Steps sorted by version, with the running maximum of what they took.
    steps_by_version.sort()
    befores = [before for before, _ in steps_by_version]
    latest_taken = list(itertools.accumulate((seq for _, seq in steps_by_version), max))
    skipped = []
    for trajectory_id, (oldest, seq) in rows.items() if skips and limit is not None else ():  # unknown bound: unchecked
        if trajectory_id in taken or oldest is None or trajectory_id in never_eligible:
            continue
        index = bisect.bisect_right(befores, oldest + limit)
        if index and latest_taken[index - 1] > seq:
            skipped.append(trajectory_id)
    bound = "unknown" if limit is None else str(limit)
    return [
        _finding(FindingKind.CONSUMED_TWICE, _repeated(consumed), "consumed by more than one step"),
        _finding(FindingKind.CONSUMED_MISSING, missing, "consumed, but not in trajectories"),
        _finding(FindingKind.CONSUMED_STALE, stale,
                 f"consumed beyond max_staleness {bound} at its step, or without an action token"),
        _finding(FindingKind.SKIPPED, sorted(skipped),
                 "never consumed, though eligible when a step took a later-arriving row"),
    ]  # fmt: skip


def _stored_settings(versions: pa.Table, notes: list[str]) -> tuple[int | None, tuple[str, ...]]:
    """``max_staleness`` and ``UpdateConfig.skip_reasons`` from the run configuration stored beside the
    run's registered checkpoints ((None, ()) without one)."""
    for uri in versions["checkpoint_uri"].to_pylist():
        try:
            found = stored_run_config(uri)
        except RunConfigError as error:
            notes.append(f"cannot read the run configuration: {error}")
            return None, ()
        if found is not None:
            return found.max_staleness, found.update.skip_reasons
    notes.append("no run configuration beside the run's checkpoints and no --max-staleness: "
                 "staleness of consumed rows, skipped rows and the stale backlog are not checked")  # fmt: skip
    return None, ()


def _check_checkpoints(versions: pa.Table, notes: list[str]) -> tuple[list[Finding | None], int]:
    missing, wrong, verified = [], [], 0
    for row in sorted(versions.to_pylist(), key=lambda r: r["version"]):
        version, uri = row["version"], row["checkpoint_uri"]
        state, detail = verify_registered(uri, version, row["weights_hash"])
        if state is RegisteredState.VERIFIED:
            verified += 1
        elif state is RegisteredState.PRUNED:
            notes.append(f"version {version}: {detail}")
        elif state is RegisteredState.HASH_DIFFERS:
            verified += 1
            wrong.append(f"v{version} at {uri} ({detail})")
        else:  # missing, incomplete, or not on this machine
            missing.append(f"v{version} at {uri}" + ("" if state is RegisteredState.MISSING else f" ({detail})"))
    return [
        _finding(FindingKind.CHECKPOINT_MISSING, missing, "registered checkpoint is absent or incomplete"),
        _finding(FindingKind.CHECKPOINT_HASH, wrong, "checkpoint weights differ from the recorded hash"),
    ], verified  # fmt: skip


def stale_backlog(
    lake: Lake,
    run_id: str,
    stored: pa.Table,
    consumed: set[str],
    trainer_version: int,
    max_staleness: int,
    passed_over: Sequence[str] = (),
) -> StaleBacklog:
    """Unconsumed rows of ``stored`` (columns ``trajectory_id``, ``min_policy_version``,
    ``termination_reason``) beyond ``max_staleness`` at ``trainer_version``, counted by completion-length
    bucket (the lengths are read for those rows only); rows ending for a reason in ``passed_over`` are
    never trained on whatever their staleness, and are left out."""
    oldest_allowed = trainer_version - max_staleness
    stale_ids, eligible = [], 0
    for row in stored.select(["trajectory_id", "min_policy_version", "termination_reason"]).to_pylist():
        if (row["trajectory_id"] in consumed or row["min_policy_version"] is None
                or row["termination_reason"] in passed_over):
            continue
        if row["min_policy_version"] < oldest_allowed:
            stale_ids.append(row["trajectory_id"])
        else:
            eligible += 1
    counts: Counter[str] = Counter()
    if stale_ids:
        try:
            rows = read_trajectories(lake, run_id=run_id, trajectory_ids=sorted(set(stale_ids)),
                                     columns=["completion_ids"])  # fmt: skip
        except LakeError:  # an id stored twice (reported as a finding): read the run's lengths whole
            rows = lake.read_run(trajectories.NAME, run_id, ["trajectory_id", "completion_ids"])
            rows = rows.filter(pc.is_in(rows["trajectory_id"], value_set=pa.array(stale_ids, pa.string())))
        lengths = pc.list_value_length(rows["completion_ids"]).to_pylist()
        counts.update(length_bucket(n) for n in lengths)
    by_length = {label: counts[label] for label in _bucket_order() if counts[label]}
    return StaleBacklog(trainer_version, max_staleness, len(stale_ids), by_length, eligible)
