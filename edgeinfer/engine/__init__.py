"""Engine core: the engine thread, scheduler, KV allocator, prefix cache, sampling, stops."""
