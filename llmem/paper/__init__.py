"""The paper floor: LLMem's equations (Kim et al., IJCAI 2024) as the paper states them (equations), its engine
(`--engine paper`) and the one copy of its Algorithm 1 (algorithm1)."""
