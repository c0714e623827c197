"""Speculative decoding: proposers (n-gram lookup, a draft model), exact verification, and
the rule that turns speculation off when it does not pay."""
