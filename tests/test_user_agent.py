"""An agent of one's own, written only against the ``openai`` client, trained 3 SAO steps through Serve's
chat endpoint, the lake and Ray Train; every stored row checked against what the endpoint generated and
what the agent added, and against the trainer's log-probabilities."""

import json
import textwrap

import pytest
import torch
import yaml

from benchmarks.gpu_check import action_logprob_gap
from sao.models.chat import prompt_ids
from sao.models.policy import build_policy, save_policy
from sao.train.trajectory_replay import DEFAULT_ATOL, replay_trajectory
from tests._runs import train_and_audit

PROMPTS = [{"prompt": f"What is {a} * {b}?", "answer": str(a * b)} for a in range(2, 9) for b in range(3, 7)]

AGENT = '''
import json

PYTHON = {"type": "function", "function": {"name": "python", "description": "Run Python code.",
          "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}


async def agent(client, task):
    """A tool call, the tool's result, a final answer."""
    messages = list(task["messages"])
    reply = await client.chat.completions.create(model="policy", messages=messages, tools=[PYTHON], max_tokens=24)
    message = reply.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    if message.tool_calls:
        code = json.loads(message.tool_calls[0].function.arguments)["code"]
        try:  # the sampled code may not parse: the tool then answers with the error, as a tool would
            result = str(eval(code.removeprefix("print(").removesuffix(")"), {})) if code.startswith("print(") else "?"
        except Exception as error:
            result = f"{type(error).__name__}: {error}"
        messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": result})
    else:
        messages.append({"role": "user", "content": "Call the python tool first."})
    final = await client.chat.completions.create(model="policy", messages=messages, tools=[PYTHON], max_tokens=24)
    answer = final.choices[0].message.content or ""
    return (1.0 if task["answer"] in answer else 0.0), {"tool_called": bool(message.tool_calls)}
'''


