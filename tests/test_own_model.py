"""A model directory of the user's own: three architectures built from config here (dense Llama and
Qwen2, Qwen3-MoE), each with a tokenizer trained here and a ChatML chat template (none of this
project's special tokens), trained 3 SAO steps from a config file through Serve, the lake and Ray Train."""

import json

import pytest
import torch
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from tokenizers import decoders as tokenizer_decoders
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from sao.config import resolve
from sao.models.chat import ChatTokens
from sao.models.policy import ModelDirectoryError, check_model_directory, routing_note

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TASKS = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(1, 9) for b in range(1, 6)]


def train_tokenizer(chat_template: str | None = CHATML) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the tasks' text, with ChatML turn tokens."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizer_decoders.ByteLevel()
    corpus = [t["prompt"] + " " + t["answer"] for t in TASKS] + ["user assistant system"]
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = chat_template
    return tokenizer


def build(architecture: str, vocab: int):
    common = {"vocab_size": vocab, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": False}
    torch.manual_seed(0)
    if architecture == "llama":
        return LlamaForCausalLM(LlamaConfig(intermediate_size=64, **common))
    if architecture == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(intermediate_size=64, **common))
    if architecture == "qwen3_moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                                                  num_experts_per_tok=2, head_dim=8, **common))
    if architecture == "qwen2_moe":
        return Qwen2MoeForCausalLM(Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                                                  num_experts_per_tok=2, shared_expert_intermediate_size=32,
                                                  **common))
    raise ValueError(architecture)


def model_directory(root, architecture: str, tokenizer=None):
    tokenizer = tokenizer or train_tokenizer()
    path = root / architecture
    build(architecture, len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_the_plain_chat_format_of_a_foreign_tokenizer():
    tokens = ChatTokens.from_tokenizer(train_tokenizer())
    vocab = train_tokenizer().get_vocab()
    assert not tokens.supports_tools
    assert tokens.stop_token_ids == (vocab["<|im_end|>"], vocab["<|endoftext|>"]) and tokens.pad_id == vocab["<|endoftext|>"]


def test_a_model_directory_is_checked_before_anything_starts(tmp_path):
    path = model_directory(tmp_path, "llama")
    check_model_directory(path)
    with pytest.raises(ModelDirectoryError, match="lacks the tool-call tokens.*env.max_tool_calls: 0"):
        check_model_directory(path, need_tools=True)
    with pytest.raises(ModelDirectoryError, match="no such folder"):
        check_model_directory(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelDirectoryError, match="no config.json"):
        check_model_directory(tmp_path / "empty")
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ModelDirectoryError, match="no weights"):
        check_model_directory(no_weights)
    (no_weights / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    with pytest.raises(ModelDirectoryError, match="no usable tokenizer"):
        check_model_directory(no_weights)
    untemplated = model_directory(tmp_path / "untemplated", "qwen2", train_tokenizer(chat_template=None))
    with pytest.raises(ModelDirectoryError, match="has no chat template"):
        check_model_directory(untemplated)


def test_routing_is_recorded_for_known_routers_and_said_not_to_be_for_others(tmp_path):
    tokenizer = train_tokenizer()
    assert routing_note(model_directory(tmp_path, "llama", tokenizer)) is None
    assert routing_note(model_directory(tmp_path, "qwen3_moe", tokenizer)) is None
    note = routing_note(model_directory(tmp_path, "qwen2_moe", tokenizer))
    assert note.startswith("routing is not recorded: qwen2_moe is a mixture-of-experts model")


def test_a_run_with_a_model_directory_that_is_not_one_is_refused_at_start(tmp_path):
    from typer.testing import CliRunner

    from sao.cli import app

    (tmp_path / "data.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    result = CliRunner().invoke(app, ["train", "--workdir", str(tmp_path / "runs"), "--lake", str(tmp_path / "lake"),
                                      "--set", f"model.path={tmp_path / 'nowhere'}",
                                      "--set", f"data.train={tmp_path / 'data.jsonl'}", "--set", "env.max_tool_calls=0"])
    assert result.exit_code == 2 and "model.path" in result.stderr and "no such folder" in result.stderr
    assert not (tmp_path / "lake").exists()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3_moe"])
def test_three_sao_steps_on_a_model_of_ones_own(architecture, tmp_path, ray_session):
    from sao import runs
    from sao.envs.base import Split
    from sao.lake.check import check_run
    from sao.lake.store import Lake
    from sao.models.policy import load_policy

    (tmp_path / "data.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump({
        "run_id": f"own-{architecture.replace('_', '-')}", "workdir": str(tmp_path / "runs"),
        "model": {"path": str(model_directory(tmp_path, architecture))},
        "data": {"train": str(tmp_path / "data.jsonl")},
        "reward": {"functions": ["sao.rewards:exact_match"]}, "env": {"max_tool_calls": 0},
        "train": {"steps": 3, "batch_size": 4, "max_staleness": 0},
        "rollout": {"num_replicas": 1, "max_tokens": 12, "max_turns": 1, "max_in_flight": 4},
        "value_pretraining": {"samples": 0}, "lake": {"root": str(tmp_path / "lake")}}))
    config, _ = resolve(config_file)
    runs.prepare_inputs(config)
    version_zero = runs.warm_start(config)
    result = runs.train_async(config, version_zero)
    assert result.steps == 3 and result.version == 3

    lake = Lake.open(config.lake.root)
    report = check_run(lake, config.run_id)
    assert report.ok, report
    rows = lake.read("trajectories", predicate=f"run_id = '{config.run_id}'").to_pylist()
    assert {row["env_name"] for row in rows} == {"dataset"} and all(row["error"] is None for row in rows)
    assert {row["task_id"] for row in rows} <= {t.task_id for t in runs.run_tasks(config, Split.TRAIN)}
    assert all((row["routed_experts"] is not None) == (architecture == "qwen3_moe") for row in rows)

    # At staleness 0 the trainer's log-probabilities are the engine's: recompute version 0's.
    policy = load_policy(version_zero)
    fresh = [row for row in rows if row["max_policy_version"] == 0 and row["completion_ids"]]
    assert fresh
    worst = 0.0
    with torch.no_grad():
        for row in fresh:
            ids = torch.tensor([row["prompt_ids"] + row["completion_ids"]])
            logits = policy(ids).logits[0, len(row["prompt_ids"]) - 1:-1].float()
            recomputed = torch.log_softmax(logits, -1).gather(1, torch.tensor(row["completion_ids"])[:, None])[:, 0]
            mask = torch.tensor(row["action_mask"], dtype=torch.bool)
            worst = max(worst, float((recomputed[mask] - torch.tensor(row["logprobs"])[mask]).abs().max()))
    assert worst < 1e-5, worst
