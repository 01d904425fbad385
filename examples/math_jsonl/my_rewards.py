"""A reward function of one's own: full marks for a correct answer (by math-verify), a small
deduction for each tool call beyond the first. Named in config.yaml as
``examples.math_jsonl.my_rewards:correct_in_few_calls`` (importable from the repository root)."""

from sao.rewards import math_verify


def correct_in_few_calls(completion: str, answer: str, messages: list[dict], **kwargs) -> float:
    if math_verify(completion=completion, answer=answer) == 0.0:
        return 0.0
    tool_calls = sum(1 for m in messages if m["role"] == "tool")
    return 1.0 - 0.1 * max(0, tool_calls - 1)