def tool_calling_policy(tokenizer, path):
    """The tiny policy taught (teacher forcing, a few seconds) to open with a tool call and answer after
    the tool's output, so the agent's episodes have a tool call, a tool result and a final answer."""
    torch.manual_seed(0)
    policy = build_policy(seed=0)
    optimiser = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    sequences = []
    for task in PROMPTS[:8]:
        head = prompt_ids(tokenizer, [{"role": "user", "content": task["prompt"]}])
        call = tokenizer.encode(f"<tool_call>print({task['prompt'][8:-1]})</tool_call>", add_special_tokens=False)
        tool = tokenizer.encode(f"<|im_end|>\n<|im_start|>tool\n<tool_response>{task['answer']}</tool_response>"
                                "<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
        answer = tokenizer.encode(f"<answer>{task['answer']}</answer>", add_special_tokens=False)
        ids = head + call + tool + answer
        learn = [0] * len(head) + [1] * len(call) + [0] * len(tool) + [1] * len(answer)
        sequences.append((torch.tensor([ids]), torch.tensor(learn[1:], dtype=torch.bool)))
    policy.train()
    for _ in range(60):
        for ids, learn in sequences:
            logits = policy(ids).logits[0, :-1]
            loss = torch.nn.functional.cross_entropy(logits[learn], ids[0, 1:][learn])
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
    save_policy(policy.eval(), path, tokenizer, policy_version=0)
    return path


@pytest.mark.slow  # 72 s: in `make test` it held the suite over its 12 minutes; the endpoint's agent path is
@pytest.mark.ray   # checked there (tests/rollout/test_env_agent.py)
def test_three_steps_with_an_agent_of_ones_own(tmp_path, tokenizer, ray_session, monkeypatch):
    from sao.lake.store import Lake
    from sao.models.policy import load_policy
    from sao.train.checkpoint import policy_dir

    (tmp_path / "tool_then_answer_agent.py").write_text(textwrap.dedent(AGENT))  # a name no other test imports
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(t) + "\n" for t in PROMPTS))
    monkeypatch.chdir(tmp_path)  # agents are imported from the working directory, as a user's are
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        "run_id": "own-agent", "workdir": str(tmp_path / "runs"),
        "model": {"path": str(tool_calling_policy(tokenizer, tmp_path / "model"))},
        "data": {"train": str(tmp_path / "data.jsonl")}, "env": {"agent": "tool_then_answer_agent:agent"},
        "train": {"steps": 3, "batch_size": 4, "max_staleness": 0},
        "rollout": {"num_replicas": 1, "max_tokens": 96, "max_turns": 2, "max_in_flight": 4},
        "value_pretraining": {"samples": 0}, "lake": {"root": str(tmp_path / "lake")}}))
    config, version_zero, rows = train_and_audit(tmp_path / "run.yaml")
    lake = Lake.open(config.lake.root)
    # The taught policy stops its replies; at temperature 1 one may run to the token budget now and then.
    ends = [(row["termination_reason"], row["error"]) for row in rows]
    assert rows and all(error is None and reason in ("stop", "length") for reason, error in ends), ends
    assert sum(reason == "stop" for reason, _ in ends) >= 3 * len(rows) // 4, ends
    assert all(row["episode_id"] == row["trajectory_id"] and row["episode_part"] == 0 for row in rows)
    tool_results = 0
    for row in rows:
        # Tokens: what the endpoint generated (actions) and what the agent added (observations), in turn.
        segments = row["segments"]
        kinds = [kind for i, kind in enumerate(s["kind"] for s in segments)
                 if i == 0 or kind != segments[i - 1]["kind"]]  # a weight update mid-reply splits an action
        assert kinds in (["action"], ["action", "observation", "action"])
        observations = [s for s in segments if s["kind"] == "observation"]
        assert segments[0]["start"] == 0 and segments[-1]["end"] == len(row["completion_ids"])
        mask = [s["kind"] == "action" for s in segments for _ in range(s["start"], s["end"])]
        assert row["action_mask"] == mask and row["num_turns"] == sum(mask[i] and (i == 0 or not mask[i - 1])
                                                                      for i in range(len(mask)))
        assert row["prompt_ids"] == prompt_ids(tokenizer, [{"role": "user", "content": _prompt(row, config)}])
        if observations:
            added = tokenizer.decode(row["completion_ids"][observations[0]["start"]:observations[0]["end"]],
                                     skip_special_tokens=False)
            called = json.loads(row["agent_info"])["tool_called"]
            expected_turn = "<|im_start|>tool\n<tool_response>" if called else "<|im_start|>user\nCall the python tool"
            assert expected_turn in added and added.endswith("<|im_start|>assistant\n")
            first_reply = tokenizer.decode(row["completion_ids"][:observations[0]["start"]], skip_special_tokens=False)
            assert not called or "<tool_call>" in first_reply and first_reply.endswith("</tool_call>")
            tool_results += called
    assert tool_results >= len(rows) // 2  # the taught policy opens with a tool call

    # At staleness 0 the trainer's log-probabilities are the engine's, each action segment recomputed by
    # the version that sampled it.
    gap = action_logprob_gap(rows, lambda v: load_policy(version_zero if v == 0 else policy_dir(config.checkpoint_root, v)))
    assert gap["rows"] >= 4 and gap["max_abs_gap"] < DEFAULT_ATOL, gap  # float32 rounding: its docstring

    # And by the trainer's own function (trajectory replay), every row: the agent's decisions are said
    # not to be re-run, every action segment agrees within the replay's tolerance.

    for row in rows:
        replay = replay_trajectory(lake, row["trajectory_id"], run_id=config.run_id)
        actions = [s for s in replay.segments if s.kind == "action"]
        assert actions and all(s.ok for s in replay.segments), replay
        assert max(s.max_abs_diff for s in actions) <= DEFAULT_ATOL
        checks = {c.name: c.ok for c in replay.checks}
        assert checks["reward"] is None and checks["prompt"] is None and checks["termination"] is None
        assert checks["segments"] and checks["actions"] and checks["num_turns"] and checks["tokenizer"], replay.checks


def _prompt(row, config):
    return next(t["prompt"] for t in PROMPTS if runs_task_id(t, config) == row["task_id"])


def runs_task_id(task, config):
    from sao import runs

    ids = {t.prompt: t.task_id for t in runs.run_tasks(config, "train") + runs.run_tasks(config, "heldout")}
    return ids[task["prompt"]]
