"""Request signatures: KV block hashing, the block cache and the calibrated signature math."""
