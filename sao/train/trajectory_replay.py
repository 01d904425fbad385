"""Trajectory replay: the pre-flight check of SAO.md section 6 on one stored trajectory.

``replay_trajectory(lake, trajectory_id)`` (``sao replay --trajectory ID``) checks that a trajectory
says what happened:

- **log-probabilities**: for every action segment, the log-probabilities of its tokens recomputed by
  the trainer's own function (:func:`sao.train.step.policy_logprobs`, same logprob kind and sampling
  settings) under the policy version the segment records (that version's checkpoint), against the
  engine's stored values: the largest absolute difference per segment, within ``atol`` (5e-5 by
  default: :data:`DEFAULT_ATOL`). A token the engine could not have sampled under that version is far outside it.
- **observations excluded**: every observation segment has ``action_mask`` False and log-probability
  exactly 0.0, and its tokens are exactly what the environment inserts for the preceding action
  (``observation_ids`` of the environment's answer, re-run now).
- **reward**: the environment re-scores the final action (math_tool: the answer checked against the
  task's reference), which must equal the stored reward; ends the environment did not decide carry 0.
  An environment that rewards by the trainer's step (:func:`sao.envs.takes_trainer_step`:
  style_preference, whose preference shifts) is rebuilt at the trajectory's ``min_policy_version``,
  the version its replica ran when the episode started (:mod:`sao.rollout.serve`). Should new weights
  have landed between the episode's start and its first token, that version is one step later than
  the one the reward was observed at, and a shift at exactly that step shows as a reward mismatch.
- **termination reason against the tokens**: ``stop``: the last action token is a stop id and the
  environment ended the episode; ``turns``: the environment's own budget ended it, or ``num_turns``
  reached the agent's ``max_turns``; ``length``: the completion reached ``sampling.max_tokens``, or the
  next observation would not have fitted. ``timeout``, ``cancelled`` and ``error`` are facts about the
  clock or the machine, not the tokens: reported as not checkable (ok None), with reward 0 checked.
- for an episode of the built-in tool loop in a model's own tool-call format (:mod:`sao.rollout.env_agent`),
  the prompt and each observation are rendered through the model's chat template as the chat endpoint
  rendered them (the same tool offered, the replies read back with the same call ids), the environment
  re-run on the calls; an episode that split into parts there (a reply the template renders otherwise
  than it was sampled) has its reward and end reported as not checkable (ok None) in each part's
  replay: they are the whole episode's;
- for an episode of an agent of one's own (``env.agent``, :mod:`sao.rollout.user_agent`), the prompt,
  the observations' tokens, the reward and the termination were decided by the agent's code, which is
  not re-run: those checks are reported as not checkable (ok None); the log-probabilities, masks and
  the tiling are checked as for any trajectory;
- the prompt re-rendered from the task equals the stored prompt, the tokenizer and chat template hash
  as recorded, segments tile the completion, and ``num_turns`` matches the action turns.

Finding the task: the run configuration (:mod:`sao.train.run_config`) records the task file the
rollouts drew from (``ReplayContext.tasks_path``), the environment options and the agent's turn
budget; ``tasks_path`` overrides the file (``--tasks``). A task id that does not resolve is a
:class:`~sao.train.replay.ReplayError`. The environment is re-run for real (math_tool's tool calls go
to the sandbox again); a tool whose output is not deterministic shows up as an observation mismatch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from sao.envs import make_env, takes_trainer_step
from sao.envs.base import Task, Termination, read_tasks
from sao.lake.reader import read_trajectories
from sao.lake.store import Lake, LakeError
from sao.models.chat import ChatTokens, observation_ids, prompt_ids
from sao.models.tokenizer import chat_template_version, load_tokenizer, tokenizer_version
from sao.rollout.chat_endpoint import ChatRendering, EndpointError, normalise_messages
from sao.rollout.engine import FinishReason
from sao.rollout.env_agent import answer_reply, tool_schema
from sao.train.batch import collate
from sao.train.checkpoint import CheckpointPrunedError, checkpoint_dir, load_checkpoint, policy_dir
from sao.train.replay import ReplayError, run_checkpoints, torch_settings
from sao.train.run_config import ReplayContext
from sao.train.step import policy_logprobs

__all__ = ["DEFAULT_ATOL", "Check", "SegmentCheck", "TrajectoryReplay", "replay_trajectory"]

DEFAULT_ATOL = 5e-5
"""Agreement threshold between recomputed and stored log-probabilities (nats). Both sides compute in
float32, with matrix products of other shapes: the engine decodes a varying batch of requests, the
trainer runs one packed forward. Their roundings differ: by up to 2e-5 nats on a sampled token of
log-probability -5.9 (the torch engine on a 2-core host, 2026-12-07, ``tests/test_user_agent.py``), against
under 1e-6 on others. A token another version sampled is orders of magnitude further off."""


@dataclasses.dataclass(frozen=True)
class SegmentCheck:
    """One segment of the completion.

    Attributes:
        kind: ``action`` or ``observation``; ``start``/``end``: its half-open token range.
        policy_version: the version that sampled an action segment (None for observations).
        max_abs_diff: action segments: largest |recomputed - stored| log-probability.
        ok: within ``atol`` (actions), or excluded and equal to the environment's insert (observations).
        detail: what is wrong, when something is.
    """

    index: int
    kind: str
    start: int
    end: int
    policy_version: int | None
    max_abs_diff: float | None
    ok: bool
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class Check:
    """A named finding: ok True, False, or None (cannot be decided from the record)."""

    name: str
    ok: bool | None
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class TrajectoryReplay:
    """The replay of one trajectory (see the module docstring)."""

    trajectory_id: str
    run_id: str
    task_id: str
    termination_reason: str
    atol: float
    reward_recorded: float
    reward_rescored: float | None
    segments: tuple[SegmentCheck, ...]
    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.segments) and all(c.ok is not False for c in self.checks)

    def check(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"ok": self.ok}


@dataclasses.dataclass(frozen=True)
class _Turn:
    """One action turn: its token range, and the index of the observation segment after it."""

    start: int
    end: int
    observation: int | None


def _read_row(lake: Lake, trajectory_id: str, run_id: str | None) -> dict:
    try:
        table = read_trajectories(lake, run_id=run_id, trajectory_ids=[trajectory_id])
    except LakeError as error:
        where = f"run {run_id!r}" if run_id else "any run"
        raise ReplayError(f"trajectory {trajectory_id!r} is not in {where} of the lake at {lake.root}: {error}") from None
    return table.to_pylist()[0]


def _resolve_task(task_id: str, context: ReplayContext, tasks_path: str | Path | None) -> Task:
    path = tasks_path or context.tasks_path
    if path is None:
        raise ReplayError(f"task {task_id!r} cannot be found: the run configuration records no task file "
                          "(ReplayContext.tasks_path); pass --tasks PATH")
    if not Path(path).exists():
        raise ReplayError(f"task file {path} does not exist")
    tasks = {task.task_id: task for task in read_tasks(path)}
    if task_id not in tasks:
        raise ReplayError(f"task {task_id!r} is not in the task file {path}")
    return tasks[task_id]


def _turns(segments: Sequence[Mapping]) -> list[_Turn]:
    turns: list[_Turn] = []
    start = end = None
    for index, segment in enumerate(segments):
        if segment["kind"] == "action":
            start = segment["start"] if start is None else start
            end = segment["end"]
        else:
            if start is not None:
                turns.append(_Turn(start, end, index))
            start = end = None
    if start is not None:
        turns.append(_Turn(start, end, None))
    return turns


def _tiling_check(row: Mapping) -> Check:
    n, mask, cursor = len(row["completion_ids"]), list(row["action_mask"]), 0
    for index, segment in enumerate(row["segments"]):
        if segment["start"] != cursor or segment["end"] <= segment["start"]:
            return Check("segments", False, f"segment {index} covers [{segment['start']}, {segment['end']}), "
                                            f"expected to start at {cursor}")
        flags = set(mask[segment["start"]:segment["end"]])
        if flags != {segment["kind"] == "action"}:
            return Check("segments", False, f"segment {index} ({segment['kind']}) has action_mask values {flags}")
        cursor = segment["end"]
    if cursor != n:
        return Check("segments", False, f"segments end at {cursor}, the completion has {n} tokens")
    return Check("segments", True)


class _Policies:
    """Each version's policy, loaded once from its checkpoint."""

    def __init__(self, root: Path | None, versions: Mapping[int, Mapping]) -> None:
        self.root, self.versions, self.loaded = root, versions, {}

    def directory(self, version: int) -> Path:
        if self.root is not None:
            return checkpoint_dir(self.root, version)
        if version not in self.versions:
            raise ReplayError(f"policy version {version} is not registered in policy_versions")
        return Path(self.versions[version]["checkpoint_uri"])

    def __call__(self, version: int) -> torch.nn.Module:
        if version not in self.loaded:
            path = self.directory(version)
            try:
                self.loaded[version] = load_checkpoint(path.parent, version, with_critic=False, with_state=False).policy
            except (FileNotFoundError, CheckpointPrunedError) as error:
                raise ReplayError(f"cannot load policy version {version}: {error}") from None
        return self.loaded[version]


