"""The per-rank engine core: scheduler, KV-block bookkeeping and the step loop that drives the model runner."""
