"""The serving engine: block pool, model runner, sampling, generation."""