def _segment_checks(row: Mapping, policies: _Policies, expected_observations: Mapping[int, list[int]] | None,
                    atol: float) -> list[SegmentCheck]:
    """Every segment checked; ``expected_observations`` None: what an agent of one's own added, not re-run
    (only the mask and the zero log-probabilities of its observations are checked)."""
    stored = torch.tensor([0.0 if v is None else float(v) for v in row["logprobs"]], dtype=torch.float64)
    mask = list(row["action_mask"])
    completion = list(row["completion_ids"])
    recomputed: dict[int, torch.Tensor] = {}
    checks = []
    for index, segment in enumerate(row["segments"]):
        start, end, version = segment["start"], segment["end"], segment["policy_version"]
        if segment["kind"] == "action":
            if version not in recomputed:
                with torch.no_grad():
                    batch = collate([row], trainer_version=version)
                    recomputed[version] = policy_logprobs(policies(version), batch)[0].double()
            diff = float((recomputed[version][start:end] - stored[start:end]).abs().max())
            ok = diff <= atol
            detail = "" if ok else f"max |recomputed - stored| {diff:.3g} > {atol:g} under version {version}"
            checks.append(SegmentCheck(index, "action", start, end, version, diff, ok, detail))
            continue
        problems = []
        if any(mask[start:end]):
            problems.append("action_mask is True on an observation token")
        if any(float(v) != 0.0 for v in stored[start:end].tolist()):
            problems.append("an observation token has a non-zero log-probability")
        if expected_observations is None:
            pass
        elif (expected := expected_observations.get(index)) is None:
            problems.append("the environment inserts no observation here")
        elif completion[start:end] != expected:
            problems.append(f"tokens differ from the environment's insert ({end - start} stored, {len(expected)} expected)")
        checks.append(SegmentCheck(index, "observation", start, end, None, None, not problems, "; ".join(problems)))
    return checks


