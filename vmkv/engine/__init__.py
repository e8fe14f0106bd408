"""The serving engine: scheduler, model runner, sampler, and the LLM front door."""
