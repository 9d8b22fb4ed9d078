"""EAGLE-3 speculative-decoding drafts: the draft model, its training-time-test unroll, the recipe."""
