"""A model directory of the user's own: three architectures built from config here (dense Llama and
Qwen2, Qwen3-MoE), each with a tokenizer trained here and a ChatML chat template (none of this
project's special tokens), trained 3 SAO steps from a config file through Serve, the lake and Ray Train."""

import json

import pytest
import torch
import transformers
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

from sao.config import ConfigError, resolve
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


def _others(vocab: int, positions: int = 256) -> dict:
    """Builders of architectures beyond the three trained end to end (run through the engine only), each
    ``positions`` long at most."""
    small = {"vocab_size": vocab, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "max_position_embeddings": positions}
    gqa = small | {"intermediate_size": 64, "num_key_value_heads": 2}
    moe = gqa | {"num_experts_per_tok": 2}
    return {
        "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**gqa)),
        "phi3": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(pad_token_id=0, **gqa)),
        "gemma2": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(head_dim=8, **gqa)),
        "olmo2": lambda: transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**gqa)),
        "gpt_neox": lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(intermediate_size=64, **small)),
        "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2,
                                                                              n_head=4, n_positions=positions)),
        "phi": lambda: transformers.PhiForCausalLM(transformers.PhiConfig(intermediate_size=64, **small)),
        "starcoder2": lambda: transformers.Starcoder2ForCausalLM(transformers.Starcoder2Config(**gqa)),
        "opt": lambda: transformers.OPTForCausalLM(transformers.OPTConfig(ffn_dim=64, word_embed_proj_dim=32, **small)),
        "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=4, **moe)),
        "olmoe": lambda: transformers.OlmoeForCausalLM(transformers.OlmoeConfig(num_experts=4, **moe)),
        "llama4_text": lambda: transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
            num_local_experts=4, head_dim=8, intermediate_size_mlp=64, attention_chunk_size=128,
            **(moe | {"num_experts_per_tok": 1}))),  # both layers with RoPE (a no-RoPE layer every 4th)
        # refused: a no-RoPE layer with attention temperature tuning, as every Llama 4 checkpoint has
        "llama4_nope": lambda: transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
            num_local_experts=4, head_dim=8, intermediate_size_mlp=64, attention_chunk_size=128,
            no_rope_layers=[1, 0], **(moe | {"num_experts_per_tok": 1}))),
        # refused: attention outside the interface, latent attention, attention sinks
        "stablelm": lambda: transformers.StableLmForCausalLM(transformers.StableLmConfig(**gqa)),
        "falcon": lambda: transformers.FalconForCausalLM(transformers.FalconConfig(vocab_size=vocab, hidden_size=32,
                                                                                  num_hidden_layers=2, num_attention_heads=4)),
        "bloom": lambda: transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=vocab, hidden_size=32,
                                                                               n_layer=2, n_head=4)),
        "deepseek_v3": lambda: transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            moe_intermediate_size=32, n_routed_experts=4, n_group=1, topk_group=1, first_k_dense_replace=1,
            kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
            **(moe | {"num_key_value_heads": 4}))),
        "gpt_oss": lambda: transformers.GptOssForCausalLM(transformers.GptOssConfig(num_local_experts=4, head_dim=8, **moe)),
        # refused: layers that mix tokens by a recurrence or a convolution (each reports the attention
        # interface, so only this check stops them; measured: RecurrentGemma's samples under concurrent
        # requests had log-probabilities 0.07-0.13 off the model's, LFM2's failed)
        "recurrent_gemma": lambda: transformers.RecurrentGemmaForCausalLM(transformers.RecurrentGemmaConfig(
            lru_width=32, block_types=["recurrent", "attention"], **gqa)),
        "lfm2": lambda: transformers.Lfm2ForCausalLM(transformers.Lfm2Config(layer_types=["conv", "full_attention"],
                                                                            **gqa)),
    }


REFUSED = {"stablelm": "attention does not go through Transformers' attention interface",
           "falcon": "attention does not go through Transformers' attention interface",
           "bloom": "attention does not go through Transformers' attention interface",
           "deepseek_v3": "multi-head latent attention", "gpt_oss": "attention sinks",
           "recurrent_gemma": "mixes tokens in RecurrentGemmaRecurrentBlock layers",
           "lfm2": "mixes tokens in Lfm2ShortConv layers",
           "llama4_nope": "scales the queries of its layers without RoPE by a position it takes from the cache"}


