"""Read-only SQL over every table; modifying statements refused before they reach the engine."""

from __future__ import annotations

import pytest

from sao.lake.config import WriterConfig
from sao.lake.ledger import record_train_step
from sao.lake.records import TrainStepRecord, utc_now
from sao.lake.sql import EXAMPLE_QUERIES, ReadOnlyQueryError, check_read_only, run_sql
from sao.lake.store import LakeError
from sao.lake.synthetic import make_trajectories
from sao.lake.writer import TrajectoryWriter
from tests.lake.conftest import BACKENDS, RUN, fresh_lake_config, open_with_versions
from tests.lake.validate.test_rules import CASES


@pytest.fixture(scope="module", params=BACKENDS)
def filled(request, tmp_path_factory):
    """A lake of each backend with rows in every table, built once for this module: every test here
    only reads it (a refused statement never reaches the engine, and one that did would change what
    the tests after it read)."""
    from sao.config import RunConfig
    from sao.runs import record_start

    tmp_path = tmp_path_factory.mktemp("sql")
    lake = open_with_versions(fresh_lake_config(request, tmp_path))
    records = make_trajectories(5, seed=41, num_tokens=12)
    with TrajectoryWriter(lake, WriterConfig(background_flush=False)) as writer:
        writer.add_many([*records, CASES["logprob_positive"][0]])
    now = utc_now()
    ids = tuple(r.trajectory_id for r in records[:2])
    record_train_step(
        lake,
        TrainStepRecord(
            RUN,
            0,
            1,
            2,
            lake.version("trajectories"),
            ids,
            now,
            now,
            {"actor/kept_frac": 0.75},
            {"torch": 3},
        ),
    )
    own = {"data": {"train": "examples/math_jsonl/train.jsonl"},  # a reward of one's own: a runs row with code
           "reward": {"functions": ["examples.math_jsonl.my_rewards:correct_in_few_calls"]}}
    record_start(RunConfig(run_id=RUN, workdir=str(tmp_path / "runs"), lake={"root": lake.root}, **own), lake=lake)
    return lake


QUERIES = {
    "trajectories": (
        "SELECT termination_reason, count(*) AS n, sum(num_action_tokens) > 0 AS has_actions "
        "FROM trajectories GROUP BY termination_reason",
        [{"termination_reason": "stop", "n": 5, "has_actions": True}],
    ),
    "quarantine": (
        "SELECT reason, field, position FROM quarantine",
        [{"reason": "logprob_positive", "field": "logprobs", "position": 5}],
    ),
    "policy_versions": (
        "SELECT version, parent_version FROM policy_versions ORDER BY version",
        [{"version": 0, "parent_version": None}, {"version": 1, "parent_version": 0}],
    ),
    "train_steps": (
        "SELECT step, num_trajectories, metrics['actor/kept_frac'] AS kept, seeds['torch'] AS seed "
        "FROM train_steps",
        [{"step": 0, "num_trajectories": 2, "kept": 0.75, "seed": 3}],
    ),
}


@pytest.mark.parametrize("table", sorted(QUERIES))
def test_sql_on_each_table(filled, table):
    query, expected = QUERIES[table]
    assert run_sql(filled, query).to_pylist() == expected


def test_sql_joins_a_step_to_the_snapshot_it_read(filled):
    query = (
        "SELECT count(*) AS n FROM (SELECT unnest(trajectory_ids) AS id FROM train_steps) AS used "
        "JOIN trajectories t ON t.trajectory_id = used.id"
    )
    assert run_sql(filled, query).to_pylist() == [{"n": 2}]


def test_sql_reads_pinned_versions(filled):
    assert run_sql(
        filled, "SELECT count(*) AS n FROM trajectories", versions={"trajectories": 0}
    ).to_pylist() == [{"n": 0}]
    with pytest.raises(KeyError, match="unknown table"):
        run_sql(filled, "SELECT 1", versions={"nope": 1})


