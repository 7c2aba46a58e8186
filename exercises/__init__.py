"""Your work: fill in each stub, then run `make grade`."""
