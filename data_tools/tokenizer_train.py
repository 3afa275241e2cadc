"""Train a sentencepiece tokenizer suited to numbers: digits split, byte fallback, identity
normalization (the text's digits and spacing reach the model as written)."""

from __future__ import annotations

import io
from pathlib import Path

from del_megatron.errors import one_line

from .readers import Fields, InputError, expand_inputs, read_records


def train_tokenizer(
    inputs: list[Path],
    out_path: Path,
    *,
    vocab_size: int = 4000,
    fields: Fields | None = None,
    max_sentences: int = 200_000,
) -> Path:
    """Write a sentencepiece .model trained on the inputs' text; returns its path."""
    import sentencepiece as spm

    fields = fields or Fields()
    files = expand_inputs(inputs)  # refused here, before sentencepiece starts
    sentences_seen = 0

    def sentences():
        nonlocal sentences_seen
        for path in files:
            for record in read_records(path, fields):
                text = record if isinstance(record, str) else record[0] + "\n" + record[1]
                for line in text.splitlines():
                    if line.strip():
                        yield line
                        sentences_seen += 1
                        if sentences_seen >= max_sentences:
                            return

    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences(),
            model_writer=model,
            vocab_size=vocab_size,
            hard_vocab_limit=False,
            model_type="bpe",
            split_digits=True,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            bos_id=1,
            eos_id=2,
            unk_id=0,
            pad_id=-1,
            num_threads=1,  # deterministic
            minloglevel=2,
        )
    except RuntimeError as err:  # sentencepiece reports every training failure so
        if sentences_seen == 0:
            raise InputError(f"no text to train on in {', '.join(map(str, inputs))}") from None
        raise InputError(f"cannot train a tokenizer: {one_line(err)}") from None
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_path.with_name(out_path.name + ".tmp")
        tmp.write_bytes(model.getvalue())
        tmp.replace(out_path)
    except OSError as err:
        raise InputError(f"{out_path}: cannot write ({err.strerror or err})") from None
    return out_path
