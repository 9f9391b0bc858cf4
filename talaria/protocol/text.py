"""Token ids as both sides of the router/instance boundary read them.

The router hashes prompt prefixes with the engine's own block-hash chain, so its prefix index
and session table name KV exactly as the instances' prefix caches and host KV stores do; and
it turns streamed token ids into text with the engine's detokenizer and stop matcher.
"""

from engine.block_hash import BlockChain, block_hashes
from engine.detokenizer import IncrementalDetokenizer, StopMatcher, decode_text

__all__ = ["BlockChain", "IncrementalDetokenizer", "StopMatcher", "block_hashes", "decode_text"]
