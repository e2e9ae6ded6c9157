"""`planc suggest`: search sharding plans for the fastest one that fits a per-rank memory budget."""