def build(architecture: str, vocab: int, positions: int = 256):
    common = {"vocab_size": vocab, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": positions, "tie_word_embeddings": False}
    torch.manual_seed(0)
    others = _others(vocab, positions)
    if architecture in others:
        return others[architecture]()
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


def model_directory(root, architecture: str, tokenizer=None, positions: int = 256):
    """A model of ``architecture`` (``positions`` long at most) and ``tokenizer`` saved under ``root``."""
    tokenizer = tokenizer or train_tokenizer()
    path = root / architecture
    build(architecture, len(tokenizer), positions).save_pretrained(path)
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
    with pytest.raises(ModelDirectoryError, match="lacks the tool-call tokens.*Hermes JSON.*XML.*GLM-4.5.*bare JSON.*Mistral.*env.max_tool_calls: 0"):
        check_model_directory(path, need_tools=True, own_format=True)
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
    from tests.rollout.test_chat_endpoint import qwen_style_tokenizer

    hermes = model_directory(tmp_path / "hermes", "qwen2", qwen_style_tokenizer())  # renders Hermes tool calls
    accepted = check_model_directory(hermes, need_tools=True, own_format=True)  # tasks of one's own
    assert not ChatTokens.from_tokenizer(accepted).supports_tools
    with pytest.raises(ModelDirectoryError, match="the built-in math_tool task is written in: give your tasks"):
        check_model_directory(hermes, need_tools=True)  # math_tool: this project's format
    from tests.rollout.test_chat_endpoint import TEMPLATES

    xml = model_directory(tmp_path / "xml", "qwen2", qwen_style_tokenizer((TEMPLATES / "qwen3_5.jinja").read_text()))
    check_model_directory(xml, need_tools=True, own_format=True)  # Qwen3.5's XML calls
    from tests.rollout.test_chat_endpoint import llama_style_tokenizer

    llama32 = model_directory(tmp_path / "llama32", "llama", llama_style_tokenizer())
    check_model_directory(llama32, need_tools=True, own_format=True)  # Llama 3.2's bare JSON calls
    from tests.rollout.test_chat_endpoint import glm_style_tokenizer

    glm = model_directory(tmp_path / "glm", "qwen2", glm_style_tokenizer())
    ends = glm_style_tokenizer().convert_tokens_to_ids(["<|endoftext|>", "<|user|>", "<|observation|>"])
    (glm / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))  # as GLM-4.5's checkpoints end
    accepted = check_model_directory(glm, need_tools=True, own_format=True)  # GLM-4.5's key-value lines
    assert set(ChatTokens.from_tokenizer(accepted).stop_token_ids) == set(ends)
    from tests.rollout.test_chat_endpoint import MISTRAL13_TEMPLATE, mistral_style_tokenizer

    mistral = model_directory(tmp_path / "mistral", "mistral", mistral_style_tokenizer())
    check_model_directory(mistral, need_tools=True, own_format=True)  # Mistral's [TOOL_CALLS] lists
    ministral = model_directory(tmp_path / "ministral", "mistral", mistral_style_tokenizer(MISTRAL13_TEMPLATE))
    check_model_directory(ministral, need_tools=True, own_format=True)  # [TOOL_CALLS] before each call
    nemotron = (TEMPLATES / "nemotron_3_nano.jinja").read_text()
    nemotron = model_directory(tmp_path / "nemotron", "qwen2", qwen_style_tokenizer(nemotron))
    with pytest.raises(ModelDirectoryError, match="cannot call tools in its own format: it renders the assistant's "
                       "reply otherwise than after the generation prompt"):
        check_model_directory(nemotron, need_tools=True, own_format=True)
    untemplated = model_directory(tmp_path / "untemplated", "qwen2", train_tokenizer(chat_template=None))
    with pytest.raises(ModelDirectoryError, match="has no chat template"):
        check_model_directory(untemplated)