def test_results_use_plain_arrow_types(filled):
    result = run_sql(filled, "SELECT trajectory_id, segments FROM trajectories LIMIT 1")
    assert str(result.schema.field("trajectory_id").type) == "string"
    assert "view" not in str(result.schema)


@pytest.mark.parametrize(
    ("query", "kind"),
    [
        ("DELETE FROM trajectories", "DELETE"),
        ("insert into quarantine select * from quarantine", "INSERT"),
        ("UPDATE train_steps SET step = 1", "UPDATE"),
        ("DROP TABLE trajectories", "DROP"),
        ("COPY (SELECT * FROM trajectories) TO '/tmp/stolen.csv'", "COPY"),
        ("CREATE VIEW v AS SELECT 1", "CREATE"),
        ("SET datafusion.execution.batch_size = 1", "SET"),
        ("  -- a comment first\n MERGE INTO trajectories USING x ON true", "MERGE"),
    ],
)
def test_modifying_statements_are_refused_naming_their_kind(filled, query, kind):
    with pytest.raises(ReadOnlyQueryError, match=f"refusing the statement {kind}"):
        run_sql(filled, query)


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("SELECT 1; DROP TABLE trajectories", "one statement at a time"),
        ("WITH x AS (SELECT 1) INSERT INTO t SELECT * FROM x", "refusing the statement INSERT"),
        ("SELECT * FROM (SELECT 1) AS s WHERE EXISTS (SELECT 1 INTO t)", "refusing the statement SELECT because it contains INTO"),
        ("DEL/**/ETE FROM trajectories", "does not parse as SQL"),
        ("SELECT * INTO copy FROM trajectories", "contains INTO"),
        ("SELECT 'unterminated", "does not parse as SQL"),
        ("   ", "empty"),
    ],
)
def test_smuggled_modifications_are_refused(query, message):
    with pytest.raises(ReadOnlyQueryError, match=message):
        check_read_only(query)


@pytest.mark.parametrize(
    ("query", "column", "expected"),
    [
        ("SELECT 'delete me' AS x", "x", ["delete me"]),
        ('SELECT "termination_reason" AS "update" FROM trajectories LIMIT 1', "update", ["stop"]),
        ("/* DROP */ SELECT 1 AS one;", "one", [1]),
        ("WITH a AS (SELECT 2 AS n) SELECT n FROM a", "n", [2]),
        ("VALUES (3)", "column1", [3]),
        ("SELECT count(*) AS use FROM trajectories", "use", [5]),  # keywords as aliases: no refusal
        ("SELECT max(step) AS load FROM train_steps", "load", [0]),
        ("SELECT 1 AS delete_me UNION ALL SELECT 2", "delete_me", [1, 2]),
    ],
)
def test_read_only_statements_run_and_answer(filled, query, column, expected):
    assert sorted(run_sql(filled, query).column(column).to_pylist()) == expected  # UNION ALL: any order


def test_describe_and_explain_pass_and_explain_checks_what_it_explains(filled):
    described = run_sql(filled, "DESCRIBE train_steps").column("column_name").to_pylist()
    assert "data_run_id" in described and "trajectory_ids" in described
    assert run_sql(filled, "explain select 1").num_rows >= 1
    with pytest.raises(ReadOnlyQueryError, match="refusing the statement DELETE"):
        check_read_only("EXPLAIN ANALYZE DELETE FROM trajectories")


def test_engine_errors_are_lake_errors(filled):
    with pytest.raises(LakeError, match="query failed"):
        run_sql(filled, "SELECT * FROM no_such_table")


@pytest.mark.parametrize("question", sorted(EXAMPLE_QUERIES))
def test_every_example_query_answers(filled, question):
    assert run_sql(filled, EXAMPLE_QUERIES[question]).num_rows >= 1


def test_the_staleness_example_by_hand(filled):
    # step 0 started from policy version 1 and read two trajectories sampled by version 0
    rows = run_sql(filled, EXAMPLE_QUERIES["How stale was the data each step used?"]).to_pylist()
    assert rows == [{"run_id": RUN, "step": 0, "staleness": 1, "trajectories": 2}]
