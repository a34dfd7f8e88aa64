"""The plan floor: `llmem plan`. The memory engines a search uses (engines), the batch search of one layout and the
rankings (search), the time model (timing), the plan itself (planner), what would fit when nothing does
(suggestions), and launch configs for it (export)."""
