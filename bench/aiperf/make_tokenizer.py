"""Writes a Hugging Face tokenizer directory that counts tokens exactly as podsim does.

podsim (bench/podsim/src/tokenizer.rs) makes each run of alphanumeric characters one token and each
other non-whitespace character one token; whitespace only separates. AIPerf needs a tokenizer to size
its synthetic prompts and to count reply tokens. With this one, the prompt lengths AIPerf asks for are
the lengths podsim sees, and its output-token counts match podsim's `usage`, with nothing fetched from
a model hub.

The vocabulary is every word of the corpus AIPerf builds its prompts from (shipped inside the aiperf
package) plus ASCII punctuation, so prompts decode back to the same text. Words outside it (podsim's generated replies) map to
one [UNK] each, which still counts one token per word.

Usage: python make_tokenizer.py OUT_DIR
"""

import json
import pathlib
import string
import sys

import aiperf
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

# podsim: alphanumeric runs, or single non-space characters. Python's \w would also take '_', which
# podsim treats as punctuation, so spell the classes out.
PIECE = Regex(r"[^\W_]+|[^\s\w]|_")


# podsim's chat template (`chat_prompt_tokens`): `<|role|> content` per message, then `<|assistant|>`.
# With `--apply-chat-template`, AIPerf counts the same prompt tokens the pods report in `usage`.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def pre_tokenizer():
    return pre_tokenizers.Split(PIECE, behavior="isolated", invert=False)


def corpus_words() -> list[str]:
    corpus = pathlib.Path(aiperf.__file__).parent / "dataset/generator/assets/shakespeare.txt"
    pre = pre_tokenizer()
    words = set()
    for line in corpus.read_text(encoding="utf-8").splitlines():
        for piece, _ in pre.pre_tokenize_str(line):
            if piece.strip():
                words.add(piece)
    return sorted(words)


def build() -> Tokenizer:
    vocab = {"[UNK]": 0}
    # The corpus has no punctuation; podsim's replies and chat payloads may.
    for w in [*corpus_words(), *string.punctuation]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    # Whitespace pieces are dropped like podsim drops them: split on whitespace first.
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizer()])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return tok


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    build().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "[UNK]",
                "model_max_length": 1_000_000,
                "clean_up_tokenization_spaces": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    print(f"wrote {out}/tokenizer.json")


if __name__ == "__main__":
    main()
