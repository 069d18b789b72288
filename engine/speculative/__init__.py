"""Speculative decoding inside the continuous batch: proposers draft tokens for decoding sequences, the
next step verifies them beside everyone else's tokens, the verifier accepts what plain decoding would have
produced (engine/speculative/verifier.py)."""
