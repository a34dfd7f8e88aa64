"""The estimate floor: the llmem engine. Model states, the step's moments, its allocation schedule and the replay
through the allocator model (engine.estimate), from a set-up resolved once (llmem.model.resolved)."""