def test_chat_template_kwargs_are_set_in_the_template_of_version_0(tmp_path):
    """model.chat_template_kwargs {enable_thinking: false}: the start check and version 0 see Qwen3's
    template with its thinking off (the generation prompt closes an empty thinking block), the
    checkpoint's tokenizer carries the variable, and its recorded template hash is of that template.
    With tool calls, Qwen3's template with thinking off renders an earlier reply without that block,
    so it is refused for the built-in loop, where Nemotron 3's, refused with thinking on, is accepted."""
    from sao import runs
    from sao.models.chat import prompt_ids
    from sao.models.tokenizer import chat_template_version, load_tokenizer
    from tests.rollout.test_chat_endpoint import QWEN3_TEMPLATE, TEMPLATES, qwen_style_tokenizer

    source = model_directory(tmp_path, "qwen2", qwen_style_tokenizer(QWEN3_TEMPLATE))
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    config, _ = resolve(None, [f"workdir={tmp_path / 'runs'}", f"model.path={source}", f"data.train={tmp_path / 'data.jsonl'}",
                               "env.max_tool_calls=0", "model.chat_template_kwargs={enable_thinking: false}"])
    runs.prepare_inputs(config)
    version_zero = load_tokenizer(runs.warm_start(config))
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    assert version_zero.decode(prompt_ids(version_zero, messages)).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert version_zero.chat_template.startswith("{%- set enable_thinking = false %}")
    thinking = load_tokenizer(source)
    assert not thinking.decode(prompt_ids(thinking, messages)).endswith("</think>\n\n")  # the model's own default
    assert chat_template_version(version_zero) != chat_template_version(thinking)
    with pytest.raises(ConfigError, match=r"version 0 at .* was made with model.chat_template_kwargs \{'enable_thinking': "
                       r"False\}, and the config gives \{\}"):  # a version 0 kept from before is not reused unseen
        runs.warm_start(config.with_values({"model.chat_template_kwargs": {}}))
    with pytest.raises(ModelDirectoryError, match="otherwise than after the generation prompt"):
        check_model_directory(source, need_tools=True, own_format=True, template_variables={"enable_thinking": False})
    nemotron = model_directory(tmp_path / "nemotron", "qwen2",
                               qwen_style_tokenizer((TEMPLATES / "nemotron_3_nano.jinja").read_text()))
    with pytest.raises(ModelDirectoryError, match="otherwise than after the generation prompt"):
        check_model_directory(nemotron, need_tools=True, own_format=True)
    check_model_directory(nemotron, need_tools=True, own_format=True, template_variables={"enable_thinking": False})
    with pytest.raises(ModelDirectoryError, match="model.chat_template_kwargs: chat template variable 'no way'"):
        check_model_directory(source, template_variables={"no way": 1})


def test_sft_data_warm_starts_a_model_of_ones_own_on_its_demonstrations(tmp_path):
    """sft.data: the user's model learns the demonstrations, laid out as its rollouts are (its chat
    template's generation prompt, then the completion and its end-of-turn token), before version 0."""
    from sao import runs
    from sao.models.policy import read_policy_metadata

    demos = [{"prompt": t["prompt"], "completion": t["answer"]} for t in TASKS]
    (tmp_path / "demos.jsonl").write_text("".join(json.dumps(d) + "\n" for d in demos))
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    config, _ = resolve(None, [f"workdir={tmp_path / 'runs'}", f"model.path={model_directory(tmp_path, 'llama')}",
                               f"data.train={tmp_path / 'data.jsonl'}", "env.max_tool_calls=0",
                               f"sft.data={tmp_path / 'demos.jsonl'}", "sft.max_steps=60", "sft.learning_rate=0.01",
                               "sft.batch_size=8"])
    runs.prepare_inputs(config)
    logged = []
    path = runs.warm_start(config, on_log=logged.append)
    metrics = read_policy_metadata(path).extra["sft_metrics"]
    assert metrics["demonstrations"] == 36 and metrics["held_out"] == 4 and metrics["steps"] <= 60
    assert logged[-1].success > 10 * logged[0].success and logged[-1].loss < logged[0].loss / 2
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1 + 1?"}\n')
    with pytest.raises(Exception, match="bad.jsonl: row 1: field 'completion'"):
        runs.prepare_inputs(config.with_values({"sft.data": str(tmp_path / "bad.jsonl")}))


