"""The engine: rBlock allocator, KV pool, scheduler, runner (the one module that touches jax), sampling, front ends."""
