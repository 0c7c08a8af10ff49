"""A merged model exported as a PEFT LoRA adapter: the SVD of each merged task vector, the adapter layout."""
