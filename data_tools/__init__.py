"""data_tools: corpora to tokenized webdataset shards (tokenizer, synth, build, inspect)."""
