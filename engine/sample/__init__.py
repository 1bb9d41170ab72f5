"""Sampling: the sampler, penalties, the rejection sampler of speculative decoding, and the
structured-output grammars that mask the logits."""