@pytest.mark.parametrize("architecture", sorted(set(_others(300)) - set(REFUSED)))
def test_the_engine_samples_what_the_model_computes_for_architectures_no_run_test_names(architecture, tmp_path):
    """Beyond the three trained end to end: each model directory passes the start check, is imported as
    version 0, and the torch engine's log-probabilities of its samples are the model's own; the critic
    built from it freezes its attention and trains the rest."""
    from sao.models.critic import Critic, decoder_parts
    from sao.models.policy import import_policy, load_policy
    from sao.rollout.engine import SamplingParams
    from sao.rollout.torch_engine import TorchEngine

    tokenizer = train_tokenizer()
    policy_dir = import_policy(model_directory(tmp_path, architecture, tokenizer), tmp_path / "v0")
    policy = load_policy(policy_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
    engine = TorchEngine(load_policy(policy_dir))
    try:
        generations = [engine.submit(prompt, SamplingParams(max_tokens=8, seed=seed)).result(60) for seed in range(3)]
    finally:
        engine.close()
    with torch.no_grad():
        for generation in generations:
            assert len(generation.token_ids) > 0, generation.error
            logits = policy(torch.tensor([list(prompt) + list(generation.token_ids)])).logits[0, len(prompt) - 1:-1]
            recomputed = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(generation.token_ids)[:, None])[:, 0]
            assert (recomputed - torch.tensor(generation.logprobs)).abs().max() < 1e-5
    critic = Critic.from_policy(policy)
    attention, embeddings, norms = decoder_parts(policy.get_decoder())
    assert len(attention) == 2  # one block per decoder layer, whatever the architecture calls it

    def under(name, blocks):
        return any(name.startswith(f"backbone.{block}.") for block in blocks)

    frozen = {name for name, p in critic.named_parameters() if not p.requires_grad}
    assert {name for name, _ in critic.named_parameters() if under(name, attention)} <= frozen
    assert all(under(name, attention | embeddings | norms) for name in frozen)
    assert critic.value_head.weight.requires_grad and len(frozen) < len(list(critic.parameters()))


@pytest.mark.parametrize("architecture", sorted(REFUSED))
def test_an_architecture_the_engine_cannot_run_is_refused_before_anything_starts(architecture, tmp_path):
    with pytest.raises(ModelDirectoryError, match="the torch rollout engine cannot run it: .*" + REFUSED[architecture]):
        check_model_directory(model_directory(tmp_path, architecture))


def test_a_sliding_window_or_an_attention_chunk_bounds_a_request():
    from sao.rollout.engine import SamplingParams
    from sao.rollout.torch_engine import attention_window, check_request

    assert attention_window(transformers.MistralConfig(sliding_window=64)) == 64
    assert attention_window(transformers.Qwen2Config(sliding_window=64)) is None  # use_sliding_window: false
    assert attention_window(transformers.Gemma2Config(sliding_window=64)) == 64  # per-layer types, some slide
    assert attention_window(transformers.LlamaConfig()) is None
    assert attention_window(transformers.Llama4TextConfig(attention_chunk_size=32)) == 32  # chunked layers
    assert attention_window(transformers.Llama4TextConfig(attention_chunk_size=32, layer_types=["full_attention"] * 48)) is None
    assert check_request([1] * 40, SamplingParams(max_tokens=24), 300, 256, window=64) == [1] * 40
    with pytest.raises(ValueError, match="attention window \\(64 tokens: a sliding window or an attention chunk\\)"):
        check_request([1] * 41, SamplingParams(max_tokens=24), 300, 256, window=64)


def test_routing_is_recorded_for_known_routers_and_said_not_to_be_for_others(tmp_path):
    tokenizer = train_tokenizer()
    assert routing_note(model_directory(tmp_path, "llama", tokenizer)) is None
    assert routing_note(model_directory(tmp_path, "qwen3_moe", tokenizer)) is None
    note = routing_note(model_directory(tmp_path, "qwen2_moe", tokenizer))
    assert note.startswith("routing is not recorded: qwen2_moe is a mixture-of-experts model")


