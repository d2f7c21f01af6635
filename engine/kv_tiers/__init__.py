"""KV beyond HBM: evicted prefix blocks are demoted to pinned host memory and local disk, and promoted
back when a prompt's prefix is found there. Bookkeeping (`tier_index`, `load_policy`, `events`) is
torch-free; `store` owns the bytes and the copies."""