class _Unsettled(Exception):  # noqa: N818 - not a failure: what the record alone cannot settle
    """An episode in a model's own format that split into parts (its template rendered a reply otherwise
    than it was sampled, or this is a later part): what was checked up to there, and why the reward
    and the end cannot be re-scored from this part alone."""

    def __init__(self, prompt: Check, expected: dict[int, list[int]] | None, reason: str,
                 problems: list[str] | None = None) -> None:
        super().__init__(reason)
        self.prompt, self.expected, self.reason, self.problems = prompt, expected, reason, problems or []


class _ThisFormat:
    """The environment's episode in this project's chat format: a turn's text is the action, and an
    observation is the tool's output in the format's fixed layout (:func:`sao.models.chat.observation_ids`)."""

    def __init__(self, tokenizer, env) -> None:
        self.tokenizer, self.env = tokenizer, env

    def prompt(self, task: Task) -> list[int]:
        return prompt_ids(self.tokenizer, self.env.reset(task))

    def turn(self, number: int, tokens: list[int], last_is_stop: bool):
        """(the result that ended the episode, or None; else the observation's ids)."""
        result = self.env.step(self.tokenizer.decode(tokens, skip_special_tokens=False))
        return (result, None) if result.done else (None, observation_ids(self.tokenizer, result.observation))