def test_the_built_in_math_tool_task_refuses_a_model_that_calls_tools_in_its_own_format(tmp_path):
    """math_tool's answers are this project's <answer> tags: a Hermes-rendering model of one's own is
    refused there at start, and accepted on tasks of its own."""
    from sao import runs
    from sao.config import RunConfig
    from tests.rollout.test_chat_endpoint import qwen_style_tokenizer

    model = model_directory(tmp_path, "qwen2", qwen_style_tokenizer())
    with pytest.raises(ModelDirectoryError, match="the built-in math_tool task is written in"):
        runs.prepare_inputs(RunConfig(run_id="m", workdir=str(tmp_path / "runs"), model={"path": str(model)}))
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    runs.prepare_inputs(RunConfig(run_id="o", workdir=str(tmp_path / "runs"), model={"path": str(model)},
                                  data={"train": str(tmp_path / "data.jsonl")}, env={"max_tool_calls": 2}))


def test_a_run_with_a_model_directory_that_is_not_one_is_refused_at_start(tmp_path):
    from typer.testing import CliRunner

    from sao.cli import app

    (tmp_path / "data.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    result = CliRunner().invoke(app, ["train", "--workdir", str(tmp_path / "runs"), "--lake", str(tmp_path / "lake"),
                                      "--set", f"model.path={tmp_path / 'nowhere'}",
                                      "--set", f"data.train={tmp_path / 'data.jsonl'}", "--set", "env.max_tool_calls=0"])
    assert result.exit_code == 2 and "model.path" in result.stderr and "no such folder" in result.stderr
    assert not (tmp_path / "lake").exists()


def three_steps(tmp_path, run_id: str, model, max_tool_calls: int = 0, max_tokens: int = 12, max_turns: int = 1):
    """The config file of a 3-step SAO run of ``model`` on TASKS (written beside it), one replica,
    staleness 0, no value pretraining."""
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump({
        "run_id": run_id, "workdir": str(tmp_path / "runs"), "model": {"path": str(model)},
        "data": {"train": str(tmp_path / "data.jsonl")},
        "reward": {"functions": ["sao.rewards:exact_match"]}, "env": {"max_tool_calls": max_tool_calls},
        "train": {"steps": 3, "batch_size": 4, "max_staleness": 0},
        "rollout": {"num_replicas": 1, "max_tokens": max_tokens, "max_turns": max_turns, "max_in_flight": 4},
        "value_pretraining": {"samples": 0}, "lake": {"root": str(tmp_path / "lake")}}))
    return config_file


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3_moe"])
def test_three_sao_steps_on_a_model_of_ones_own(architecture, tmp_path, ray_session):
    from sao import runs
    from sao.envs.base import Split
    from sao.models.policy import load_policy
    from tests._runs import train_and_audit

    config_file = three_steps(tmp_path, f"own-{architecture.replace('_', '-')}", model_directory(tmp_path, architecture))
    config, version_zero, rows = train_and_audit(config_file)
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


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("architecture, template", [("qwen2", "qwen2.5"), ("llama", "llama3.2"), ("qwen2", "glm4.5"),
                                                     ("mistral", "mistral"), ("mistral", "ministral3")])
