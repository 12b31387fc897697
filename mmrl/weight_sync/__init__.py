"""Weight sync: ZeRO-3 shards -> buckets -> in-place update of the vLLM engines."""