class _OwnFormat:
    """The built-in tool loop in a model's own tool-call format (:mod:`sao.rollout.env_agent`), rendered
    by the chat template as the chat endpoint rendered it: the same tools offered, each reply read back
    with the same call ids, each result answered as the episode's agent answered it; an observation is
    what the template added (None where it renders a reply otherwise than it was sampled: the episode
    split there)."""

    def __init__(self, row: Mapping, tokenizer, env, schema: list, chat: ChatTokens) -> None:
        self.row, self.env, self.schema = row, env, schema
        self.rendering = ChatRendering(tokenizer, chat)
        self.episode = row.get("episode_id") or row["trajectory_id"]

    def prompt(self, task: Task) -> list[int]:
        if self.row.get("episode_part"):
            raise _Unsettled(Check("prompt", None, "a later part of a split episode: its prompt is the conversation "
                                                   "at the split"), None,
                             f"part {self.row['episode_part']} of episode {self.episode}, which split: the reward "
                             "and the end are the whole episode's, which no one part replays")
        self.messages = normalise_messages(self.env.reset(task))
        self.text = self.rendering.render(self.messages, self.schema)
        return self.rendering.encode(self.text)

    def turn(self, number: int, tokens: list[int], last_is_stop: bool):
        rendering = self.rendering
        finish = FinishReason.STOP if last_is_stop else FinishReason.LENGTH
        reply, _ = rendering.reply(tokens, finish, (), self.schema, f"{self.episode}/{number + 1}")
        before = self.text + rendering.decode(tokens)
        ended, answers = answer_reply(self.env, reply)
        if ended is not None:
            return ended, None
        following = normalise_messages([*self.messages, reply, *answers])
        after = rendering.render(following, self.schema)
        if not after.startswith(before):
            return None, None
        added = rendering.encode_added(following, len(self.messages) + 1, self.schema, before, after[len(before):])
        self.messages, self.text = following, after
        return None, added


def _simulate(row: Mapping, task: Task, tokenizer, context: ReplayContext, turns: list[_Turn],
              chat: ChatTokens | None = None):
    """Re-run the environment on the stored actions: (prompt check, expected observation tokens by
    segment index, the StepResult that ended the episode or None, the observation that would follow
    the last turn or None, problems). Raises :class:`_Unsettled` for a part of a split episode."""
    options = dict(context.env_options.get(task.env, {}))
    if takes_trainer_step(task.env):
        options["trainer_step"] = int(row["min_policy_version"])
    env = make_env(task.env, **options)
    chat = chat or ChatTokens.from_tokenizer(tokenizer)
    schema = tool_schema(env, chat)
    episode = _ThisFormat(tokenizer, env) if schema is None else _OwnFormat(row, tokenizer, env, schema, chat)
    try:
        return _replayed(row, task, episode, chat.stop_token_ids, turns)
    except EndpointError as error:  # the template refuses what it rendered in the rollout
        raise ReplayError(f"trajectory {row['trajectory_id']}: the chat template cannot render its "
                          f"conversation now: {error}") from None


