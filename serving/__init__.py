"""The serving engine: KV pool, scheduler, runner, sampling, chat parsing and the HTTP API."""
