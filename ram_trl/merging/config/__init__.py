"""The merge configuration: schema, resolved settings, mergekit's slices, tokenizer and chat template, resolution."""
