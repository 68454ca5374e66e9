"""The /v1/files store: uploads streamed to disk under quotas, resolved by id for media parts."""
