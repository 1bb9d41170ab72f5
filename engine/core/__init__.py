"""One replica's core: the block pool, the KV cache manager, the scheduler and its P/D bookkeeping
(`kv_loads`)."""
