"""The merge configuration: its schema, the resolved settings, mergekit's slices, the tokenizer and chat template,
and the resolution of a whole config (:mod:`.resolve`)."""