def _replayed(row: Mapping, task: Task, episode: _ThisFormat | _OwnFormat, stop_ids: Sequence[int],
              turns: list[_Turn]):
    """:func:`_simulate`'s findings, the episode re-run turn by turn in its format."""
    prompt = episode.prompt(task)
    prompt_check = Check("prompt", prompt == list(row["prompt_ids"]),
                         "" if prompt == list(row["prompt_ids"]) else "the task's prompt renders to other tokens")
    completion, reason = list(row["completion_ids"]), row["termination_reason"]
    expected: dict[int, list[int]] = {}
    ended = pending = None
    problems: list[str] = []
    for number, turn in enumerate(turns):
        tokens = completion[turn.start:turn.end]
        last_is_stop = tokens[-1] in stop_ids
        if turn.observation is None and not (reason in ("stop", "turns") or (reason == "length" and last_is_stop)):
            break  # the agent did not hand this last action to the environment
        result, added = episode.turn(number, tokens, last_is_stop)
        if turn.observation is not None:
            if not last_is_stop:
                problems.append(f"turn {number} ends with token {tokens[-1]}, not a stop id, yet an observation follows")
            if result is not None:
                problems.append(f"the environment ends the episode after turn {number} ({result.termination}), "
                                "yet the trajectory continues")
            elif added is None:
                problems.append(f"the chat template renders the conversation after turn {number} otherwise than "
                                "it was sampled, yet the trajectory continues")
            else:
                expected[turn.observation] = added
        elif result is not None:
            ended = result
        elif added is None:  # the endpoint split the episode here: the rest is the next part's
            raise _Unsettled(prompt_check, expected, f"episode {row.get('episode_id')} split after turn {number} "
                             "(the chat template renders the reply otherwise than it was sampled): the reward and "
                             "the end are the whole episode's, which no one part replays", problems)
        else:
            pending = added
    return prompt_check, expected, ended, pending, problems


def _termination_check(row: Mapping, turns: list[_Turn], ended, pending, max_turns: int | None,
                       stop_ids: Sequence[int]) -> Check:
    reason, n = row["termination_reason"], len(row["completion_ids"])
    max_tokens = int(row["sampling"]["max_tokens"])
    ends_in_observation = bool(turns) and turns[-1].observation is not None
    last_is_stop = bool(turns) and row["completion_ids"][turns[-1].end - 1] in stop_ids
    if reason == "stop":
        ok = not ends_in_observation and last_is_stop and ended is not None and ended.termination == Termination.STOP
        return Check("termination", ok, "" if ok else "a stop end needs a final stop id and the environment ending "
                                                      "the episode with stop")
    if reason == "turns":
        if not ends_in_observation:
            ok = ended is not None and ended.termination == Termination.TURNS
            return Check("termination", ok, "" if ok else "the environment does not end the episode with turns")
        if max_turns is None:
            return Check("termination", None, "the agent's max_turns is not recorded in the run configuration")
        ok = row["num_turns"] >= max_turns and n < max_tokens
        return Check("termination", ok, "" if ok else f"{row['num_turns']} turns of {max_turns}, {n} of {max_tokens} tokens")
    if reason == "length":
        if ends_in_observation or not last_is_stop:
            ok = n >= max_tokens
            return Check("termination", ok, "" if ok else f"{n} tokens, the budget is {max_tokens}")
        ok = ended is None and pending is not None and n + len(pending) > max_tokens
        return Check("termination", ok, "" if ok else "the next observation would have fitted in the budget")
    return Check("termination", None, f"a {reason} end is decided by the clock or the machine, not the tokens")


def _code_changed(lake: Lake, row: Mapping, what: str = "scored with") -> str:
    """Why a re-score (or a re-rendered prompt: a tool function's docstring describes it to a model of
    one's own) may differ, when it can be told: the code of one's own the run ran with when it
    generated ``row`` (``runs.code``) and which of its modules differ now."""
    from sao.user_code import changed_since, recorded_code

    changed = changed_since(recorded_code(lake, row["run_id"], row["timings"]["created_at"]))
    return f" (the code of one's own it was {what} has changed since: {'; '.join(changed)})" if changed else ""


