"""The merge configuration: its schema (:mod:`.schema`), the resolved settings (:mod:`.settings`), mergekit's slices
(:mod:`.slices`), the tokenizer and chat template (:mod:`.tokens`) and the resolution of a whole config
(:mod:`.resolve`)."""