def test_sao_steps_with_the_built_in_tool_loop_in_a_models_own_format(tmp_path, ray_session, architecture, template):
    """A model of one's own with a published chat template (Qwen2.5's: Hermes tool calls; Llama 3.2's:
    one bare JSON call a reply, the date read from the clock; GLM-4.5's: key-value lines, a turn that
    calls ended by <|observation|>, a stop id of its generation config), or one in Mistral's layouts (a
    [TOOL_CALLS] list, or [TOOL_CALLS] before each call after a system prompt that reads the date; no
    generation prompt), none of this project's tool tokens, on
    tasks that allow tool calls: the replicas offer the python tool in every prompt, 3 SAO steps train
    through Serve, the lake and Ray Train, the lake's audit passes, and stored trajectories replay (the
    prompt re-rendered through the template, the reward and the end re-scored). The random model writes
    no call a template would parse: the calls are tested in tests/rollout/test_env_agent.py."""
    from sao.lake.store import Lake
    from sao.models.chat import TEMPLATE_CLOCK
    from sao.train.trajectory_replay import replay_trajectory
    from tests._runs import train_and_audit
    from tests.rollout.test_chat_endpoint import (
        MISTRAL13_TEMPLATE,
        QWEN25_TEMPLATE,
        glm_style_tokenizer,
        llama_style_tokenizer,
        mistral_style_tokenizer,
        qwen_style_tokenizer,
    )

    tokenizer = {"qwen2.5": lambda: qwen_style_tokenizer(QWEN25_TEMPLATE), "llama3.2": llama_style_tokenizer,
                 "glm4.5": glm_style_tokenizer, "mistral": mistral_style_tokenizer,
                 "ministral3": lambda: mistral_style_tokenizer(MISTRAL13_TEMPLATE)}[template]()
    model = model_directory(tmp_path, architecture, tokenizer, positions=2048)  # the tools' prompt is long
    if template == "glm4.5":  # its checkpoints end generation at <|user|> and <|observation|> as well
        ends = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|user|>", "<|observation|>"])
        (model / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    config, _, rows = train_and_audit(three_steps(tmp_path, "own-tools", model, max_tool_calls=2, max_tokens=16,
                                                  max_turns=3))
    assert rows and all(row["error"] is None for row in rows)
    prompts = [tokenizer.decode(row["prompt_ids"]) for row in rows]
    assert all('"name": "python"' in prompt and "Run Python code in a sandbox" in prompt for prompt in prompts)
    if template == "llama3.2":
        assert all(f"Today Date: {TEMPLATE_CLOCK:%d %b %Y}\n" in prompt for prompt in prompts)
    if template == "ministral3":
        assert all(f"Today is {TEMPLATE_CLOCK:%Y-%m-%d}.[/SYSTEM_PROMPT]" in prompt for prompt in prompts)
    lake = Lake.open(config.lake.root)
    for row in rows[:4]:
        report = replay_trajectory(lake, row["trajectory_id"], run_id=config.run_id)
        assert report.ok and report.check("prompt").ok, report


@pytest.mark.parametrize(("model_type", "mixer"), [
    ("qwen3_5", "Qwen3_5GatedDeltaNet"), ("qwen3_next", "Qwen3NextGatedDeltaNet"),
    ("nemotron_h", "NemotronHMamba2Mixer"), ("jamba", "JambaMambaMixer"), ("mamba", "MambaMixer"),
])
def test_a_hybrid_or_recurrent_model_is_refused_naming_the_layers_that_mix_tokens(model_type, mixer):
    """Built on the meta device from Transformers' default config (nothing computed): the reason names
    the layer class, not the attention interface these models also lack."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from sao.rollout.torch_engine import engine_support

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type).get_text_config())
    assert engine_support(model).startswith(f"{type(model).__name__} mixes tokens in {mixer} layers")
    assert engine_support(build("qwen2", 300)) is None  # attention only


@pytest.mark.parametrize(("model_type", "state"), [("rwkv", "state"), ("xlstm", "cache_params")])
def test_a_recurrent_model_without_attention_is_refused_for_its_recurrence(model_type, state):
    """RWKV and xLSTM hold no convolution: they are known by the state their forward carries from token
    to token instead of keys and values, and refused for that, not for an attention interface they
    have no attention for."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from sao.rollout.torch_engine import engine_support

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type).get_text_config())
    reason = engine_support(model)
    assert reason.startswith(f"{type(model).__name__} mixes tokens by a recurrence, not attention (its forward "
                             f"carries {state!r}") and "attention interface" not in reason


def test_an_audio_towers_convolutions_are_not_the_text_decoders_token_mixing():
    """Phi-4-multimodal's causal LM holds an audio encoder with Conv1d layers; its text decoder is
    attention only."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from sao.rollout.torch_engine import engine_support

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("phi4_multimodal"))
    assert any(isinstance(m, torch.nn.Conv1d) for m in model.modules())
    assert "mixes tokens" not in (engine_support(model) or "")
