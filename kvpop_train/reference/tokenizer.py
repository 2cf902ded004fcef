"""Word-level tokenizer for the task language, saved in the Hugging Face format.

The task language is a closed vocabulary (kvpop_tasks.language), so a word-level model is
exact: one word, one token, no merges to learn. BOS is added by the post-processor so
`AutoTokenizer.from_pretrained(dir)(prompt)` yields exactly the ids the model was trained on.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from kvpop_tasks.language import WORDS

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
VOCAB: dict[str, int] = {word: i for i, word in enumerate(SPECIAL_TOKENS + WORDS)}


def build_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.WordLevel(vocab=dict(VOCAB), unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, VOCAB[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=8192,
    )


def encode_words(words: list[str] | tuple[str, ...]) -> list[int]:
    """Ids of already split words, without BOS; the fast path used to build training batches."""
    return [VOCAB[word] for word in words]


def save_tokenizer(directory: Path) -> None:
    build_tokenizer().save_pretrained(directory)
