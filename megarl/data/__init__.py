"""Data: prompt files in, one PromptBatch per step out, and the Batch that flows through the loop.

- batch.py         the Batch record type (every stage's contract)
- datasets.py      reading / checking verl-schema parquet files (DataError names file, row, column)
- prompts.py       chat template or raw text -> token ids; max_prompt_length and truncation
- sampler.py       the seeded, weighted, resumable (file, row) sampler
- stream.py        build_train_stream / load_val_prompts: config -> PromptBatch per step
- prompt_batch.py  PromptBatch: a step's prompts and their metadata
- convert.py       raw JSONL / CSV -> parquet (gsm8k, math, generic)
- summary.py       what `megarl data inspect` reports
- tasks.py         the CPU demo's synthetic task (reverse digit strings)

Nothing is imported here, so `import megarl.data.batch` stays light.
"""
