"""Models built from code in Hugging Face formats: the policy, its tokenizer and chat format, the critic.

Modules: ``chat`` (the conversation format as token ids: special tokens, stop ids, observation
segments, parsers), ``tokenizer`` (byte-level BPE + chat template, content-hash versions), ``policy``
(tiny Qwen3-MoE factory, save/load), ``critic`` (value model with frozen attention).
"""
