"""Write the tiny random-weight Llama the real-engine tier serves (run under `.venv-sglang`).

The engines load it with `--load-format dummy`, so no weights are written or downloaded: the
directory holds a Hugging Face `config.json` (2 layers, hidden 64, vocab 1024) and a byte-level
BPE tokenizer trained here with `tokenizers` on a seeded synthetic corpus, plus a chat template.
Usage: `python make_model.py DIR` (idempotent: an existing complete directory is kept).
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from pathlib import Path

VOCAB_SIZE = 1024
MAX_POSITIONS = 4096
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
# One turn per message, then the assistant's cue when asked to generate.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Bumped whenever the files below change, so a stale cache is rebuilt.
FORMAT = "trio_pd-tiny-llama-1"


def model_config() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
    }


def corpus(lines: int = 4000) -> list[str]:
    """Seeded pseudo-words: enough distinct pairs for the BPE to reach the full vocabulary."""
    rng = random.Random(18)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    weights = [len(letters) - i for i in range(len(letters))]
    out = []
    for _ in range(lines):
        words = [
            "".join(rng.choices(letters, weights, k=rng.randint(1, 9)))
            for _ in range(rng.randint(4, 16))
        ]
        out.append(" ".join(words) + rng.choice([".", ",", "?", "!", " 42", " 2026"]))
    return out


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} tokens, want {VOCAB_SIZE}")
    return tok


def write(directory: Path) -> None:
    stamp = directory / "trio_pd_format"
    if stamp.exists() and stamp.read_text() == FORMAT:
        return
    directory.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed, so a concurrent or interrupted build never leaves a
    # half-written model that a later run would take as complete.
    tmp = Path(tempfile.mkdtemp(prefix=directory.name + ".", dir=directory.parent))
    tmp.chmod(0o755)
    tok = train_tokenizer()
    tok.save(str(tmp / "tokenizer.json"))
    files = {
        "config.json": model_config(),
        "generation_config.json": {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "pad_token": "<unk>",
            "model_max_length": MAX_POSITIONS,
            "add_bos_token": False,
            "chat_template": CHAT_TEMPLATE,
        },
        "special_tokens_map.json": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    }
    for name, content in files.items():
        (tmp / name).write_text(json.dumps(content, indent=2) + "\n")
    (tmp / "trio_pd_format").write_text(FORMAT)
    if directory.exists():
        for child in directory.iterdir():
            child.unlink()
        directory.rmdir()
    os.rename(tmp, directory)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    write(Path(sys.argv[1]))