def replay_trajectory(lake: Lake, trajectory_id: str, *, run_id: str | None = None,
                      checkpoint_root: str | Path | None = None, tasks_path: str | Path | None = None,
                      atol: float = DEFAULT_ATOL) -> TrajectoryReplay:
    """Replay ``trajectory_id`` (see the module docstring).

    Raises:
        ReplayError: unknown trajectory (or run), missing run configuration, a task that does not
            resolve, or a version whose checkpoint is gone.
    """
    if not atol >= 0:
        raise ReplayError(f"atol must be >= 0, got {atol}")
    row = _read_row(lake, trajectory_id, run_id)
    _, cfg, versions = run_checkpoints(lake, row["run_id"], checkpoint_root)
    policies = _Policies(Path(checkpoint_root) if checkpoint_root is not None else None, versions)
    first = policies.directory(min(versions))
    tokenizer = load_tokenizer(policy_dir(first.parent, min(versions)))
    task = _resolve_task(row["task_id"], cfg.rollout, tasks_path)
    turns = _turns(row["segments"])
    chat = ChatTokens.from_tokenizer(tokenizer)
    stop_ids = chat.stop_token_ids
    recorded = float(row["reward"])
    agent = cfg.rollout.env_options.get(task.env, {}).get("agent")
    if agent:  # an agent of one's own: its code decided the prompt, observations, reward and end
        not_rerun = f"decided by the agent {agent}, which is not re-run"
        prompt_check, expected, problems, rescored = Check("prompt", None, not_rerun), None, [], recorded
        reward_check, termination_check = Check("reward", None, not_rerun), Check("termination", None, not_rerun)
    else:
        try:
            prompt_check, expected, ended, pending, problems = _simulate(row, task, tokenizer, cfg.rollout, turns,
                                                                         chat)
        except _Unsettled as split:  # a model's own format whose episode split: not decided by this part
            prompt_check, expected, problems, rescored = split.prompt, split.expected, split.problems, recorded
            reward_check, termination_check = Check("reward", None, split.reason), Check("termination", None, split.reason)
        else:
            if prompt_check.ok is False:
                prompt_check = dataclasses.replace(prompt_check, detail=prompt_check.detail
                                                   + _code_changed(lake, row, "prompted with"))
            rescored = float(ended.reward) if ended is not None and row["termination_reason"] in ("stop", "turns") else 0.0
            reward_check = Check("reward", recorded == rescored,
                                 "" if recorded == rescored else f"recorded {recorded}, re-scored {rescored}"
                                 + _code_changed(lake, row))
            termination_check = _termination_check(row, turns, ended, pending, cfg.rollout.max_turns, stop_ids)
    same_tokenizer = (tokenizer_version(tokenizer) == row["tokenizer_version"]
                      and chat_template_version(tokenizer) == row["chat_template_version"])
    num_turns_ok = row["num_turns"] == len(turns) or (
        row["termination_reason"] in ("timeout", "cancelled", "error") and row["num_turns"] == len(turns) + 1)
    checks = (
        Check("tokenizer", same_tokenizer, "" if same_tokenizer else "the checkpoint's tokenizer or chat template "
                                                                      "hashes differently from the recorded one"),
        prompt_check,
        _tiling_check(row),
        Check("actions", not problems, "; ".join(problems)),
        Check("num_turns", num_turns_ok, "" if num_turns_ok else f"{row['num_turns']} recorded, {len(turns)} action turns"),
        reward_check,
        termination_check,
    )
    with torch_settings(cfg.torch_threads, cfg.deterministic):
        segments = tuple(_segment_checks(row, policies, expected, atol))
    return TrajectoryReplay(
        trajectory_id=trajectory_id, run_id=row["run_id"], task_id=row["task_id"],
        termination_reason=row["termination_reason"], atol=atol, reward_recorded=recorded, reward_rescored=rescored,
        segments=segments, checks=checks,
    )
